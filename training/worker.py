"""The program every Horovod rank runs: ``horovodrun ... python -m training.worker CONFIG``.

Each rank streams its own row groups, trains data-parallel, and rank 0 alone writes
checkpoints, the final model and metrics.json into the run directory.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything a rank needs, written by the launcher as JSON: the user's :class:`TrainConfig`
    and what the launcher derived from the processed version."""

    train: TrainConfig
    """How to train, as the user chose it; ``train.model`` is resolved (not None)."""
    train_url: str
    """file:// URL of the training split, which petastorm streams."""
    test_dir: str
    """The test split, evaluated on rank 0 after training."""
    run_dir: str
    """Checkpoints, TensorBoard logs, model.keras, metrics.json and curves.png go here."""
    spec: dict[str, Any]
    """The processed version's :class:`training.input.InputSpec`, as a dict."""
    num_classes: int
    steps_per_epoch: int
    """Batches every rank takes per epoch, planned from the catalog's row counts."""
    threads_per_rank: int = 0
    """Compute threads per rank; 0 shares the host's cores among its ranks."""
    evaluate: bool = True
    """Evaluate on the test split and save the model (benchmarks skip both)."""
    mean: list[float] | None = None
    """Normalisation statistics of the training split (the model's first layer)."""
    std: list[float] | None = None
    validation_dir: str | None = None
    """Evaluated after every epoch when the processed version has a validation split."""

    def __post_init__(self) -> None:
        if self.train.model is None:
            raise ValueError("WorkerConfig.train.model is None: resolve the model first")

    @classmethod
    def load(cls, path: str | Path) -> WorkerConfig:
        fields = json.loads(Path(path).read_text())
        return cls(**{**fields, "train": TrainConfig(**fields["train"])})

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))


# Rows per batch when evaluating (validation every epoch, test at the end): inference only.
EVALUATION_BATCH = 1024
# What rank 0 writes into the run directory instead of a model when training diverged; the
# launcher turns it into one line and commits nothing.
DIVERGED_NAME = "diverged.json"
# A loss this many times the run's first step's loss has exploded, even while still finite.
EXPLODED_FACTOR = 1e3
# Steps between the ranks' checks that no rank diverged (and at every epoch's end).
GUARD_EVERY = 16
# A test hook: when "1", every rank appends each batch's row ids to rows-rank-<rank>.jsonl in
# the run folder (training.input.row_ids).
RECORD_ROWS_ENV = "SHARDFLOW_TEST_RECORD_ROWS"


def _configure_threads(local_size: int, threads_per_rank: int, *, model_stages: int = 1) -> None:
    import tensorflow as tf

    from training.pipeline_parallel import inter_op_threads

    # Ranks on one host share its cores; without this each would start a pool per core.
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // local_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    # A thread per pipeline stage at least, so that the stages overlap.
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads(model_stages, threads))


def epoch_timer() -> Any:
    """A Keras callback recording each epoch's wall time in ``.seconds``."""
    import tensorflow as tf

    class EpochTimer(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._started = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._started = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seconds.append(time.perf_counter() - self._started)

    return EpochTimer()


def cosine_decay(start_epoch: int, end_epoch: int, floor: float = 0.02) -> Any:
    """Learning-rate multiplier falling from 1 at ``start_epoch`` to ``floor`` at the end."""

    def multiplier(epoch: float) -> float:
        progress = min(1.0, max(0.0, (epoch - start_epoch) / (end_epoch - start_epoch)))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def divergence(
    losses: Sequence[float], reference: float | None, factor: float = EXPLODED_FACTOR
) -> str | None:
    """What is wrong with every rank's loss of one step (``"loss nan"``), or None when training
    goes on: a loss that is not finite, or above ``factor`` times ``reference`` (the loss of
    the run's first step)."""
    for loss in losses:
        if not math.isfinite(loss):
            return f"loss {loss}"
        if reference is not None and loss > factor * reference:
            return f"loss {loss:.4g}, over {factor:g} times the first step's {reference:.4g}"
    return None


def divergence_guard(allgather: Callable[[Any, str], Any]) -> Any:
    """A Keras callback that stops training when any rank's loss diverged (:func:`divergence`)
    or, at an epoch's end, any rank's weights are not finite; ``.diverged`` then says where
    ({"epoch", "step", "reason"}, epoch and step from 1: the first step whose loss diverged).

    ``allgather(tensor, name)`` gathers a row of every rank (Horovod's): every rank decides on
    the same rows, so all of them stop after the same step, and none waits in an allreduce for
    a peer that stopped. The ranks agree every :data:`GUARD_EVERY` steps and at each epoch's
    end, not every step (one gather costs about a millisecond); each rank remembers its first
    diverged step meanwhile, and the loss Keras reports is the epoch's running mean, in which
    a NaN stays.
    """
    import tensorflow as tf

    class DivergenceGuard(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.diverged: dict[str, Any] | None = None
            self._reference: float | None = None
            self._epoch = 0
            self._step = 0
            self._loss = math.nan
            self._first_diverged: tuple[int, float] | None = None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch, self._step = epoch + 1, 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._step = batch + 1  # Keras counts from 0
            self._loss = float((logs or {}).get("loss", math.nan))
            if self._first_diverged is None and divergence([self._loss], self._reference):
                self._first_diverged = (self._step, self._loss)
            # The first step gives the reference; the same steps on every rank.
            if self._reference is None or self._step % GUARD_EVERY == 0:
                self._agree(weights_finite=True)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self.diverged is None:
                self._agree(all(np.isfinite(w).all() for w in self.model.get_weights()))

        def _agree(self, weights_finite: bool) -> None:
            step, loss = self._first_diverged or (0, 0.0)
            row = [float(step), loss, self._loss, 1.0 if weights_finite else 0.0]
            # Horovod: every rank's row, in rank order, the same on every rank.
            rows = np.asarray(allgather(tf.constant([row], tf.float64), "divergence_guard"))
            rows = rows.reshape(-1, 4)
            if self._reference is None and not rows[:, 0].any():
                self._reference = float(rows[:, 2].max())
            diverged = [(int(r[0]), float(r[1])) for r in rows if r[0] > 0]
            if diverged:
                step, loss = min(diverged, key=lambda d: d[0])
                self._stop(step, divergence([loss], self._reference) or f"loss {loss}")
            elif not rows[:, 3].all():
                self._stop(self._step, "weights not finite")

        def _stop(self, step: int, reason: str) -> None:
            self.diverged = {"epoch": self._epoch, "step": step, "reason": reason}
            self.model.stop_training = True

    return DivergenceGuard()


def checkpoint_unless_diverged(path: str, guard: Any) -> Any:
    """Keras's ModelCheckpoint (weights, every epoch) that saves nothing once ``guard``
    stopped training: a diverged epoch's weights are nothing to ``--resume`` from."""
    import tensorflow as tf

    class CheckpointUnlessDiverged(tf.keras.callbacks.ModelCheckpoint):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if guard.diverged is None:
                super().on_epoch_end(epoch, logs)

    return CheckpointUnlessDiverged(path, save_weights_only=True)


def last_checkpoint(checkpoints: Path) -> tuple[int, Path | None]:
    """(epochs done, weights file) of the newest checkpoint, or (0, None)."""
    found = sorted(checkpoints.glob("epoch-*.h5"))
    if not found:
        return 0, None
    return int(found[-1].stem.split("-")[1]), found[-1]


def shifted_batches(callback: Any, offset: int) -> Any:
    """``callback`` seeing batch ``b`` of the next epoch as ``b + offset``: a resumed run's
    shortened first epoch starts at step ``offset`` of it, and the learning-rate schedule must
    go on from there, not from the epoch's start."""
    import tensorflow as tf

    class Shifted(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def set_model(self, model: Any) -> None:
            super().set_model(model)
            callback.set_model(model)

        def set_params(self, params: Any) -> None:
            super().set_params(params)
            callback.set_params(params)

        def on_train_begin(self, logs: Any = None) -> None:
            callback.on_train_begin(logs)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            callback.on_epoch_begin(epoch, logs)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            callback.on_train_batch_begin(batch + offset, logs)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            callback.on_train_batch_end(batch + offset, logs)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            callback.on_epoch_end(epoch, logs)

    return Shifted()


def step_checkpointer(
    path: Path,
    position: Callable[[int, int], Any],
    *,
    every: int,
    steps_per_epoch: int,
    backward_passes_per_step: int,
    guard: Any,
) -> Any:
    """A Keras callback (rank 0) that saves the model, the optimizer and the input position
    (training.checkpoints) every ``every`` steps, at every epoch's end, and at the first step
    boundary after SIGTERM (then ends the process); ``position(epoch, step)`` makes the
    :class:`~training.checkpoints.Position`. ``.offset`` is the first step of the next epoch
    (a resumed run's shortened epoch); ``.mid_epoch`` False saves only at epoch ends."""
    import signal

    import tensorflow as tf

    from training import checkpoints as step_checkpoints
    from training import models

    class StepCheckpointer(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.offset = 0
            self.mid_epoch = True
            self.terminated = False
            self.training = False
            self._epoch = 0
            self._first = 0

        def handle_sigterm(self, signum: int, frame: Any) -> None:
            if not self.training:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            self.terminated = True

        def on_train_begin(self, logs: Any = None) -> None:
            self.training = True

        def on_train_end(self, logs: Any = None) -> None:
            self.training = False

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch, self._first, self.offset = epoch, self.offset, 0

        def _save(self, epoch: int, step: int) -> None:
            weights = self.model.get_weights()
            optimizer = self.model.optimizer.get_weights()
            # Rank 0's counters are every rank's (training.models.seed_random_layers).
            counters = models.random_counters(self.model)
            step_checkpoints.save(path, position(epoch, step), weights, optimizer, counters)
            print(f"step checkpoint: epoch {epoch + 1} step {step} -> {path}", flush=True)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = self._first + batch + 1
            if guard.diverged is not None or step >= steps_per_epoch:
                return
            global_step = self._epoch * steps_per_epoch + step
            due = step_checkpoints.should_save(global_step, every, backward_passes_per_step)
            aligned = global_step % backward_passes_per_step == 0
            if self.mid_epoch and (due or (self.terminated and aligned)):
                self._save(self._epoch, step)
            if self.terminated:
                print(f"SIGTERM: stopped after epoch {self._epoch + 1} step {step}", flush=True)
                os._exit(128 + signal.SIGTERM)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if guard.diverged is None:
                self._save(epoch + 1, 0)

    checkpointer = StepCheckpointer()
    signal.signal(signal.SIGTERM, checkpointer.handle_sigterm)
    return checkpointer


def restore_step_checkpoint(model: Any, checkpoint: Any) -> list[Any]:
    """Rank 0: ``checkpoint``'s weights and optimizer variables into ``model`` (compiled, its
    optimizer's slots created); returns the random counters for every rank to restore
    (``training.models.restore_random_counters``; empty from a checkpoint without them)."""
    model.set_weights(checkpoint.weights)
    model.optimizer.set_weights(checkpoint.optimizer)
    return list(checkpoint.random_counters)


def _resume_choice(checkpoints: Path, step_file: Path) -> dict[str, Any]:
    """Where rank 0 resumes from: the newest epoch checkpoint ({"kind": "epoch", "done",
    "weights"}) or the step checkpoint ({"kind": "step", "position"}) when it is as far on (it
    also holds the optimizer and the input position)."""
    from training import checkpoints as step_checkpoints

    done, weights = last_checkpoint(checkpoints)
    if step_file.is_file():
        position = step_checkpoints.load(step_file).position
        if position.epoch + position.step / position.steps_per_epoch >= done:
            return {"kind": "step", "position": asdict(position)}
    return {"kind": "epoch", "done": done, "weights": str(weights) if weights else None}


def pin_to_one_core() -> None:
    """Bind this rank, and every thread it starts from now on, to one core of its own.

    Capping TensorFlow's op pools is not enough to hold a rank to one core: tf.data and the
    petastorm reader run pools of their own. Threads inherit the affinity of the thread that
    creates them, so this runs before TensorFlow or Horovod start any.
    """
    local_rank = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def counting_compression(compression: Any, counter: Any) -> Any:
    """Horovod compression that adds the bytes of every tensor it hands to allreduce (after
    compression) to ``counter``: the allreduce payload, measured where Horovod sends it."""
    import tensorflow as tf

    class Counting(compression):  # type: ignore[misc]
        @staticmethod
        def compress(tensor: Any) -> Any:
            compressed, context = compression.compress(tensor)
            size = tf.cast(tf.size(compressed), tf.int64) * compressed.dtype.size
            counter.assign_add(size)
            return compressed, context

        @staticmethod
        def decompress(tensor: Any, context: Any) -> Any:
            return compression.decompress(tensor, context)

    return Counting


def allreduce_meter(counter: Any) -> Any:
    """A Keras callback recording the counter's growth over each epoch in ``.per_epoch``."""
    import tensorflow as tf

    class AllreduceMeter(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.per_epoch: list[int] = []
            self._start = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = int(counter.numpy())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.per_epoch.append(int(counter.numpy()) - self._start)

    return AllreduceMeter()


def interface_counters(
    interfaces: Sequence[str], proc_net_dev: Path = Path("/proc/net/dev")
) -> tuple[int, int] | None:
    """(bytes, packets) sent so far on ``interfaces`` of this process's network namespace,
    summed, from ``/proc/net/dev`` (which, unlike /sys/class/net, always shows the calling
    process's namespace); None when one of them is not there."""
    if not proc_net_dev.is_file():
        return None
    sent: dict[str, tuple[int, int]] = {}
    for line in proc_net_dev.read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        fields = counters.split()
        # receive: 8 fields, then transmit: bytes, packets, ...
        sent[name.strip()] = (int(fields[8]), int(fields[9]))
    if not all(name in sent for name in interfaces):
        return None
    return (sum(sent[n][0] for n in interfaces), sum(sent[n][1] for n in interfaces))


def wire_meter(interfaces: Sequence[str]) -> Any:
    """A Keras callback recording what this rank sent on ``interfaces`` over each epoch
    (``.bytes_by_epoch``, ``.packets_by_epoch``, ``.seconds_by_epoch``, from the interface
    counters at the epoch's boundaries) and before training, while only Horovod's control loop
    talks (``.idle``: bytes, packets, seconds from :meth:`start` to the first batch)."""
    import tensorflow as tf

    class WireMeter(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.bytes_by_epoch: list[int] = []
            self.packets_by_epoch: list[int] = []
            self.seconds_by_epoch: list[float] = []
            self.idle: tuple[int, int, float] | None = None
            self._start: tuple[tuple[int, int] | None, float] = (None, 0.0)

        def _sample(self) -> tuple[tuple[int, int] | None, float]:
            return interface_counters(interfaces), time.perf_counter()

        def start(self) -> None:
            self._start = self._sample()

        def on_train_begin(self, logs: Any = None) -> None:
            (before, started), (after, now) = self._start, self._sample()
            if before is not None and after is not None:
                self.idle = (after[0] - before[0], after[1] - before[1], now - started)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = self._sample()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            (before, started), (after, now) = self._start, self._sample()
            if before is not None and after is not None:
                self.bytes_by_epoch.append(after[0] - before[0])
                self.packets_by_epoch.append(after[1] - before[1])
                self.seconds_by_epoch.append(now - started)

        def report(self) -> dict[str, Any]:
            return {
                "bytes_by_epoch": self.bytes_by_epoch,
                "packets_by_epoch": self.packets_by_epoch,
                "seconds_by_epoch": self.seconds_by_epoch,
                "idle_bytes": self.idle[0] if self.idle else None,
                "idle_packets": self.idle[1] if self.idle else None,
                "idle_seconds": self.idle[2] if self.idle else None,
            }

    return WireMeter()


def run(config: WorkerConfig) -> None:
    train = config.train
    assert train.model is not None  # WorkerConfig refuses an unresolved model
    architecture = train.model
    # At most the run's epochs, whatever the configuration asks.
    warmup_epochs = min(train.warmup_epochs, train.epochs)
    if config.threads_per_rank == 1:
        pin_to_one_core()
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from training import checkpoints as step_checkpoints
    from training import models, pipeline_parallel
    from training.input import (
        InputSpec,
        PartialEpoch,
        in_batches,
        load_split,
        make_train_dataset,
    )
    from training.input_metrics import (
        EPOCHS_FILE,
        EpochLog,
        InputMeter,
        epoch_line,
        input_delay,
        step_meter,
        summarize,
    )

    # petastorm 0.13.1 reads through pyarrow's legacy ParquetDataset, which warns on every
    # call; pyarrow stays at 14 for it (docs/STACK.md).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")

    from training import gossip

    # Horovod: --sync pairwise averages weights on static process sets of two ranks, one per
    # pair, which every rank registers at init.
    pair_sets = gossip.pair_process_sets(train.num_ranks) if train.sync == "pairwise" else {}
    hvd.init(process_sets=gossip.registered(pair_sets))
    rank, num_ranks = hvd.rank(), hvd.size()
    # What each rank sends on the interface(s) the ranks talk over, when the run names them.
    interfaces = train.network_interface.split(",") if train.network_interface else []
    wire = wire_meter(interfaces) if interfaces else None
    if wire is not None:
        wire.start()
    # Horovod: one GPU per local rank, where there are GPUs.
    gpus = tf.config.list_physical_devices("GPU")
    stage_devices: list[str] = []
    if train.model_stages > 1:
        # Horovod: a group of model_stages GPUs per local rank, else logical CPU devices.
        stage_devices = pipeline_parallel.configure_devices(
            train.model_stages, local_rank=hvd.local_rank()
        )
    elif gpus:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    _configure_threads(
        hvd.local_size(),
        config.threads_per_rank or train.threads_per_rank,
        model_stages=train.model_stages,
    )
    tf.keras.utils.set_random_seed(train.seed)

    spec = InputSpec(**config.spec)

    def build_model(augment: bool) -> Any:
        return models.build(
            architecture,
            input_shape=spec.input_shape,
            num_classes=config.num_classes,
            mean=config.mean,
            std=config.std,
            augment=augment,
        )

    model = build_model(train.augment)
    # Horovod: each rank its own dropout masks and shifts, from (seed, rank).
    models.seed_random_layers(model, seed=train.seed, rank=rank)
    # The model as built: its variables are the stages' too, in the export's order.
    unsplit = model
    stages = pipeline_parallel.split(model, train.model_stages) if train.model_stages > 1 else []
    if stages:
        model = pipeline_parallel.pipelined(
            stages, devices=stage_devices, micro_batches=train.micro_batches
        )
    # Horovod: scale the learning rate by the number of ranks (the global batch grows with it).
    scaled_lr = train.learning_rate * num_ranks
    # Horovod: average gradients across ranks with allreduce; with K backward passes per step,
    # gradients of K local batches are summed locally and sent once (K times less traffic).
    sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="allreduce_bytes")
    compression = hvd.Compression.fp16 if train.compression == "fp16" else hvd.Compression.none
    optimizer = (
        hvd.DistributedOptimizer(
            tf.keras.optimizers.legacy.Adam(scaled_lr),
            backward_passes_per_step=train.backward_passes_per_step,
            average_aggregated_gradients=True,
            compression=counting_compression(compression, sent),
        )
        if train.sync == "allreduce"
        # --sync pairwise: each rank steps on its own gradients; training.gossip averages
        # weights with one partner every --average-every steps.
        else tf.keras.optimizers.legacy.Adam(scaled_lr)
    )
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    run_dir = Path(config.run_dir)
    checkpoints = run_dir / "checkpoints"
    step_file = checkpoints / step_checkpoints.STEP_CHECKPOINT
    initial_epoch = 0
    # A mid-epoch resume: the rest of epoch ``initial_epoch`` first (``partial_steps`` steps,
    # the first of them step ``step_offset`` of the schedule), then whole epochs.
    partial: PartialEpoch | None = None
    partial_steps = 0
    step_offset = 0
    resumed_at: dict[str, Any] | None = None
    if train.resume:
        # Horovod: rank 0 decides where to resume from and tells the others.
        choice = _resume_choice(checkpoints, step_file) if rank == 0 else None
        choice = hvd_tf.broadcast_object(choice, root_rank=0)
        # Horovod: every rank creates the optimizer's slots, so that all of them are broadcast.
        optimizer._create_all_weights(model.trainable_variables)
        if choice["kind"] == "epoch":
            initial_epoch = choice["done"]
            if rank == 0 and choice["weights"] is not None:
                model.load_weights(choice["weights"])
                print(f"resuming after epoch {initial_epoch} from {choice['weights']}", flush=True)
        else:
            position = step_checkpoints.Position(**choice["position"])
            plan = step_checkpoints.plan_resume(
                position, num_ranks=num_ranks, batch_size=train.batch_size
            )
            counters = None
            if rank == 0:
                counters = restore_step_checkpoint(model, step_checkpoints.load(step_file))
                print(plan.note, flush=True)
            # Horovod: rank 0's random counters to every rank, which keeps its own keys.
            counters = hvd_tf.broadcast_object(counters, root_rank=0)
            if counters:
                models.restore_random_counters(model, counters)
            initial_epoch = plan.epoch
            if plan.steps and (plan.sources or plan.steps < config.steps_per_epoch):
                partial_steps = plan.steps
                step_offset = config.steps_per_epoch - plan.steps
                partial = PartialEpoch(
                    skip=0 if plan.sources else position.step,
                    sources=plan.sources[rank] if plan.sources else None,
                    old_num_ranks=position.num_ranks,
                    old_steps=position.steps_per_epoch,
                )
            resumed_at = {"epoch": plan.epoch + 1, "step": step_offset, "note": plan.note}
        # Horovod: every rank starts from rank 0's restored weights and optimizer state (the
        # callback below broadcasts only after the first step, which must already be equal).
        hvd_tf.broadcast_variables(model.variables, root_rank=0)
        hvd_tf.broadcast_variables(optimizer.variables(), root_rank=0)
    # What each rank's input and steps take (every rank records its own; gathered after fit).
    input_meter = InputMeter()
    # A test hook: slows one rank's input on purpose (SHARDFLOW_TEST_INPUT_DELAY); 0 otherwise.
    test_delay = input_delay(rank, os.environ)
    # A test hook: every batch's row ids, per rank, into the run folder.
    record_rows = (
        run_dir / f"rows-rank-{rank}.jsonl" if os.environ.get(RECORD_ROWS_ENV) == "1" else None
    )

    def train_dataset(first: int, last: int, part: PartialEpoch | None) -> Any:
        # Epochs first..last-1 in their planned order (a resumed run reads what it would have).
        return make_train_dataset(
            config.train_url,
            spec,
            rank=rank,
            num_ranks=num_ranks,
            batch_size=train.batch_size,
            steps_per_epoch=config.steps_per_epoch,
            seed=train.seed,
            shuffle_buffer=train.shuffle_buffer,
            first_epoch=first,
            epochs=last,
            meter=input_meter,
            test_delay=test_delay,
            partial=part,
            record_rows=record_rows,
        )

    validation = (
        in_batches(load_split(config.validation_dir, spec), EVALUATION_BATCH)
        if config.validation_dir is not None
        else None
    )
    callbacks: list[Any] = [
        # Horovod: start every rank from rank 0's initial weights.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: report metrics averaged over all ranks.
        hvd.callbacks.MetricAverageCallback(),
    ]
    schedules: list[Any] = []
    if warmup_epochs:
        # Horovod: ramp the scaled learning rate up over the first epoch(s).
        schedules.append(
            hvd.callbacks.LearningRateWarmupCallback(
                initial_lr=scaled_lr,
                warmup_epochs=warmup_epochs,
                steps_per_epoch=config.steps_per_epoch,
                verbose=0,
            )
        )
    if train.epochs > warmup_epochs:
        # Then a cosine decay to the end: on short schedules the last epoch at a low rate is
        # worth about a point of test accuracy.
        schedules.append(
            hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=scaled_lr,
                multiplier=cosine_decay(warmup_epochs, train.epochs),
                start_epoch=warmup_epochs,
                staircase=False,
                steps_per_epoch=config.steps_per_epoch,
            )
        )
    callbacks += schedules
    # After MetricAverageCallback and before the checkpoint, which it keeps from saving a
    # diverged epoch.
    guard = divergence_guard(lambda tensor, name: hvd_tf.allgather(tensor, name=name).numpy())
    callbacks.append(guard)
    if rank == 0:
        # Horovod: checkpoints and logs on rank 0 only, so that ranks do not overwrite each other.
        checkpoints.mkdir(parents=True, exist_ok=True)
        callbacks.append(
            checkpoint_unless_diverged(str(checkpoints / "epoch-{epoch:03d}.h5"), guard)
        )
        callbacks.append(
            tf.keras.callbacks.TensorBoard(log_dir=str(run_dir / "tensorboard"), profile_batch=0)
        )
    checkpointer = None
    if rank == 0 and train.checkpoint_every:

        def position_at(epoch: int, step: int) -> step_checkpoints.Position:
            return step_checkpoints.Position(
                train_url=config.train_url,
                epoch=epoch,
                step=step,
                seed=train.seed,
                num_ranks=num_ranks,
                batch_size=train.batch_size,
                steps_per_epoch=config.steps_per_epoch,
            )

        checkpointer = step_checkpointer(
            step_file,
            position_at,
            every=train.checkpoint_every,
            steps_per_epoch=config.steps_per_epoch,
            backward_passes_per_step=train.backward_passes_per_step,
            guard=guard,
        )
        callbacks.append(checkpointer)
    timer = epoch_timer()
    meter = allreduce_meter(sent)
    epoch_log = EpochLog(run_dir / EPOCHS_FILE)

    def publish_epoch(epoch: int, record: dict[str, Any]) -> None:
        # Horovod: every rank's figures of this epoch to rank 0, which rewrites the per-epoch
        # file and says so (the launcher's caller reads it while training goes on).
        gathered = hvd_tf.allgather_object(record, name="input_epoch")
        if rank == 0:
            epoch_log.add(epoch, gathered)
            print(epoch_line(epoch, epoch_log.path), flush=True)

    # Horovod: one TensorBoard folder per rank for its input scalars.
    step_times = step_meter(
        input_meter,
        rank,
        str(run_dir / "tensorboard" / f"rank-{rank}"),
        on_epoch=publish_epoch,
    )
    callbacks += [timer, meter, step_times]
    averaging = None
    if train.sync == "pairwise":
        # Horovod: after the initial broadcast (the first callback), every K steps.
        averaging = gossip.pairwise_averaging(rank, num_ranks, train.average_every, pair_sets)
        callbacks.append(averaging)
    if wire is not None:
        callbacks.append(wire)
    started = time.perf_counter()
    history: dict[str, list[float]] = {}
    first_full = initial_epoch
    if partial is not None:
        # The rest of the interrupted epoch, as one shortened epoch whose schedule starts at
        # the step it stopped at; then the whole epochs.
        first_full = initial_epoch + 1
        if checkpointer is not None:
            checkpointer.offset = step_offset
            # Another rank count's partial epoch is no step of this run's plan: epoch ends only.
            checkpointer.mid_epoch = partial.sources is None
        shortened = [shifted_batches(c, step_offset) if c in schedules else c for c in callbacks]
        fitted = model.fit(
            train_dataset(initial_epoch, first_full, partial),
            steps_per_epoch=partial_steps,
            epochs=first_full,
            initial_epoch=initial_epoch,
            callbacks=shortened,
            validation_data=validation,
            verbose=2 if rank == 0 else 0,
        )
        history = {k: list(v) for k, v in fitted.history.items()}
        if checkpointer is not None:
            checkpointer.mid_epoch = True
    if first_full < train.epochs and guard.diverged is None:
        fitted = model.fit(
            train_dataset(first_full, train.epochs, None),
            steps_per_epoch=config.steps_per_epoch,
            epochs=train.epochs,
            initial_epoch=first_full,
            callbacks=callbacks,
            validation_data=validation,
            verbose=2 if rank == 0 else 0,
        )
        for k, v in fitted.history.items():
            history.setdefault(k, []).extend(v)
    train_seconds = time.perf_counter() - started
    # Horovod: the model version of a pairwise run is the mean of every rank's model (one
    # allreduce over all ranks, after the wire meter's last epoch).
    final_average_bytes = gossip.average_all(model) if averaging is not None else 0
    pairwise_by_rank = (
        hvd_tf.allgather_object(averaging.report(), name="pairwise") if averaging else None
    )
    # Horovod: every rank's wire counters, in rank order, to rank 0 (after the last epoch's
    # counters were read: this gather is not counted in them).
    wire_by_rank = (
        hvd_tf.allgather_object(wire.report(), name="wire_meter") if wire is not None else None
    )
    # Horovod: every rank's input metrics, in rank order, to rank 0 (once, after training).
    input_by_rank = hvd_tf.allgather_object(step_times.report(), name="input_meter")
    # Horovod: every rank's measured memory (peak RSS; allocator peaks where tracked).
    devices = stage_devices or ["/GPU:0" if gpus else "/CPU:0"]
    memory_by_rank = hvd_tf.allgather_object(
        pipeline_parallel.measured_memory(devices), name="memory"
    )
    if rank != 0:
        return
    if guard.diverged is not None:
        # No model, no metrics: the launcher reports this and commits nothing.
        (run_dir / DIVERGED_NAME).write_text(json.dumps(guard.diverged))
        print(f"training diverged: {guard.diverged}", flush=True)
        return

    epochs_run = train.epochs - initial_epoch
    samples_per_epoch = config.steps_per_epoch * train.batch_size * num_ranks
    # What each rank hands to allreduce per epoch: every trainable gradient once per optimizer
    # step (one step per K backward passes), at 2 bytes per value with fp16 compression.
    gradient_values = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    value_bytes = 2 if train.compression == "fp16" else 4
    # One allreduce per K steps, counted across epoch ends (Horovod carries the partial sum).
    allreduces = config.steps_per_epoch / train.backward_passes_per_step
    metrics: dict[str, Any] = {
        "num_ranks": num_ranks,
        "epochs": train.epochs,
        "steps_per_epoch": config.steps_per_epoch,
        "global_batch_size": train.batch_size * num_ranks,
        "backward_passes_per_step": train.backward_passes_per_step,
        "compression": train.compression,
        "resumed_after_epoch": initial_epoch,
        # A mid-epoch resume: the epoch (from 1) and step it continued at, and how.
        "resumed_at": resumed_at,
        "gradient_values": gradient_values,
        # Measured: bytes rank 0 handed to allreduce in each epoch (after compression).
        "allreduce_bytes_by_epoch": meter.per_epoch,
        "allreduce_bytes_per_epoch": int(np.mean(meter.per_epoch)) if meter.per_epoch else 0,
        # Computed from the model, for comparison: every gradient once per optimizer step.
        "allreduce_bytes_per_epoch_computed": round(gradient_values * value_bytes * allreduces),
        "history": {k: [float(v) for v in vs] for k, vs in history.items()},
        "epoch_seconds": timer.seconds,
        "train_seconds": train_seconds,
        "samples_per_second": samples_per_epoch * epochs_run / train_seconds,
        "model_stages": train.model_stages,
        "micro_batches": train.micro_batches,
        # Measured per rank: peak RSS, and allocator peaks where TensorFlow tracks them.
        "memory_by_rank": memory_by_rank,
        # Modelled from shapes: what each device of a rank holds for its stage (one device
        # for the whole model when unsplit).
        "memory_by_device_modelled": pipeline_parallel.modelled_memory(
            stages or pipeline_parallel.whole(unsplit),
            batch_size=train.batch_size,
            devices=devices,
        ),
    }
    if pairwise_by_rank is not None:
        # Payload each rank handed to its pairwise averages per epoch (rank 0's as the
        # allreduce payload), and the final average's.
        metrics["sync"] = train.sync
        metrics["average_every"] = train.average_every
        metrics["pairwise_by_rank"] = pairwise_by_rank
        metrics["allreduce_bytes_by_epoch"] = pairwise_by_rank[0]["bytes_by_epoch"]
        metrics["allreduce_bytes_per_epoch"] = int(np.mean(pairwise_by_rank[0]["bytes_by_epoch"]))
        metrics["allreduce_bytes_per_epoch_computed"] = None
        metrics["final_average_bytes"] = final_average_bytes
    if wire_by_rank is not None:
        # Measured on the interfaces: bytes (and packets) each rank sent in each epoch, framing
        # included, and before training (Horovod's control loop alone, for its rate).
        metrics["wire_interfaces"] = interfaces
        metrics["wire_sent_by_rank"] = wire_by_rank
    metrics["input_by_rank"] = input_by_rank
    metrics["input_summary"] = summarize(input_by_rank)
    for line in describe_input(input_by_rank, metrics["input_summary"]):
        print(line, flush=True)
    if config.evaluate:
        evaluation_started = time.perf_counter()
        # The model that is saved: no augmentation layer, no Horovod optimizer.
        export = build_model(augment=False)
        export.set_weights(unsplit.get_weights())
        x_test, y_test = load_split(config.test_dir, spec)
        logits = export.predict(in_batches(x_test, EVALUATION_BATCH), verbose=0)
        predictions = np.argmax(logits, axis=1)
        metrics["test_accuracy"] = float(np.mean(predictions == y_test))
        metrics["test_rows"] = len(y_test)
        metrics["test_seconds"] = time.perf_counter() - evaluation_started
        export.save(run_dir / "model.keras")
        print(
            f"test accuracy {metrics['test_accuracy']:.4f} on {len(y_test)} held-out rows",
            flush=True,
        )
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_curves(metrics, run_dir / "curves.png")


def describe_input(input_by_rank: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """One line per rank: its input-bound share, step time, input time per batch, rows/s,
    the same over its last steps (the rolling window), flags."""

    def window(r: dict[str, Any]) -> str:
        rolling = r.get("rolling")
        if not rolling:
            return ""
        return (
            f"; last {rolling['steps']} steps: input-bound {100 * rolling['input_bound']:.0f}%, "
            f"step {1000 * rolling['mean_step_seconds']:.1f} ms, "
            f"{rolling['rows_per_second']:.0f} rows/s"
        )

    return [
        f"rank {r['rank']}: input-bound {100 * r['input_bound']:.0f}%, "
        f"step {1000 * r['mean_step_seconds']:.1f} ms, "
        f"input {1000 * r['input_seconds_per_batch']:.1f} ms/batch, "
        f"{r['rows_per_second']:.0f} rows/s"
        + window(r)
        + (
            f" [{', '.join(summary['flags'][str(r['rank'])])}]"
            if summary["flags"].get(str(r["rank"]))
            else ""
        )
        for r in input_by_rank
    ]


def plot_curves(metrics: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch (averaged over ranks), with the test accuracy marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = metrics["history"]
    first = metrics["resumed_after_epoch"] + 1
    epochs = list(range(first, first + len(history["loss"])))
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(epochs, history["loss"], marker="o")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="loss")
    accuracy_axes.plot(epochs, history["accuracy"], marker="o", label="training (all ranks)")
    if "val_loss" in history:
        loss_axes.plot(epochs, history["val_loss"], marker="o", label="validation")
        loss_axes.legend(loc="upper right")
        accuracy_axes.plot(epochs, history["val_accuracy"], marker="o", label="validation")
    if "test_accuracy" in metrics:
        accuracy_axes.axhline(
            metrics["test_accuracy"],
            color="tab:green",
            linestyle="--",
            label=f"test {metrics['test_accuracy']:.4f}",
        )
    accuracy_axes.set(title="accuracy", xlabel="epoch", ylabel="accuracy")
    accuracy_axes.legend(loc="lower right")
    for axes in (loss_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(
        f"{metrics['num_ranks']} ranks, global batch {metrics['global_batch_size']}, "
        f"{metrics['backward_passes_per_step']} backward passes per step"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m training.worker CONFIG.json (started by horovodrun)")
    run(WorkerConfig.load(args[0]))


if __name__ == "__main__":
    main()
