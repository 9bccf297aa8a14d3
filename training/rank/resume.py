"""Where a rank's training starts: from scratch, after rank 0's last epoch checkpoint, or at the
step of its step checkpoint (training.checkpoints), the same on every rank.

    rank 0: newest checkpoint ─► broadcast choice ─► restore (rank 0) ─► broadcast weights,
            optimizer and random counters ─► every rank: a StartPoint
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training import checkpoints, models
from training.input import PartialEpoch
from training.rank.config import WorkerConfig
from training.rank.run_dir import last_checkpoint
from training.rank.setup import World


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """Where training starts. A mid-epoch resume first finishes epoch ``initial_epoch``
    (``partial_steps`` steps, the first of them step ``step_offset`` of its schedule), then
    trains whole epochs."""

    initial_epoch: int = 0
    partial: PartialEpoch | None = None
    partial_steps: int = 0
    step_offset: int = 0
    resumed_at: dict[str, Any] | None = None
    """A mid-epoch resume: the epoch (from 1) and step it continued at, and how."""


def checkpoints_dir(config: WorkerConfig) -> Path:
    return Path(config.run_dir) / "checkpoints"


def step_file(config: WorkerConfig) -> Path:
    return checkpoints_dir(config) / checkpoints.STEP_CHECKPOINT


def restore_step_checkpoint(model: Any, checkpoint: checkpoints.Checkpoint) -> list[Any]:
    """Rank 0: ``checkpoint``'s weights and optimizer variables into ``model`` (compiled, its
    optimizer's slots created); returns the random counters for every rank to restore
    (``training.models.restore_random_counters``; empty from a checkpoint without them)."""
    model.set_weights(checkpoint.weights)
    model.optimizer.set_weights(checkpoint.optimizer)
    return list(checkpoint.random_counters)


def resume_choice(checkpoints_dir: Path, step_file: Path) -> dict[str, Any]:
    """Where rank 0 resumes from: the newest epoch checkpoint ({"kind": "epoch", "done",
    "weights"}) or the step checkpoint ({"kind": "step", "position"}) when it is as far on (it
    also holds the optimizer and the input position)."""
    done, weights = last_checkpoint(checkpoints_dir)
    if step_file.is_file():
        position = checkpoints.load(step_file).position
        if position.epoch + position.step / position.steps_per_epoch >= done:
            return {"kind": "step", "position": asdict(position)}
    return {"kind": "epoch", "done": done, "weights": str(weights) if weights else None}


def resume(model: Any, optimizer: Any, config: WorkerConfig, world: World) -> StartPoint:
    """Every rank continues from rank 0's newest checkpoint (``--resume``)."""
    from training import collective

    # Horovod: rank 0 decides where to resume from and tells the others.
    choice = resume_choice(checkpoints_dir(config), step_file(config)) if world.rank == 0 else None
    choice = collective.broadcast_object(choice, root_rank=0)
    # Horovod: every rank creates the optimizer's slots, so that all of them are broadcast.
    optimizer._create_all_weights(model.trainable_variables)
    if choice["kind"] == "epoch":
        start = StartPoint(initial_epoch=choice["done"])
        if world.rank == 0 and choice["weights"] is not None:
            model.load_weights(choice["weights"])
            left = (
                "nothing left to train"
                if choice["done"] >= config.train.epochs
                else f"{config.train.epochs - choice['done']} epoch(s) left"
            )
            print(
                f"resuming after epoch {choice['done']} from {choice['weights']}: {left}",
                flush=True,
            )
    else:
        position = checkpoints.Position(**choice["position"])
        start = _from_step(model, position, config, world)
    # Horovod: every rank starts from rank 0's restored weights and optimizer state (the
    # broadcast callback acts only after the first step, which must already be equal).
    collective.broadcast_variables(model.variables, root_rank=0)
    collective.broadcast_variables(optimizer.variables(), root_rank=0)
    return start


def _from_step(
    model: Any, position: checkpoints.Position, config: WorkerConfig, world: World
) -> StartPoint:
    """Rank 0 restores the step checkpoint at ``position``; every rank plans the rest of its
    epoch (on this run's rank count)."""
    from training import collective

    plan = checkpoints.plan_resume(
        position, num_ranks=world.num_ranks, batch_size=config.train.batch_size
    )
    note = plan.note
    if plan.epoch >= config.train.epochs:
        # Killed after its last step (while it evaluated or committed): nothing to train.
        note = f"resuming after the last epoch ({config.train.epochs}): nothing left to train"
    counters = None
    if world.rank == 0:
        counters = restore_step_checkpoint(model, checkpoints.load(step_file(config)))
        print(note, flush=True)
    # Horovod: rank 0's random counters to every rank, which keeps its own keys.
    counters = collective.broadcast_object(counters, root_rank=0)
    if counters:
        models.restore_random_counters(model, counters)
    steps_per_epoch = config.steps_per_epoch
    partial, partial_steps, step_offset = None, 0, 0
    if plan.steps and (plan.sources or plan.steps < steps_per_epoch):
        partial_steps = plan.steps
        step_offset = steps_per_epoch - plan.steps
        partial = PartialEpoch(
            skip=0 if plan.sources else position.step,
            sources=plan.sources[world.rank] if plan.sources else None,
            old_num_ranks=position.num_ranks,
            old_steps=position.steps_per_epoch,
        )
    return StartPoint(
        initial_epoch=plan.epoch,
        partial=partial,
        partial_steps=partial_steps,
        step_offset=step_offset,
        resumed_at={"epoch": plan.epoch + 1, "step": step_offset, "note": note},
    )
