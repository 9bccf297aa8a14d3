"""The learning rate over a run: Horovod's warm-up of the scaled rate, then a cosine decay;
:class:`ShiftedBatches` starts a schedule part-way into an epoch (a resumed run's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from training.config import TrainConfig


def cosine_decay(start_epoch: int, end_epoch: int, floor: float = 0.02) -> Callable[[float], float]:
    """Learning-rate multiplier falling from 1 at ``start_epoch`` to ``floor`` at the end."""

    def multiplier(epoch: float) -> float:
        progress = min(1.0, max(0.0, (epoch - start_epoch) / (end_epoch - start_epoch)))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def learning_rate_schedules(
    train: TrainConfig, scaled_lr: float, steps_per_epoch: int
) -> list[Any]:
    """The Keras callbacks that set the learning rate of every step, in order."""
    from training import collective

    # At most the run's epochs, whatever the configuration asks.
    warmup_epochs = min(train.warmup_epochs, train.epochs)
    schedules: list[Any] = []
    if warmup_epochs:
        # Horovod: ramp the scaled learning rate up over the first epoch(s).
        schedules.append(
            assigned_rate(collective.warmup_callback_class())(
                initial_lr=scaled_lr,
                warmup_epochs=warmup_epochs,
                steps_per_epoch=steps_per_epoch,
                verbose=0,
            )
        )
    if train.epochs > warmup_epochs:
        # Then a cosine decay to the end: on short schedules the last epoch at a low rate is
        # worth about a point of test accuracy.
        schedules.append(
            assigned_rate(collective.schedule_callback_class())(
                initial_lr=scaled_lr,
                multiplier=cosine_decay(warmup_epochs, train.epochs),
                start_epoch=warmup_epochs,
                staircase=False,
                steps_per_epoch=steps_per_epoch,
            )
        )
    return schedules


def assigned_rate(schedule: Any) -> Any:
    """Horovod's learning-rate callback ``schedule`` setting the rate of every step with one
    assignment to the optimizer's rate variable, and none when the step's float32 rate is the
    one it holds (one rank's warm-up, much of a long cosine decay): the same values, where
    Horovod reads the old rate back and sets the new one through Keras's backend, about 0.4 ms
    a step (7 % of a small model's step on CPU). Its batch hook reads no logs."""

    class AssignedRate(schedule):  # type: ignore[misc]  # Horovod is untyped
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._supports_tf_logs = True
            self._rate: Any = None
            self._held: Any = None
            self._corrected = False

        def _adjust_learning_rate(self, epoch: float) -> None:
            if self._corrected:
                super()._adjust_learning_rate(epoch)  # momentum correction reads the old rate
                self._held = None
                return
            rate = np.float32(self.initial_lr * self.multiplier(epoch))
            if self._held is None or rate != self._held:
                # A Python float: TensorFlow converts it to a tensor faster than a numpy scalar.
                self._rate.assign(float(rate), read_value=False)
                self._held = rate

        def on_train_begin(self, logs: Any = None) -> None:
            super().on_train_begin(logs)
            self._held = None  # another fit, a restored optimizer: set the first step's rate
            # Asked once per fit, not every step: ``hasattr`` on a Keras optimizer without the
            # attribute raises and catches an AttributeError inside Keras.
            optimizer = self.model.optimizer
            self._corrected = hasattr(optimizer, "momentum") and self.momentum_correction
            self._rate = optimizer.lr

    AssignedRate.__name__ = AssignedRate.__qualname__ = schedule.__name__
    return AssignedRate


class ShiftedBatches(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """``callback`` seeing batch ``b`` of the next epoch as ``b + offset``: a resumed run's
    shortened first epoch starts at step ``offset`` of it, and the learning-rate schedule must
    go on from there, not from the epoch's start."""

    def __init__(self, callback: Any, offset: int) -> None:
        super().__init__()
        self._supports_tf_logs = getattr(callback, "_supports_tf_logs", False)
        self.callback = callback
        self.offset = offset

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs: Any = None) -> None:
        self.callback.on_train_begin(logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.callback.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.callback.on_train_batch_begin(batch + self.offset, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.callback.on_train_batch_end(batch + self.offset, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.callback.on_epoch_end(epoch, logs)
