"""Rank 0's step checkpointer: a run resumed from it ends with an uninterrupted run's weights,
dropout and random shifts included; SIGTERM during training (in a process of its own) has it
save the model, the optimizer and the position at the next step boundary, then the process
exits 143 (StopOnSigterm)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training import checkpoints, models
from training.rank.checkpointing import StepCheckpointer
from training.rank.resume import restore_step_checkpoint

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import numpy as np
    import tensorflow as tf
    from training.checkpoints import Position
    from training.rank.checkpointing import StepCheckpointer, StopOnSigterm

    path = Path(sys.argv[1])
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.legacy.Adam(0.01), loss="mse")

    class Guard:
        diverged = None

    def position(epoch, step):
        return Position(train_url="file:///t", epoch=epoch, step=step, seed=0, num_ranks=1,
                        batch_size=2, steps_per_epoch=10)

    class TermAtStep3(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    checkpointer = StepCheckpointer(path, position, every=100, steps_per_epoch=10,
                                    backward_passes_per_step=1, guard=Guard())
    x = np.ones((20, 4), np.float32)
    model.fit(x, x[:, :2], batch_size=2, epochs=2, verbose=0,
              callbacks=[TermAtStep3(), checkpointer, StopOnSigterm(checkpointer)])
    print("not stopped")
    """
)


def test_sigterm_saves_a_step_checkpoint_and_exits_143(tmp_path: Path) -> None:
    path = tmp_path / checkpoints.STEP_CHECKPOINT
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "SIGTERM: stopped after epoch 1 step 3" in proc.stdout
    assert "not stopped" not in proc.stdout
    saved = checkpoints.load(path)
    assert (saved.position.epoch, saved.position.step) == (0, 3)
    assert [w.shape for w in saved.weights] == [(4, 2), (2,)]
    # Adam's iteration count: three steps applied.
    assert int(np.asarray(saved.optimizer[0])) == 3
    assert saved.random_counters == []  # no random layer


SEED, BATCH, STEPS, CHECKPOINT_AT = 7, 8, 6, 4


class Guard:
    diverged = None


def _model(name: str, shape: tuple[int, ...], augment: bool, rank: int) -> Any:
    """The model as every rank of a run builds it (training.worker.run)."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(SEED)
    model = models.build(name, input_shape=shape, num_classes=3, augment=augment)
    models.seed_random_layers(model, seed=SEED, rank=rank)
    model.compile(
        optimizer=tf.keras.optimizers.legacy.Adam(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _position(epoch: int, step: int) -> checkpoints.Position:
    return checkpoints.Position(
        train_url="file:///t",
        epoch=epoch,
        step=step,
        seed=SEED,
        num_ranks=1,
        batch_size=BATCH,
        steps_per_epoch=STEPS,
    )


@pytest.mark.parametrize(
    ("name", "shape", "augment"), [("dnn", (5,), False), ("cnn", (12, 12, 1), True)]
)
def test_a_resumed_run_with_dropout_or_augmentation_ends_with_the_uninterrupted_weights(
    name: str, shape: tuple[int, ...], augment: bool, tmp_path: Path
) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if name == "dnn":
        x = rng.normal(size=(STEPS * BATCH, *shape)).astype(np.float32)
    else:  # pixels as the reader hands them to image models
        x = rng.integers(0, 256, (STEPS * BATCH, *shape), dtype=np.uint8)
    y = np.arange(STEPS * BATCH) % 3
    path, kept = tmp_path / checkpoints.STEP_CHECKPOINT, tmp_path / "at-step.npz"

    class KeepCheckpoint(tf.keras.callbacks.Callback):  # type: ignore[misc]
        # The epoch's end overwrites step.npz: keep the mid-epoch one, as a kill would.
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch + 1 == CHECKPOINT_AT:
                shutil.copyfile(path, kept)

    uninterrupted = _model(name, shape, augment, rank=0)
    checkpointer = StepCheckpointer(
        path,
        _position,
        every=CHECKPOINT_AT,
        steps_per_epoch=STEPS,
        backward_passes_per_step=1,
        guard=Guard(),
    )
    uninterrupted.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[checkpointer, KeepCheckpoint()]
    )

    saved = checkpoints.load(kept)
    assert saved.position.step == CHECKPOINT_AT
    assert len(saved.random_counters) == 1 and saved.random_counters[0].any()
    resumed = _model(name, shape, augment, rank=0)
    resumed.optimizer._create_all_weights(resumed.trainable_variables)
    models.restore_random_counters(resumed, restore_step_checkpoint(resumed, saved))
    rest = slice(CHECKPOINT_AT * BATCH, None)
    resumed.fit(x[rest], y[rest], batch_size=BATCH, shuffle=False, verbose=0)

    for got, expected in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


# Horovod's optimizer (one rank, Gloo, no horovodrun) summing 2 backward passes per step, in a
# process of its own: the checkpoint at step 4 is taken with no partial sum pending.
LOCAL_AGGREGATION = textwrap.dedent(
    """
    import shutil, sys
    from pathlib import Path
    import numpy as np
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from training import checkpoints, models
    from training.rank.checkpointing import StepCheckpointer
    from training.rank.resume import restore_step_checkpoint

    hvd.init()
    SEED, BATCH, STEPS, AT = 7, 8, 8, 4
    path, kept = Path(sys.argv[1]) / "step.npz", Path(sys.argv[1]) / "at-step.npz"

    def model():
        tf.keras.utils.set_random_seed(SEED)
        m = models.build("dnn", input_shape=(5,), num_classes=3)
        models.seed_random_layers(m, seed=SEED, rank=0)
        optimizer = hvd.DistributedOptimizer(
            tf.keras.optimizers.legacy.Adam(0.01),
            backward_passes_per_step=2,
            average_aggregated_gradients=True,
        )
        m.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    class Guard:
        diverged = None

    def position(epoch, step):
        return checkpoints.Position(train_url="file:///t", epoch=epoch, step=step, seed=SEED,
                                    num_ranks=1, batch_size=BATCH, steps_per_epoch=STEPS)

    class Keep(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == AT:
                shutil.copyfile(path, kept)

    x = np.random.default_rng(0).normal(size=(STEPS * BATCH, 5)).astype(np.float32)
    y = np.arange(STEPS * BATCH) % 3
    uninterrupted = model()
    checkpointer = StepCheckpointer(path, position, every=AT, steps_per_epoch=STEPS,
                                    backward_passes_per_step=2, guard=Guard())
    uninterrupted.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                      callbacks=[checkpointer, Keep()])
    resumed = model()
    resumed.optimizer._create_all_weights(resumed.trainable_variables)
    saved = checkpoints.load(kept)
    models.restore_random_counters(resumed, restore_step_checkpoint(resumed, saved))
    resumed.fit(x[AT * BATCH:], y[AT * BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    pairs = zip(uninterrupted.get_weights(), resumed.get_weights())
    print("max difference", max(float(np.abs(a - b).max()) for a, b in pairs))
    """
)


def test_a_resume_with_two_backward_passes_per_step_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LOCAL_AGGREGATION, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    difference = float(proc.stdout.split("max difference")[-1])
    assert difference <= 1e-6, proc.stdout


def test_a_stop_saves_once_where_the_optimizer_step_is_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What StopOnSigterm asks of the checkpointer: the step after which the process ends, and
    a checkpoint there unless one was just taken or a partial sum of K backward passes is
    pending; none at the epoch's last step (the epoch's end saves) or once training diverged."""
    import tensorflow as tf

    saved: list[tuple[int, int]] = []
    monkeypatch.setattr(
        checkpoints, "save", lambda _p, position, *_a: saved.append((position.epoch, position.step))
    )
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.legacy.Adam(0.01), loss="mse")
    guard = Guard()

    def checkpointer(every: int, passes: int) -> StepCheckpointer:
        made = StepCheckpointer(
            tmp_path / checkpoints.STEP_CHECKPOINT,
            _position,
            every=every,
            steps_per_epoch=STEPS,
            backward_passes_per_step=passes,
            guard=guard,
        )
        made.set_model(model)
        made.on_epoch_begin(0)
        return made

    every_two = checkpointer(every=2, passes=1)
    every_two.on_train_batch_end(1)  # step 2: due
    assert (every_two.save_before_stop(1), saved) == (2, [(0, 2)])  # not again
    assert (every_two.save_before_stop(2), saved) == (3, [(0, 2), (0, 3)])
    assert every_two.save_before_stop(STEPS - 1) is None  # the epoch's end saves it
    saved.clear()
    two_passes = checkpointer(every=100, passes=2)
    assert (two_passes.save_before_stop(2), saved) == (3, [])  # half a step pending
    assert (two_passes.save_before_stop(3), saved) == (4, [(0, 4)])
    guard.diverged = {"epoch": 1}
    assert two_passes.save_before_stop(3) is None
