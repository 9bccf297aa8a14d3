"""The Keras callbacks of a rank, in the order Keras calls them, each with one job.

BroadcastBeforeFirstStep   Horovod: every rank starts from rank 0's weights
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

import tensorflow as tf

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
    from training import collective

    train, run_dir = config.train, Path(config.run_dir)
    in_order: list[Any] = [
        # Horovod: start every rank from rank 0's initial weights, before the first step.
        BroadcastBeforeFirstStep(built.optimizer, collective.broadcast_variables),
        # Horovod: report metrics averaged over all ranks.
        collective.metric_average_callback(),
    ]
    schedules = learning_rate_schedules(train, built.scaled_lr, config.steps_per_epoch)
    in_order += schedules
    # After MetricAverageCallback and before the checkpoints, which it keeps from saving a
    # diverged epoch. Horovod: every rank's row of losses, to every rank.
    guard = DivergenceGuard(lambda tensor, name: collective.allgather(tensor, name=name).numpy())
    in_order.append(guard)
    checkpointer = None
    if world.rank == 0:
        # Horovod: checkpoints and logs on rank 0 only, so that ranks do not overwrite each other.
        checkpoints_dir(config).mkdir(parents=True, exist_ok=True)
        in_order.append(EpochCheckpoint(str(checkpoints_dir(config) / EPOCH_CHECKPOINT), guard))
        in_order.append(EpochTensorBoard(log_dir=str(run_dir / "tensorboard"), profile_batch=0))
        if config.launch.checkpoint_every:
            checkpointer = _step_checkpointer(config, world, guard)
            in_order += [checkpointer, StopOnSigterm(checkpointer)]
    timer, allreduce = EpochTimer(), AllreduceMeter(built.sent)
    publisher = EpochPublisher(
        world.rank,
        run_dir / EPOCHS_FILE,
        # Horovod: every rank's figures of each epoch to rank 0.
        lambda record, name: collective.allgather_object(record, name=name),
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
        # First: its idle sample (from hvd.init() to training's start, Horovod's control loop
        # alone) ends before BroadcastBeforeFirstStep sends rank 0's weights and slots.
        in_order.insert(0, wire)
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


class EpochTensorBoard(tf.keras.callbacks.TensorBoard):  # type: ignore[misc]  # untyped
    """Keras's TensorBoard writing what it writes by epoch (``update_freq="epoch"``, no
    profile), doing nothing per batch: Keras's calls ``tf.summary.scalar`` for every log of
    every batch even when nothing is recorded (0.3 ms a step), and Keras calls every
    callback's batch hooks once any callback has some. The train graph, which it writes after
    the first batch, is written at the first epoch's end."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(update_freq="epoch", **kwargs)
        self._supports_tf_logs = True
        self.graph_pending = False

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.graph_pending = bool(getattr(self, "_should_write_train_graph", False))
        self._should_write_train_graph = False

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        pass

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.graph_pending:
            self._write_keras_model_train_graph()
            self.graph_pending = False
        super().on_epoch_end(epoch, logs)


class BroadcastBeforeFirstStep(tf.keras.callbacks.Callback):  # type: ignore[misc]  # untyped
    """Every rank starts from rank 0's weights and optimizer state, broadcast when training
    begins, before the first step (``broadcast(variables, root_rank=)``: Horovod's).

    Horovod's own BroadcastGlobalVariablesCallback broadcasts at the end of the first batch,
    once the optimizer has made its slots: every rank's first step then computes its gradient
    on its own initial weights, and the broadcast (a first Horovod call, tens of milliseconds)
    lands in the first batch's hook, which Keras times and warns about ("Callback method
    `on_train_batch_end` is slow compared to the batch time"). Here every rank makes the
    optimizer's slots first (as ``--resume`` does), so that they are broadcast too."""

    def __init__(self, optimizer: Any, broadcast: Any) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.broadcast = broadcast
        self.done = False

    def on_train_begin(self, logs: Any = None) -> None:
        if self.done:
            return
        self.optimizer._create_all_weights(self.model.trainable_variables)
        self.broadcast(self.model.variables, root_rank=0)
        self.broadcast(self.optimizer.variables(), root_rank=0)
        self.done = True


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
