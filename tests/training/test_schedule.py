"""The learning rate of every step, as the rank's schedule callbacks set it during a real Keras
fit: Horovod's warm-up, then the cosine decay, step by step (staircase off)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from training.config import TrainConfig
from training.rank.schedule import cosine_decay, learning_rate_schedules

STEPS = 8
EPOCHS = 3
LR = 0.01


class RateRecorder(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """The optimizer's rate as the step runs with it (after the schedules' batch hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.rates.append(float(self.model.optimizer.lr.numpy()))


def test_every_step_runs_at_the_scheduled_rate() -> None:
    import horovod.tensorflow.keras as hvd

    hvd.init()
    train = TrainConfig(num_ranks=1, epochs=EPOCHS, model="dnn", warmup_epochs=1)
    schedules = learning_rate_schedules(train, LR, STEPS)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.legacy.Adam(LR), loss="mse")
    x, y = np.ones((STEPS * 4, 4), np.float32), np.zeros((STEPS * 4, 2), np.float32)
    recorder = RateRecorder()
    model.fit(x, y, batch_size=4, epochs=EPOCHS, callbacks=[*schedules, recorder], verbose=0)

    decay = cosine_decay(1, EPOCHS)
    # One rank: Horovod's warm-up multiplier is 1 throughout the first epoch.
    expected = [LR] * STEPS + [
        LR * decay(epoch + batch / STEPS) for epoch in range(1, EPOCHS) for batch in range(STEPS)
    ]
    assert np.allclose(recorder.rates, np.float32(expected), rtol=1e-6)
    assert len(set(recorder.rates[STEPS:])) == (EPOCHS - 1) * STEPS  # a new rate every step
