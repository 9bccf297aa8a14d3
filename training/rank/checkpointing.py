"""Rank 0's checkpoints, each a Keras callback of its own: the weights at every epoch's end
(:class:`EpochCheckpoint`), the model, optimizer and input position every N steps
(:class:`StepCheckpointer`), and the last step boundary before SIGTERM ends the process
(:class:`StopOnSigterm`). None of them saves once the divergence guard stopped training: a
diverged epoch's weights are nothing to ``--resume`` from."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf

from training import checkpoints, models


class EpochCheckpoint(tf.keras.callbacks.ModelCheckpoint):  # type: ignore[misc]  # untyped
    """Keras's ModelCheckpoint (weights, every epoch), saving nothing once ``guard`` stopped
    training."""

    def __init__(self, path: str, guard: Any) -> None:
        super().__init__(path, save_weights_only=True)
        self.guard = guard

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.guard.diverged is None:
            super().on_epoch_end(epoch, logs)


class StepCheckpointer(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """Saves the model, the optimizer and the input position (training.checkpoints) every
    ``every`` steps and at every epoch's end; ``position(epoch, step)`` makes the
    :class:`~training.checkpoints.Position`. ``.offset`` is the first step of the next epoch
    (a resumed run's shortened epoch); ``.mid_epoch`` False saves only at epoch ends."""

    def __init__(
        self,
        path: Path,
        position: Callable[[int, int], checkpoints.Position],
        *,
        every: int,
        steps_per_epoch: int,
        backward_passes_per_step: int,
        guard: Any,
    ) -> None:
        super().__init__()
        self._supports_tf_logs = True  # its batch hook reads no logs
        self.path = path
        self.position = position
        self.every = every
        self.steps_per_epoch = steps_per_epoch
        self.backward_passes_per_step = backward_passes_per_step
        self.guard = guard
        self.offset = 0
        self.mid_epoch = True
        self.epoch = 0
        self._first = 0
        self._saved: tuple[int, int] | None = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch, self._first, self.offset = epoch, self.offset, 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        at = self._boundary(batch)
        if at is None or not self.mid_epoch:
            return
        step, global_step = at
        if checkpoints.should_save(global_step, self.every, self.backward_passes_per_step):
            self._save(self.epoch, step)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.guard.diverged is None:
            self._save(epoch + 1, 0)

    def save_before_stop(self, batch: int) -> int | None:
        """The process is to end after ``batch``: save there unless saved already, when the
        optimizer's step is whole (no partial sum of backward passes pending). Returns the step
        (from 1), or None when the process is not to end there (see :meth:`_boundary`)."""
        at = self._boundary(batch)
        if at is None:
            return None
        step, global_step = at
        whole = global_step % self.backward_passes_per_step == 0
        if self.mid_epoch and whole and self._saved != (self.epoch, step):
            self._save(self.epoch, step)
        return step

    def _boundary(self, batch: int) -> tuple[int, int] | None:
        """(step of the epoch, step of the run) after ``batch``; None once training diverged,
        and at the epoch's last step, which the epoch's end saves."""
        step = self._first + batch + 1
        if self.guard.diverged is not None or step >= self.steps_per_epoch:
            return None
        return step, self.epoch * self.steps_per_epoch + step

    def _save(self, epoch: int, step: int) -> None:
        weights = self.model.get_weights()
        optimizer = self.model.optimizer.get_weights()
        # Rank 0's counters are every rank's (training.models.seed_random_layers).
        counters = models.random_counters(self.model)
        checkpoints.save(self.path, self.position(epoch, step), weights, optimizer, counters)
        self._saved = (epoch, step)
        print(f"step checkpoint: epoch {epoch + 1} step {step} -> {self.path}", flush=True)


class StopOnSigterm(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """SIGTERM during training ends the process (exit 143) at the next step boundary, once
    ``checkpointer`` saved there (:meth:`StepCheckpointer.save_before_stop`); outside training
    it ends the process at once, as without this callback. After ``checkpointer`` in the list."""

    def __init__(self, checkpointer: StepCheckpointer) -> None:
        super().__init__()
        self._supports_tf_logs = True  # its batch hook reads no logs
        self.checkpointer = checkpointer
        self.terminated = False
        self.training = False

    def on_train_begin(self, logs: Any = None) -> None:
        self.training = True
        signal.signal(signal.SIGTERM, self._handle)

    def on_train_end(self, logs: Any = None) -> None:
        self.training = False

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.training:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.terminated = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.terminated:
            return
        step = self.checkpointer.save_before_stop(batch)
        if step is None:
            return
        epoch = self.checkpointer.epoch + 1
        print(f"SIGTERM: stopped after epoch {epoch} step {step}", flush=True)
        os._exit(128 + signal.SIGTERM)
