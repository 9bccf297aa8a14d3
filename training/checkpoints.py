"""Step checkpoints: the model, the optimizer and the loader position, for exact mid-epoch resume.

rank 0, every ``--checkpoint-every`` steps (and at each epoch's end, and on SIGTERM)
    │  weights + optimizer variables + random counters + Position
    │      → checkpoints/step.npz  (temp name, os.replace)
    ▼
--resume: rank 0 loads it, the ranks' input skips the first ``step`` batches of ``epoch``
    (same order after them), Horovod broadcasts the weights, the optimizer variables and the
    random counters (each rank keeps its own random key: ``training.models.random_counters``)

A :class:`Position` says where the input stood: the epoch (from 0) and the steps done in it,
under the plan of (seed, num_ranks, batch_size, steps_per_epoch) on one training split.
Nothing here imports TensorFlow: the worker hands over plain arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
STEP_CHECKPOINT = "step.npz"


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where a run's input stood when a checkpoint was written."""

    train_url: str
    """The training split read (its catalog version's folder)."""
    epoch: int
    """The epoch in progress, from 0."""
    step: int
    """Batches of ``epoch`` every rank had trained on (0: the epoch had not begun)."""
    seed: int
    num_ranks: int
    batch_size: int
    """Per rank."""
    steps_per_epoch: int
    format_version: int = FORMAT_VERSION

    @property
    def global_step(self) -> int:
        return self.epoch * self.steps_per_epoch + self.step


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """What :func:`load` reads back."""

    position: Position
    weights: list[Any]
    """The model's weights (``model.get_weights()``)."""
    optimizer: list[Any]
    """The optimizer's variables (``optimizer.get_weights()``)."""
    random_counters: list[Any]
    """The counter of each random layer's generator (``training.models.random_counters``);
    empty in a checkpoint written before they were saved."""


def save(
    path: Path,
    position: Position,
    weights: Sequence[Any],
    optimizer: Sequence[Any],
    random_counters: Sequence[Any] = (),
) -> None:
    """Write one checkpoint atomically: to a temporary name beside ``path``, then renamed over
    it, so a reader (or a resume after a kill) sees the previous checkpoint or this one whole."""
    arrays = {f"weight_{i}": np.asarray(w) for i, w in enumerate(weights)}
    arrays |= {f"optimizer_{i}": np.asarray(v) for i, v in enumerate(optimizer)}
    arrays |= {f"random_{i}": np.asarray(c) for i, c in enumerate(random_counters)}
    arrays["position"] = np.frombuffer(json.dumps(asdict(position)).encode(), dtype=np.uint8)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def load(path: Path) -> Checkpoint:
    """The checkpoint :func:`save` wrote."""
    with np.load(path) as archive:
        fields = json.loads(archive["position"].tobytes().decode())
        if fields.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: checkpoint format {fields.get('format_version')}, "
                f"this shardflow reads {FORMAT_VERSION}"
            )
        weights = [archive[f"weight_{i}"] for i in range(_count(archive.files, "weight_"))]
        optimizer = [archive[f"optimizer_{i}"] for i in range(_count(archive.files, "optimizer_"))]
        counters = [archive[f"random_{i}"] for i in range(_count(archive.files, "random_"))]
    return Checkpoint(
        position=Position(**fields), weights=weights, optimizer=optimizer, random_counters=counters
    )


def _count(names: Sequence[str], prefix: str) -> int:
    return sum(1 for n in names if n.startswith(prefix))


def should_save(global_step: int, every: int, backward_passes_per_step: int) -> bool:
    """Whether a step checkpoint is due after ``global_step`` batches of the run: every
    ``every`` batches, and only where no locally aggregated gradients are pending (with K
    backward passes per step Horovod applies them every K batches; a partial sum is not saved)."""
    return every > 0 and global_step % every == 0 and global_step % backward_passes_per_step == 0


@dataclass(frozen=True, kw_only=True)
class ResumePlan:
    """How a run on ``num_ranks`` ranks continues the epoch a checkpoint stopped in."""

    epoch: int
    """The epoch to finish, from 0."""
    steps: int
    """Steps this run takes to finish it (0: start at the next epoch's beginning)."""
    sources: list[list[tuple[int, int]]]
    """Per new rank, per step: (old rank, old step) of the old plan's batch it feeds, in order;
    empty when the rank count is unchanged (each rank skips its own first ``position.step``)."""
    note: str
    """One line saying what the resume does."""


def plan_resume(position: Position, *, num_ranks: int, batch_size: int) -> ResumePlan:
    """The rest of ``position.epoch`` on ``num_ranks`` ranks, in the same global sample order.

    The same rank count: every rank skips its first ``position.step`` batches. Another count
    with the same per-rank batch: the old plan's remaining per-rank batches, in global order
    (step, then rank), are dealt out round-robin, ``num_ranks`` to a step; a remainder of
    fewer than ``num_ranks`` batches cannot make a whole step and is left out (the note says how
    many). Another batch size: the epoch cannot be continued; the run restarts it."""
    remaining = position.steps_per_epoch - position.step
    where = f"epoch {position.epoch + 1} step {position.step}"
    if num_ranks == position.num_ranks and batch_size == position.batch_size:
        return ResumePlan(
            epoch=position.epoch,
            steps=remaining,
            sources=[],
            note=f"resuming at {where} of {position.steps_per_epoch}: each rank skips its "
            f"first {position.step} batches",
        )
    if batch_size != position.batch_size:
        return ResumePlan(
            epoch=position.epoch,
            steps=0,
            sources=[],
            note=f"checkpoint at {where} was taken with batch size {position.batch_size}, not "
            f"{batch_size}: restarting epoch {position.epoch + 1} from its beginning",
        )
    old = [
        (r, s)
        for s in range(position.step, position.steps_per_epoch)
        for r in range(position.num_ranks)
    ]
    steps, left_out = divmod(len(old), num_ranks)
    sources = [[old[t * num_ranks + r] for t in range(steps)] for r in range(num_ranks)]
    note = (
        f"resuming at {where} of a {position.num_ranks}-rank run on {num_ranks} ranks: the "
        f"{len(old)} remaining batches of {batch_size} in the same global order, {steps} steps"
    )
    if left_out:
        note += f"; the last {left_out} batch(es) of the epoch do not fill a step and are skipped"
    return ResumePlan(epoch=position.epoch, steps=steps, sources=sources, note=note)
