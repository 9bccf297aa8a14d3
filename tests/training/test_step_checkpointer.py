"""Rank 0's step checkpointer, in a process of its own: SIGTERM during training saves the model,
the optimizer and the position at the next step boundary, then the process exits 143."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from training import checkpoints

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import numpy as np
    import tensorflow as tf
    from training.checkpoints import Position
    from training.worker import step_checkpointer

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

    checkpointer = step_checkpointer(path, position, every=100, steps_per_epoch=10,
                                     backward_passes_per_step=1, guard=Guard())
    x = np.ones((20, 4), np.float32)
    model.fit(x, x[:, :2], batch_size=2, epochs=2, verbose=0,
              callbacks=[TermAtStep3(), checkpointer])
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
    position, weights, optimizer = checkpoints.load(path)
    assert (position.epoch, position.step) == (0, 3)
    assert [w.shape for w in weights] == [(4, 2), (2,)]
    assert int(np.asarray(optimizer[0])) == 3  # Adam's iteration count: three steps applied
