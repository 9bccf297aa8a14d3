"""The Keras callbacks of a rank, in the order Keras calls them, each with one job.

BroadcastGlobalVariables   Horovod: every rank starts from rank 0's weights
MetricAverage              Horovod: logs averaged over the ranks
warm-up, cosine decay      the learning rate of every step (schedule.py)
DivergenceGuard            every rank stops after the same step once one diverged
EpochCheckpoint, TensorBoard          rank 0
StepCheckpointer, StopOnSigterm       rank 0, with --checkpoint-every
EpochTimer, AllreduceMeter, StepMeter (the input), pairwise averaging, WireMeter
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import checkpoints, gossip
from training.input_metrics import EPOCHS_FILE, InputMeter, step_meter
from training.rank.checkpointing import EpochCheckpoint, StepCheckpointer, StopOnSigterm
from training.rank.config import WorkerConfig
from training.rank.divergence import DivergenceGuard
from training.rank.meters import AllreduceMeter, EpochPublisher, EpochTimer, WireMeter
from training.rank.model import RankModel
from training.rank.resume import checkpoints_dir, step_file
from training.rank.run_dir import EPOCH_CHECKPOINT
from training.rank.schedule import ShiftedBatches, learning_rate_schedules
from training.rank.setup import World


@dataclass(frozen=True, kw_only=True)
class RankCallbacks:
    """Every callback of the rank (``.in_order``) and the ones the rest of it asks."""

    in_order: list[Any]
    schedules: list[Any]
    """The learning-rate callbacks: a resumed run's shortened epoch shifts them."""
    guard: DivergenceGuard
    checkpointer: StepCheckpointer | None
    timer: EpochTimer
    allreduce: AllreduceMeter
    steps: Any
    """The input meter (training.input_metrics.step_meter)."""
    averaging: Any | None
    """``--sync pairwise``: the callback that averages weights with a partner."""
    wire: WireMeter | None

    def shifted(self, offset: int) -> list[Any]:
        """``.in_order``, the schedules seeing batch ``b`` as ``b + offset``."""
        return [ShiftedBatches(c, offset) if c in self.schedules else c for c in self.in_order]


def assemble(
    config: WorkerConfig,
    world: World,
    built: RankModel,
    input_meter: InputMeter,
    wire: WireMeter | None,
) -> RankCallbacks:
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    train, run_dir = config.train, Path(config.run_dir)
    in_order: list[Any] = [
        # Horovod: start every rank from rank 0's initial weights.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: report metrics averaged over all ranks.
        hvd.callbacks.MetricAverageCallback(),
    ]
    schedules = learning_rate_schedules(train, built.scaled_lr, config.steps_per_epoch)
    in_order += schedules
    # After MetricAverageCallback and before the checkpoints, which it keeps from saving a
    # diverged epoch. Horovod: every rank's row of losses, to every rank.
    guard = DivergenceGuard(lambda tensor, name: hvd_tf.allgather(tensor, name=name).numpy())
    in_order.append(guard)
    checkpointer = None
    if world.rank == 0:
        # Horovod: checkpoints and logs on rank 0 only, so that ranks do not overwrite each other.
        checkpoints_dir(config).mkdir(parents=True, exist_ok=True)
        in_order.append(EpochCheckpoint(str(checkpoints_dir(config) / EPOCH_CHECKPOINT), guard))
        in_order.append(
            tf.keras.callbacks.TensorBoard(log_dir=str(run_dir / "tensorboard"), profile_batch=0)
        )
        if config.launch.checkpoint_every:
            checkpointer = _step_checkpointer(config, world, guard)
            in_order += [checkpointer, StopOnSigterm(checkpointer)]
    timer, allreduce = EpochTimer(), AllreduceMeter(built.sent)
    publisher = EpochPublisher(
        world.rank,
        run_dir / EPOCHS_FILE,
        # Horovod: every rank's figures of each epoch to rank 0.
        lambda record, name: hvd_tf.allgather_object(record, name=name),
    )
    # Horovod: one TensorBoard folder per rank for its input scalars.
    log_dir = str(run_dir / "tensorboard" / f"rank-{world.rank}")
    steps = step_meter(input_meter, world.rank, log_dir, on_epoch=publisher)
    in_order += [timer, allreduce, steps]
    averaging = None
    if train.sync == "pairwise":
        # Horovod: after the initial broadcast (the first callback), every K steps.
        averaging = gossip.pairwise_averaging(
            world.rank, world.num_ranks, train.average_every, world.pair_sets
        )
        in_order.append(averaging)
    if wire is not None:
        in_order.append(wire)
    return RankCallbacks(
        in_order=in_order,
        schedules=schedules,
        guard=guard,
        checkpointer=checkpointer,
        timer=timer,
        allreduce=allreduce,
        steps=steps,
        averaging=averaging,
        wire=wire,
    )


def _step_checkpointer(config: WorkerConfig, world: World, guard: Any) -> StepCheckpointer:
    train = config.train

    def position_at(epoch: int, step: int) -> checkpoints.Position:
        return checkpoints.Position(
            train_url=config.train_url,
            epoch=epoch,
            step=step,
            seed=train.seed,
            num_ranks=world.num_ranks,
            batch_size=train.batch_size,
            steps_per_epoch=config.steps_per_epoch,
        )

    return StepCheckpointer(
        step_file(config),
        position_at,
        every=config.launch.checkpoint_every,
        steps_per_epoch=config.steps_per_epoch,
        backward_passes_per_step=train.backward_passes_per_step,
        guard=guard,
    )
