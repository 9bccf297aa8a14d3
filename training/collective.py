"""Horovod, behind one small module: every collective call the rank program makes.

```
rank program (training/rank/*, training/gossip.py)          this module           Horovod 0.28.1
  setup      init(process_sets) ─► Where(rank, num_ranks, ...)  ──────────►  hvd.init, rank, size
  model      distributed_optimizer(opt, K, compression)        ──────────►  DistributedOptimizer
  callbacks  broadcast_variables, metric_average_callback, allgather
  schedule   warmup_callback, schedule_callback (learning rate)
  resume     broadcast_object, broadcast_variables
  metrics    allgather_object
  gossip     global_process_set, process_set(ranks), average(tensors, set)
```

Nothing else in the rank program imports Horovod. Horovod's last release (0.28.1, 2023) builds
against no TensorFlow after 2.15 (horovod#4290); should training move off it (current
TensorFlow with tf-keras and ``MultiWorkerMirroredStrategy``, or PyTorch DDP; docs/STACK.md),
this module is the seam to replace: its functions name what the rank needs, not how Horovod
spells it. Horovod is imported when a function is called, so importing this module is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Where:
    """This process's place among the ranks."""

    rank: int
    num_ranks: int
    local_rank: int
    local_size: int


def init(process_sets: Sequence[Any] = ()) -> Where:
    """Join the ranks (registering the static ``process_sets`` every rank lists alike)."""
    import horovod.tensorflow.keras as hvd

    hvd.init(process_sets=list(process_sets))
    return Where(
        rank=hvd.rank(),
        num_ranks=hvd.size(),
        local_rank=hvd.local_rank(),
        local_size=hvd.local_size(),
    )


# --- gradients -------------------------------------------------------------------------------


def compression(name: str) -> Any:
    """The gradient compression called ``name`` ("fp16" or "none")."""
    import horovod.tensorflow.keras as hvd

    return hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none


def distributed_optimizer(
    optimizer: Any, *, backward_passes_per_step: int, compression: Any
) -> Any:
    """``optimizer`` with its gradients averaged over every rank (one allreduce per
    ``backward_passes_per_step`` local batches, their gradients averaged locally first)."""
    import horovod.tensorflow.keras as hvd

    return hvd.DistributedOptimizer(
        optimizer,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=True,
        compression=compression,
    )


# --- the same values everywhere --------------------------------------------------------------


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> None:
    """Every rank's ``variables`` set to ``root_rank``'s."""
    import horovod.tensorflow as hvd_tf

    hvd_tf.broadcast_variables(variables, root_rank=root_rank)


def broadcast_object(value: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``value`` (any picklable object), on every rank."""
    import horovod.tensorflow as hvd_tf

    return hvd_tf.broadcast_object(value, root_rank=root_rank)


def allgather(tensor: Any, name: str) -> Any:
    """Every rank's ``tensor``, concatenated in rank order along the first axis."""
    import horovod.tensorflow as hvd_tf

    return hvd_tf.allgather(tensor, name=name)


def allgather_object(value: Any, name: str) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    import horovod.tensorflow as hvd_tf

    gathered: list[Any] = hvd_tf.allgather_object(value, name=name)
    return gathered


# --- process sets (--sync pairwise) ----------------------------------------------------------


def global_process_set() -> Any:
    """The set of every rank."""
    import horovod.tensorflow as hvd_tf

    return hvd_tf.global_process_set


def process_set(ranks: Sequence[int]) -> Any:
    """A static set of ``ranks`` (registered at :func:`init` by every rank)."""
    import horovod.tensorflow as hvd_tf

    return hvd_tf.ProcessSet(list(ranks))


def average(tensors: Sequence[Any], process_set: Any, name: str) -> list[Any]:
    """The mean of each of ``tensors`` over the ranks of ``process_set`` (one grouped
    allreduce)."""
    import horovod.tensorflow as hvd_tf

    averaged: list[Any] = hvd_tf.grouped_allreduce(
        list(tensors), op=hvd_tf.Average, process_set=process_set, name=name
    )
    return averaged


# --- Keras callbacks -------------------------------------------------------------------------


def metric_average_callback() -> Any:
    """A Keras callback that reports each epoch's metrics averaged over every rank."""
    import horovod.tensorflow.keras as hvd

    return hvd.callbacks.MetricAverageCallback()


def warmup_callback_class() -> Any:
    """Horovod's learning-rate warm-up callback class (the ramp of Goyal et al.)."""
    import horovod.tensorflow.keras as hvd

    return hvd.callbacks.LearningRateWarmupCallback


def schedule_callback_class() -> Any:
    """Horovod's per-step learning-rate schedule callback class."""
    import horovod.tensorflow.keras as hvd

    return hvd.callbacks.LearningRateScheduleCallback
