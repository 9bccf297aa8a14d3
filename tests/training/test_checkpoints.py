"""Step checkpoints: atomic save/load, when they are due, and how a resume continues an epoch."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from data_catalog.errors import ConfigError
from training import checkpoints
from training.checkpoints import Position, plan_resume, should_save
from training.config import LaunchConfig, TrainConfig
from training.input import skip_batches, split_batches


def position(**changes: int) -> Position:
    fields = {
        "epoch": 1,
        "step": 10,
        "seed": 0,
        "num_ranks": 2,
        "batch_size": 8,
        "steps_per_epoch": 25,
    }
    return Position(train_url="file:///data/train", **{**fields, **changes})


def test_save_and_load_round_trip_and_leave_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / checkpoints.STEP_CHECKPOINT
    weights = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
    optimizer = [np.int64(7), np.full((2, 3), 0.5, np.float32)]
    counters = [np.array([4096, 0], np.int64)]
    checkpoints.save(path, position(), weights, optimizer)
    checkpoints.save(path, position(step=15), weights, optimizer, counters)  # replaces it
    loaded = checkpoints.load(path)
    assert loaded.position == position(step=15)
    assert loaded.position.global_step == 25 + 15
    assert all(np.array_equal(a, b) for a, b in zip(loaded.weights, weights, strict=True))
    assert int(loaded.optimizer[0]) == 7
    assert [c.tolist() for c in loaded.random_counters] == [[4096, 0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.STEP_CHECKPOINT]


def test_checkpoints_are_due_every_n_steps_only_where_no_gradients_are_pending() -> None:
    assert [s for s in range(1, 21) if should_save(s, 5, 1)] == [5, 10, 15, 20]
    assert [s for s in range(1, 21) if should_save(s, 5, 2)] == [10, 20]
    assert not any(should_save(s, 0, 1) for s in range(1, 21))


def test_the_same_rank_count_skips_each_ranks_first_steps() -> None:
    plan = plan_resume(position(), num_ranks=2, batch_size=8)
    assert (plan.epoch, plan.steps, plan.sources) == (1, 15, [])
    assert "skips its first 10 batches" in plan.note


def test_one_rank_feeds_the_remaining_batches_of_two_in_their_global_order() -> None:
    plan = plan_resume(position(), num_ranks=1, batch_size=8)
    assert plan.steps == 30
    assert plan.sources[0][:4] == [(0, 10), (1, 10), (0, 11), (1, 11)]
    # Every remaining batch of the epoch exactly once.
    assert sorted(plan.sources[0]) == sorted((r, s) for r in range(2) for s in range(10, 25))


def test_a_remainder_that_fills_no_step_is_named() -> None:
    plan = plan_resume(position(), num_ranks=4, batch_size=8)
    assert plan.steps == 7  # 30 batches over 4 ranks
    assert [len(s) for s in plan.sources] == [7, 7, 7, 7]
    assert "the last 2 batch(es)" in plan.note


def test_another_batch_size_restarts_the_epoch() -> None:
    plan = plan_resume(position(), num_ranks=2, batch_size=16)
    assert plan.steps == 0 and "restarting epoch 2" in plan.note


def test_skipping_batches_keeps_the_order_of_what_follows() -> None:
    rows = np.arange(40)
    chunks = [(rows[:24], rows[:24]), (rows[24:], rows[24:])]
    kept = list(split_batches(skip_batches(iter(chunks), 4, 8), 8))
    assert [list(x) for x, _y in kept] == [list(range(32, 40))]
    kept = list(skip_batches(iter(chunks), 2, 8))
    assert np.concatenate([x for x, _y in kept]).tolist() == list(range(16, 40))


def test_checkpoint_cadence_is_a_launch_choice() -> None:
    """Not a TrainConfig field at all, so never part of the model version."""
    assert "checkpoint_every" not in {f.name for f in fields(TrainConfig)}
    assert LaunchConfig(checkpoint_every=5).checkpoint_every == 5
    with pytest.raises(ConfigError, match="checkpoint_every"):
        LaunchConfig(checkpoint_every=-1)
