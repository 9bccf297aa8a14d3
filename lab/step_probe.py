"""Time one rank's training step of a model of training.models on random images, and count
its gradient bytes: ``python -m lab.step_probe MODEL SIDE BATCH STEPS WARMUP`` prints
one JSON line.

The step is what a Horovod rank computes between allreduces (forward, loss, backward, SGD
with momentum), with no allreduce: the compute half of the scaling model
(lab.scaling_model). Random inputs: the time does not depend on the pixels.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def measure(model_name: str, side: int, batch_size: int, steps: int, warmup: int) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from training import models

    classes = 1000
    start = time.perf_counter()
    model = models.build(model_name, input_shape=(side, side, 3), num_classes=classes)
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    images = tf.constant(rng.integers(0, 256, (batch_size, side, side, 3), dtype=np.uint8))
    labels = tf.constant(rng.integers(0, classes, batch_size))

    def eager_step() -> Any:
        with tf.GradientTape() as tape:
            value = loss(labels, model(images, training=True))
        gradients = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return value

    # No warm-up: eager steps, no tracing (quick runs: the graph's build costs more than them).
    step = tf.function(eager_step) if warmup > 0 else eager_step
    for _ in range(warmup):
        step().numpy()
    built = time.perf_counter() - start
    seconds = []
    cpu = []
    for _ in range(steps):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        begin = time.perf_counter()
        step().numpy()
        seconds.append(time.perf_counter() - begin)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    gradient_values = int(sum(int(np.prod(v.shape)) for v in model.trainable_variables))
    return {
        "model": model_name,
        "side": side,
        "batch_size": batch_size,
        "parameters": int(model.count_params()),
        "gradient_values": gradient_values,
        "gradient_bytes": gradient_values * 4,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "build_and_warmup_seconds": built,
        "threads": {
            "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5:
        print("usage: python -m lab.step_probe MODEL SIDE BATCH STEPS WARMUP", file=sys.stderr)
        return 2
    model, side, batch, steps, warmup = args[0], *(int(a) for a in args[1:])
    print(json.dumps(measure(model, side, batch, steps, warmup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
