"""A rank's start: its core (``threads_per_rank`` 1), Horovod, its devices and TensorFlow's
thread pools."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from training.config import TrainConfig


def pin_to_one_core(environ: Mapping[str, str] = os.environ) -> int:
    """Bind this rank, and every thread it starts from now on, to one core of its own; returns
    the core.

    Capping TensorFlow's op pools is not enough to hold a rank to one core: tf.data and the
    petastorm reader run pools of their own. Threads inherit the affinity of the thread that
    creates them, so this runs before TensorFlow or Horovod start any.

    Rank r takes core r mod C of the C cores it may use. horovodrun numbers the ranks of a
    host consecutively, so up to C ranks on one host take distinct cores; namespaced hosts
    sharing one machine (lab.netns), each with a local rank 0, spread over its cores too,
    where the local rank would put them all on one.
    """
    # Horovod: the rank, from where its launcher puts it (the names Horovod itself reads:
    # horovod.runner.common.util.env.get_env_rank_and_size), chooses the core.
    found = (environ.get(name) for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    rank = int(next((value for value in found if value is not None), "0"))
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


@dataclass(frozen=True, kw_only=True)
class World:
    """This rank among the others, as Horovod numbers them."""

    rank: int
    num_ranks: int
    local_rank: int
    local_size: int
    pair_sets: dict[tuple[int, int], Any] = field(default_factory=dict)
    """``--sync pairwise``: the static process set of each pair of ranks (training.gossip)."""


def init_horovod(train: TrainConfig) -> World:
    """Horovod initialised for ``train``; where this rank is."""
    from training import collective, gossip

    # petastorm 0.13.1 reads through pyarrow's legacy ParquetDataset, which warns on every
    # call; pyarrow stays at 14 for it (docs/STACK.md).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
    # Horovod: --sync pairwise averages weights on static process sets of two ranks, one per
    # pair, which every rank registers at init.
    pair_sets = gossip.pair_process_sets(train.num_ranks) if train.sync == "pairwise" else {}
    where = collective.init(gossip.registered(pair_sets))
    return World(
        rank=where.rank,
        num_ranks=where.num_ranks,
        local_rank=where.local_rank,
        local_size=where.local_size,
        pair_sets=pair_sets,
    )


@dataclass(frozen=True, kw_only=True)
class Devices:
    """Where this rank's model runs."""

    stages: list[str]
    """One device per model stage (``model_stages`` > 1); empty for a whole model."""
    model: list[str]
    """The devices the model's variables live on, for the memory figures."""


def configure_devices(model_stages: int, local_rank: int) -> Devices:
    """Make this rank's devices visible: a group of ``model_stages`` devices for a split model,
    else its own GPU where there are GPUs."""
    import tensorflow as tf

    from training import pipeline_parallel

    gpus = tf.config.list_physical_devices("GPU")
    stages: list[str] = []
    if model_stages > 1:
        # Horovod: a group of model_stages GPUs per local rank, else logical CPU devices.
        stages = pipeline_parallel.configure_devices(model_stages, local_rank=local_rank)
    elif gpus:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        # Horovod: one GPU per local rank.
        tf.config.set_visible_devices(gpus[local_rank], "GPU")
    return Devices(stages=stages, model=stages or ["/GPU:0" if gpus else "/CPU:0"])


def configure_threads(local_size: int, threads_per_rank: int, *, model_stages: int = 1) -> None:
    """TensorFlow's op pools: ``threads_per_rank`` compute threads, or (0) the host's cores
    shared among its ``local_size`` ranks; a thread per pipeline stage at least between ops."""
    import tensorflow as tf

    from training.pipeline_parallel import inter_op_threads

    # Horovod: ranks on one host share its cores; without this each would start a pool per core.
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // local_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    # A thread per pipeline stage at least, so that the stages overlap.
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads(model_stages, threads))
