"""This rank's model: built from the worker config, split into stages when asked, compiled with
Horovod's distributed optimizer (or a plain one for ``--sync pairwise``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from training import models, pipeline_parallel
from training.input import InputSpec
from training.rank.config import WorkerConfig
from training.rank.meters import counting_compression
from training.rank.setup import World


def build(config: WorkerConfig, spec: InputSpec, *, augment: bool) -> Any:
    """The model of ``config`` as it is saved: no Horovod optimizer, not compiled."""
    assert config.train.model is not None  # WorkerConfig refuses an unresolved model
    return models.build(
        config.train.model,
        input_shape=spec.input_shape,
        num_classes=config.num_classes,
        mean=config.mean,
        std=config.std,
        augment=augment,
    )


@dataclass(frozen=True, kw_only=True)
class RankModel:
    """The compiled model this rank trains, and what the rest of the rank needs of it."""

    model: Any
    """What ``fit`` trains: the pipelined stages when split, else ``unsplit``."""
    unsplit: Any
    """The model as built: its variables are the stages' too, in the export's order."""
    stages: list[pipeline_parallel.Stage]
    optimizer: Any
    scaled_lr: float
    sent: Any
    """Bytes this rank handed to allreduce so far (a tf.Variable; :class:`AllreduceMeter`)."""


def compiled(config: WorkerConfig, spec: InputSpec, world: World, devices: list[str]) -> RankModel:
    """The model of ``config``, split over ``devices`` (one per stage) when it has stages,
    compiled with the learning rate scaled by the number of ranks."""
    train = config.train
    unsplit = build(config, spec, augment=train.augment)
    # Horovod: each rank its own dropout masks and shifts, from (seed, rank).
    models.seed_random_layers(unsplit, seed=train.seed, rank=world.rank)
    stages = pipeline_parallel.split(unsplit, train.model_stages) if train.model_stages > 1 else []
    model = unsplit
    if stages:
        model = pipeline_parallel.pipelined(
            stages, devices=devices, micro_batches=train.micro_batches
        )
    # Horovod: scale the learning rate by the number of ranks (the global batch grows with it).
    scaled_lr = train.learning_rate * world.num_ranks
    optimizer, sent = _optimizer(config, scaled_lr)
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return RankModel(
        model=model,
        unsplit=unsplit,
        stages=stages,
        optimizer=optimizer,
        scaled_lr=scaled_lr,
        sent=sent,
    )


def _optimizer(config: WorkerConfig, scaled_lr: float) -> tuple[Any, Any]:
    """(optimizer, the counter of bytes it hands to allreduce)."""
    from training import collective

    train = config.train
    # Horovod: average gradients across ranks with allreduce; with K backward passes per step,
    # gradients of K local batches are summed locally and sent once (K times less traffic).
    sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="allreduce_bytes")
    compression = collective.compression(train.compression)
    if train.sync == "pairwise":
        # --sync pairwise: each rank steps on its own gradients; training.gossip averages
        # weights with one partner every --average-every steps.
        return tf.keras.optimizers.legacy.Adam(scaled_lr), sent
    optimizer = collective.distributed_optimizer(
        tf.keras.optimizers.legacy.Adam(scaled_lr),
        backward_passes_per_step=train.backward_passes_per_step,
        compression=counting_compression(compression, sent),
    )
    return optimizer, sent
