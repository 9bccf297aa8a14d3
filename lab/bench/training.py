"""Benchmarks that print ratios measured side by side in one run, never absolute timings.

- reader: one epoch's worth of steps streamed from Parquet with petastorm, versus the same
  rows from in-memory arrays; same model, same process, alternating, best of each.
- scaling: samples/s of 2 Horovod ranks versus 1, each rank held to one compute thread so
  that the ratio measures distribution rather than thread pools.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest, processed_name
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from training import models
from training.config import LaunchConfig, TrainConfig
from training.input import InputSpec, as_url, load_split, make_train_dataset, plan_steps
from training.launcher import run_ranks
from training.rank.config import WorkerConfig

Progress = Callable[[str], None]


def _processed(
    catalog: Catalog, dataset: str
) -> tuple[Manifest, ProcessedLayout, Callable[[str], Path]]:
    """The newest processed version of ``dataset``, its layout, and its split folders."""
    manifest = catalog.get(processed_name(dataset))
    layout = ProcessedLayout.of(manifest)
    return manifest, layout, functools.partial(catalog.split_dir, manifest)


def _model_for(spec: InputSpec) -> str:
    """The model the benchmarks train: the small one of the data's kind."""
    return "cnn" if spec.kind == "images" else "dnn"


def bench_reader(
    catalog: Catalog,
    dataset: str,
    *,
    steps: int = 300,
    batch_size: int = 32,
    rounds: int = 5,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """Epoch time streaming ÷ epoch time from memory (1.0 = streaming costs nothing)."""
    import tensorflow as tf

    manifest, layout, split_dir = _processed(catalog, dataset)
    steps = min(steps, plan_steps(layout.train, 1, batch_size))
    spec = InputSpec.of(layout)
    inputs, labels = load_split(split_dir("train"), spec)
    in_memory = (
        tf.data.Dataset.from_tensor_slices((inputs, labels))
        .shuffle(4096, seed=0)
        .repeat()
        .batch(batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    streamed = make_train_dataset(
        str(as_url(split_dir("train"))),
        spec,
        rank=0,
        num_ranks=1,
        batch_size=batch_size,
        steps_per_epoch=plan_steps(layout.train, 1, batch_size),
        seed=0,
        shuffle_buffer=4096,
    )
    model = models.build(
        _model_for(spec),
        input_shape=spec.input_shape,
        num_classes=layout.num_classes,
        mean=layout.normalization.mean,
        std=layout.normalization.std,
    )
    model.compile(
        optimizer=tf.keras.optimizers.legacy.Adam(0.001),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    sources = {"streaming": iter(streamed), "memory": iter(in_memory)}

    def epoch(name: str, n: int) -> float:
        started = time.perf_counter()
        model.fit(sources[name], steps_per_epoch=n, epochs=1, verbose=0)
        return time.perf_counter() - started

    try:
        for name in sources:  # trace the graph and fill the pipelines before timing
            epoch(name, 20)
        seconds: dict[str, list[float]] = {name: [] for name in sources}
        for round_number in range(rounds):
            for name in sources:
                seconds[name].append(epoch(name, steps))
                progress(
                    f"bench reader: round {round_number + 1}, {name} {seconds[name][-1]:.1f} s"
                )
    finally:
        sources.clear()  # drop the iterators (and the streaming one's petastorm reader)
    best = {name: min(values) for name, values in seconds.items()}
    return {
        "benchmark": "reader",
        "dataset": manifest.name,
        "version": manifest.version,
        "ratio": best["streaming"] / best["memory"],
        "steps": steps,
        "batch_size": batch_size,
        "seconds": seconds,
    }


def bench_scaling(
    catalog: Catalog,
    dataset: str,
    *,
    steps: int = 100,
    batch_size: int = 128,
    rounds: int = 2,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """Samples/s with 2 ranks ÷ samples/s with 1, one compute thread per rank.

    The two are launched alternately, ``rounds`` times each, 3 epochs a launch; each side's
    best epoch after the first (which traces the graph and fills the pipeline) counts, so that
    a noisy neighbour on a shared machine does not decide the ratio. The default batch (128 per
    rank) is a throughput benchmark's: at 32, a step's allreduce weighs as much as its compute.
    """
    manifest, layout, split_dir = _processed(catalog, dataset)
    steps = min(steps, plan_steps(layout.train, 2, batch_size))
    throughput: dict[int, float] = {1: 0.0, 2: 0.0}
    measured: dict[str, list[float]] = {"1": [], "2": []}
    spec = InputSpec.of(layout)
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        for launch_number, num_ranks in enumerate([1, 2] * rounds):
            run_dir = Path(scratch) / f"np{num_ranks}-{launch_number}"
            run_dir.mkdir()
            config = TrainConfig(
                num_ranks=num_ranks,
                epochs=3,
                batch_size=batch_size,
                model=_model_for(spec),
                learning_rate=0.001,
                seed=0,
                shuffle_buffer=4096,
                warmup_epochs=1,
            )
            # One compute thread per rank, each rank pinned to a core of its own.
            launch = LaunchConfig(threads_per_rank=1)
            WorkerConfig(
                train=config,
                launch=launch,
                train_url=str(as_url(split_dir("train"))),
                test_dir=str(split_dir("test")),
                run_dir=str(run_dir),
                spec=asdict(spec),
                num_classes=layout.num_classes,
                steps_per_epoch=steps,
                evaluate=False,
            ).dump(run_dir / "worker.json")
            with one_blas_thread():
                run_ranks(config, launch, run_dir, progress)
            metrics = json.loads((run_dir / "metrics.json").read_text())
            # Epochs after the first: the first includes graph tracing and filling the pipeline.
            rates = [steps * batch_size * num_ranks / s for s in metrics["epoch_seconds"][1:]]
            measured[str(num_ranks)] += rates
            throughput[num_ranks] = max(throughput[num_ranks], *rates)
            progress(f"bench scaling: {num_ranks} rank(s): {max(rates):.0f} samples/s")
    if not throughput[1] > 0:
        raise ShardflowError("bench scaling: the 1-rank run measured no throughput")
    ceiling = machine_ceiling() if len(os.sched_getaffinity(0)) >= 2 else None
    if ceiling is not None:
        progress(f"bench scaling: this machine's 2-core ceiling for pure compute: {ceiling:.2f}")
    return {
        "benchmark": "scaling",
        "dataset": manifest.name,
        "version": manifest.version,
        "ratio": throughput[2] / throughput[1],
        # Measured in the same run, after the launches: 2 pinned processes ÷ 1 on pure matrix
        # products. On a shared host it moves from minute to minute; a hint, not a bound.
        "machine_ceiling": ceiling,
        "samples_per_second": {str(k): v for k, v in throughput.items()},
        "samples_per_second_measured": measured,
        "steps_per_rank": steps,
        "batch_size": batch_size,
        "threads_per_rank": 1,
    }


def _matmul_rate(core: int, seconds: float, results: Any) -> None:
    """Matrix products per second on one core (a process of its own, numpy on one thread)."""
    import numpy as np

    os.sched_setaffinity(0, {core})
    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ a
        n += 1
    results.put(n / (time.perf_counter() - started))


# The BLAS libraries numpy may use start their thread pools when numpy is imported, sized from
# these variables; pinning a process later (sched_setaffinity) reaches only its calling thread.
_ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Processes started inside this block (which inherit the environment) run one BLAS
    thread, so that pinning them to a core holds all their compute there."""
    saved = {name: os.environ.get(name) for name in _ONE_BLAS_THREAD}
    os.environ.update(_ONE_BLAS_THREAD)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def machine_ceiling(seconds: float = 4.0) -> float:
    """What two cores give over one for pure compute here: the same matrix products in two
    processes pinned to two cores ÷ in one, each with a single BLAS thread. A shared or
    hyper-threaded host gives less than 2 (a quiet 2-core one about 1.99)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with one_blas_thread(), context.Manager() as manager:
        rates = []
        for cores in ([0], [0, 1]):
            queue = manager.Queue()
            processes = [
                context.Process(target=_matmul_rate, args=(c, seconds, queue)) for c in cores
            ]
            for process in processes:
                process.start()
            for process in processes:
                process.join()
            rates.append(sum(queue.get() for _ in cores))
    ratio: float = rates[1] / rates[0]
    return ratio


def bench_aggregation(
    catalog: Catalog,
    dataset: str,
    *,
    runs_dir: Path,
    epochs: int = 3,
    ranks: tuple[int, ...] = (1, 2),
    passes: tuple[int, ...] = (1, 2, 4),
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """The seed project's experiment: ranks x backward passes per step -> allreduce bytes per
    epoch and test accuracy. Every cell is a real training run, committed as a model version."""
    from training.launcher import train

    _manifest, layout, _split_dir = _processed(catalog, dataset)
    model = _model_for(InputSpec.of(layout))
    rows = []
    for num_ranks in ranks:
        for k in passes:
            progress(f"bench aggregation: {num_ranks} ranks, {k} backward passes per step")
            manifest, metrics = train(
                catalog,
                dataset,
                config=TrainConfig(
                    num_ranks=num_ranks, epochs=epochs, model=model, backward_passes_per_step=k
                ),
                launch=LaunchConfig(),
                runs_dir=runs_dir,
                progress=progress,
            )
            rows.append(
                {
                    "num_ranks": num_ranks,
                    "backward_passes_per_step": k,
                    "allreduce_bytes_per_epoch": metrics["allreduce_bytes_per_epoch"],
                    "test_accuracy": metrics["test_accuracy"],
                    "model_version": manifest.version,
                }
            )
    return {"benchmark": "aggregation", "dataset": dataset, "epochs": epochs, "rows": rows}
