"""``shardflow bench callbacks DATASET``: what shardflow's own Keras callbacks cost a training
step, measured with and without them on the same model, in one process, alternated.

The rank's callbacks are assembled as a rank of ``train`` assembles them
(training.rank.callbacks.assemble: Horovod's broadcast, metric average and learning-rate
schedule; the divergence guard; rank 0's checkpoints and TensorBoard; the meters), on one
Horovod rank. Each side trains ``steps`` steps of one epoch from in-memory batches (so the
input does not weigh on either); the first fit of each side, which traces the graph, is not
timed. Keras's own check (its warning "Callback method `on_train_batch_end` is slow compared to
the batch time") runs in the first timed fit with the callbacks, and whether it warned is
reported too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data_catalog import Catalog, processed_name
from data_catalog.layout import ProcessedLayout
from training.config import LaunchConfig, TrainConfig
from training.input import InputSpec, as_url, in_batches, load_split, plan_steps
from training.rank.config import WorkerConfig

SLOW_CALLBACK = "is slow compared to the batch time"


class _Clock:
    """Two Keras callbacks, put first and last in the list: the time Keras spends in every
    hook of the callbacks between them, added up in ``.seconds``, and the CPU time of the
    thread that runs them (Keras calls hooks between steps, on the thread calling ``fit``) in
    ``.cpu_seconds``: on a busy host a hook's wall time includes waits for a core. Of it,
    ``.batch_cpu_seconds`` in the batch hooks (the rest: epochs', and ``fit``'s own begin and
    end, which a run calls once, the bench once per epoch)."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.seconds = self.cpu_seconds = self.batch_cpu_seconds = 0.0
        self._started = self._cpu_started = 0.0
        clock = self

        class Edge(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
            def __init__(self, opens: bool) -> None:
                super().__init__()
                self._supports_tf_logs = True
                self.opens = opens

            def _tick(self, *_args: Any) -> float:
                if self.opens:
                    clock._started, clock._cpu_started = time.perf_counter(), time.thread_time()
                    return 0.0
                clock.seconds += time.perf_counter() - clock._started
                cpu = time.thread_time() - clock._cpu_started
                clock.cpu_seconds += cpu
                return cpu

            def _batch(self, *_args: Any) -> None:
                clock.batch_cpu_seconds += self._tick()

            on_train_batch_begin = on_train_batch_end = _batch
            on_epoch_begin = on_epoch_end = on_train_begin = on_train_end = _tick

        self.first, self.last = Edge(True), Edge(False)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _config(
    catalog: Catalog, dataset: str, run_dir: Path, batch_size: int, steps: int | None
) -> Any:
    manifest = catalog.get(processed_name(dataset))
    layout = ProcessedLayout.of(manifest)
    spec = InputSpec.of(layout)
    steps = min(steps or 10**9, plan_steps(layout.train, 1, batch_size))
    config = WorkerConfig(
        train=TrainConfig(
            num_ranks=1,
            epochs=1000,
            batch_size=batch_size,
            model="cnn" if spec.kind == "images" else "dnn",
            seed=0,
        ),
        launch=LaunchConfig(),
        train_url=str(as_url(catalog.split_dir(manifest, "train"))),
        test_dir=str(catalog.split_dir(manifest, "test")),
        run_dir=str(run_dir),
        spec=asdict(spec),
        num_classes=layout.num_classes,
        mean=list(layout.normalization.mean),
        std=list(layout.normalization.std),
        steps_per_epoch=steps,
        evaluate=False,
    )
    return config, spec, manifest


def bench_callbacks(
    catalog: Catalog,
    dataset: str,
    *,
    steps: int | None = None,
    batch_size: int = 32,
    rounds: int = 5,
    progress: Any = lambda _msg: None,
) -> dict[str, Any]:
    """Step time with shardflow's callbacks ÷ without (1.02 = they cost 2 % of a step), over
    epochs of ``steps`` steps (default: one rank's epoch of the version at ``batch_size``)."""
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-callbacks-") as scratch:
        return _measure(catalog, dataset, Path(scratch), steps, batch_size, rounds, progress)


def _measure(
    catalog: Catalog,
    dataset: str,
    run_dir: Path,
    steps: int | None,
    batch_size: int,
    rounds: int,
    progress: Any,
) -> dict[str, Any]:
    import tensorflow as tf

    from training.input_metrics import InputMeter
    from training.rank import callbacks, model, setup

    config, spec, manifest = _config(catalog, dataset, run_dir, batch_size, steps)
    steps = config.steps_per_epoch
    world = setup.init_horovod(config.train)
    tf.keras.utils.set_random_seed(0)
    built = model.compiled(config, spec, world, [])
    parts = callbacks.assemble(config, world, built, InputMeter(), None)
    inputs, labels = load_split(config.source("train"), spec)
    batches = in_batches((inputs, labels), batch_size).repeat()
    clock = _Clock()
    sides = {"with": [clock.first, *parts.in_order, clock.last], "without": []}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    epoch = 0

    def fit(side: str) -> float:
        nonlocal epoch
        started, cpu_started = time.perf_counter(), _cpu()
        built.model.fit(
            batches, steps_per_epoch=steps, epochs=epoch + 1, initial_epoch=epoch,
            callbacks=sides[side], verbose=0,
        )  # fmt: skip
        epoch += 1
        cpu[side].append(_cpu() - cpu_started)
        return time.perf_counter() - started

    handler = _Warnings()
    tf.get_logger().addHandler(handler)
    try:
        # Rank 0's lines ("input metrics of epoch N: ...") to stderr: stdout is --json's.
        with contextlib.redirect_stdout(sys.stderr):
            fit("without")  # traces the step
            cpu_before = os.times()
            # The first fit with the callbacks: Keras times its first batches' hooks.
            for number in range(rounds):
                for side in ("with", "without"):
                    seconds[side].append(fit(side))
                progress(
                    f"bench callbacks: round {number + 1}: with {seconds['with'][-1]:.2f} s, "
                    f"without {seconds['without'][-1]:.2f} s ({steps} steps each)"
                )
            cpu_after = os.times()
    finally:
        tf.get_logger().removeHandler(handler)
    best = {side: min(values) for side, values in seconds.items()}
    in_hooks = clock.seconds / sum(seconds["with"])
    slow = [m for m in handler.messages if SLOW_CALLBACK in m]
    return {
        "benchmark": "callbacks",
        "dataset": manifest.name,
        "version": manifest.version,
        "ratio": best["with"] / best["without"],
        # Each side's median round: on a busy host one fast round of one side moves the best.
        "ratio_median": statistics.median(seconds["with"]) / statistics.median(seconds["without"]),
        # Robust to a busy host: the share of the runs with callbacks spent inside them.
        "hook_share": in_hooks,
        # Steadier still: the hooks' CPU time per step, and its share of the fastest step
        # without them (what they would add to it on an idle host).
        "hook_cpu_seconds_per_step": clock.cpu_seconds / (steps * rounds),
        "hook_cpu_share": clock.cpu_seconds / (steps * rounds) / (best["without"] / steps),
        "batch_hook_cpu_seconds_per_step": clock.batch_cpu_seconds / (steps * rounds),
        "batch_hook_cpu_share": clock.batch_cpu_seconds
        / (steps * rounds)
        / (best["without"] / steps),
        "step_seconds": {side: best[side] / steps for side in best},
        "seconds": seconds,
        # This process's CPU-seconds per round (every thread): steadier than wall on a busy host.
        "cpu_seconds_by_round": cpu,
        "cpu_ratio_median": statistics.median(cpu["with"]) / statistics.median(cpu["without"]),
        "steps": steps,
        "batch_size": batch_size,
        "callbacks": [type(c).__name__ for c in parts.in_order],
        "keras_slow_callback_warnings": slow,
        "cpu_seconds": (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system),
        "load_average": list(os.getloadavg()),
    }
