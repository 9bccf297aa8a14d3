"""Training that diverged stops on every rank after the same step: :func:`divergence` decides
on one step's losses, :class:`DivergenceGuard` is the Keras callback that asks every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

# A loss this many times the run's first step's loss has exploded, even while still finite.
EXPLODED_FACTOR = 1e3
# Steps between the ranks' checks that no rank diverged (and at every epoch's end): one check
# (a Horovod allgather) takes 1-2 ms, 1 % of a 5-10 ms step every 16 steps, half that every 32,
# an eighth of it every 128 (shardflow's callbacks keep under 2 % of a step, issue #30). The
# step that diverged is still named exactly: each rank's row holds every step's loss since the
# last check; training goes on at most 127 steps past it.
GUARD_EVERY = 128


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


class DivergenceGuard(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """Stops training when any rank's loss diverged (:func:`divergence`) or, at an epoch's end,
    any rank's weights are not finite; ``.diverged`` then says where ({"epoch", "step",
    "reason"}, epoch and step from 1: the first step whose loss diverged on any rank).

    ``allgather(tensor, name)`` gathers a row of every rank (Horovod's): every rank decides on
    the same rows, so all of them stop after the same step, and none waits in an allreduce for
    a peer that stopped. The ranks agree every :data:`GUARD_EVERY` steps and at each epoch's
    end, not every step (one gather costs about a millisecond): each rank's row holds its
    losses of the steps since the last agreement (the loss Keras reports is the epoch's running
    mean, in which a NaN stays); the highest loss of the run's first step is the reference.
    The losses are kept as TensorFlow hands them over and read only when the ranks agree, so
    that no step waits for its loss to be copied out (``_supports_tf_logs``).
    """

    def __init__(self, allgather: Callable[[Any, str], Any]) -> None:
        super().__init__()
        self._supports_tf_logs = True
        self.allgather = allgather
        self.diverged: dict[str, Any] | None = None
        self._reference: float | None = None
        self._epoch = 0
        self._step = 0
        # The losses of the steps since the last agreement, the first of them step _first_held.
        self._held: list[Any] = []
        self._first_held = 1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._step = epoch + 1, 0
        self._held, self._first_held = [], 1

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step = batch + 1  # Keras counts from 0
        if not self._held:
            self._first_held = self._step
        self._held.append((logs or {}).get("loss", math.nan))
        if self._step % GUARD_EVERY == 0:  # the same steps on every rank
            self._agree(weights_finite=True)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.diverged is None:
            self._agree(all(np.isfinite(w).all() for w in self.model.get_weights()))

    def _agree(self, weights_finite: bool) -> None:
        losses = [float(loss) for loss in self._held]
        row = np.full(3 + GUARD_EVERY, np.nan)
        row[:3] = (self._first_held, len(losses), 1.0 if weights_finite else 0.0)
        row[3 : 3 + len(losses)] = losses
        self._held = []
        # Horovod: every rank's row, in rank order, the same on every rank.
        rows = np.asarray(self.allgather(tf.constant([row], tf.float64), "divergence_guard"))
        rows = rows.reshape(-1, 3 + GUARD_EVERY)
        first, count = int(rows[0, 0]), int(rows[:, 1].max())
        if self._reference is None and count and np.isfinite(rows[:, 3]).all():
            # The run's first step (this guard's first) sets the reference.
            self._reference = float(rows[:, 3].max())
        for offset in range(count):
            reason = divergence([float(v) for v in rows[:, 3 + offset]], self._reference)
            if reason:
                self._stop(first + offset, reason)
                return
        if not rows[:, 2].all():
            self._stop(self._step, "weights not finite")

    def _stop(self, step: int, reason: str) -> None:
        self.diverged = {"epoch": self._epoch, "step": step, "reason": reason}
        self.model.stop_training = True
