"""The divergence guard as two ranks see it, without Horovod: each step's loss kept as handed
over, every rank's window of losses agreed every GUARD_EVERY steps and at the epoch's end."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import tensorflow as tf

from training.rank.divergence import GUARD_EVERY, DivergenceGuard


def two_ranks(peer_losses: dict[int, float]) -> tuple[DivergenceGuard, list[int]]:
    """A guard on rank 0 whose allgather adds rank 1's row: rank 1's loss is 2.0 but at the
    steps ``peer_losses`` names. Returns the guard and the steps at which the ranks agreed."""
    agreed: list[int] = []

    def allgather(tensor: Any, _name: str) -> Any:
        mine = tensor.numpy()[0]
        first, count = int(mine[0]), int(mine[1])
        peer = mine.copy()
        for offset in range(count):
            peer[3 + offset] = peer_losses.get(first + offset, 2.0)
        agreed.append(first + count - 1)
        return np.stack([mine, peer])

    guard = DivergenceGuard(allgather)
    guard.set_model(SimpleNamespace(stop_training=False, get_weights=lambda: [np.ones(3)]))
    return guard, agreed


def run_epoch(guard: DivergenceGuard, steps: int) -> None:
    guard.on_epoch_begin(0)
    for batch in range(steps):
        # What Keras hands over with _supports_tf_logs: a tensor, read only when agreeing.
        guard.on_train_batch_end(batch, {"loss": tf.constant(2.3 - 0.01 * batch)})
        if guard.model.stop_training:
            return
    guard.on_epoch_end(0)


def test_a_peers_nan_stops_both_ranks_at_the_next_agreement_naming_its_step() -> None:
    guard, agreed = two_ranks({5: math.nan})
    run_epoch(guard, 2 * GUARD_EVERY)
    assert guard.diverged == {"epoch": 1, "step": 5, "reason": "loss nan"}
    assert agreed == [GUARD_EVERY]  # no allgather before it: none in the first batch
    assert guard.model.stop_training


def test_an_exploded_loss_is_measured_against_the_first_steps_highest() -> None:
    guard, _agreed = two_ranks({1: 3.0, 20: 3.0 * 1001})
    run_epoch(guard, 2 * GUARD_EVERY)
    assert guard.diverged is not None and guard.diverged["step"] == 20
    assert "over 1000 times the first step's 3" in guard.diverged["reason"]


def test_a_healthy_epoch_agrees_every_window_and_at_its_end() -> None:
    guard, agreed = two_ranks({})
    run_epoch(guard, 2 * GUARD_EVERY + 8)
    assert guard.diverged is None
    assert agreed == [GUARD_EVERY, 2 * GUARD_EVERY, 2 * GUARD_EVERY + 8]
