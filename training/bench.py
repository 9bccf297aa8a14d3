"""Benchmarks that print ratios measured side by side in one run, never absolute timings.

- reader: one epoch's worth of steps streamed from Parquet with petastorm, versus the same
  rows from in-memory arrays; same model, same process, alternating, best of each.
- scaling: samples/s of 2 Horovod ranks versus 1, each rank held to one compute thread so
  that the ratio measures distribution rather than thread pools.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest
from data_catalog.errors import ShardflowError
from training import models
from training.input import InputSpec, SplitLayout, load_split, make_train_dataset
from training.launcher import TrainConfig, launch
from training.worker import WorkerConfig

Progress = Callable[[str], None]


def _processed(catalog: Catalog, dataset: str) -> tuple[Manifest, SplitLayout, Path]:
    from preprocessing.jobs import processed_name

    manifest = catalog.get(processed_name(dataset))
    stats = manifest.statistics["train"]
    layout = SplitLayout(
        rows_per_group=int(stats["rows_per_group"]), num_row_groups=int(stats["num_row_groups"])
    )
    return manifest, layout, catalog.version_dir(manifest.name, manifest.version)


def bench_reader(
    catalog: Catalog,
    dataset: str,
    *,
    steps: int = 300,
    batch_size: int = 32,
    rounds: int = 2,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """Epoch time streaming ÷ epoch time from memory (1.0 = streaming costs nothing)."""
    import tensorflow as tf

    manifest, layout, directory = _processed(catalog, dataset)
    steps = min(steps, layout.steps_per_epoch(1, batch_size))
    spec = InputSpec.of(manifest.schema)
    inputs, labels = load_split(directory / "train", spec)
    in_memory = (
        tf.data.Dataset.from_tensor_slices((inputs, labels))
        .shuffle(4096, seed=0)
        .repeat()
        .batch(batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    streamed = make_train_dataset(
        (directory / "train").resolve().as_uri(),
        spec,
        rank=0,
        num_ranks=1,
        batch_size=batch_size,
        steps_per_epoch=layout.steps_per_epoch(1, batch_size),
        seed=0,
        shuffle_buffer=4096,
    )
    normalization = manifest.statistics.get("normalization", {})
    model = models.build(
        "cnn" if spec.kind == "images" else "dnn",
        input_shape=spec.input_shape,
        num_classes=int(manifest.schema["num_classes"]),
        mean=normalization.get("mean"),
        std=normalization.get("std"),
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
    steps: int = 200,
    batch_size: int = 32,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """Samples/s with 2 ranks ÷ samples/s with 1, one compute thread per rank."""
    manifest, layout, directory = _processed(catalog, dataset)
    steps = min(steps, layout.steps_per_epoch(2, batch_size))
    throughput: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        for num_ranks in (1, 2):
            run_dir = Path(scratch) / f"np{num_ranks}"
            run_dir.mkdir()
            spec = InputSpec.of(manifest.schema)
            WorkerConfig(
                train_url=(directory / "train").resolve().as_uri(),
                test_dir=str(directory / "test"),
                run_dir=str(run_dir),
                spec=asdict(spec),
                num_classes=int(manifest.schema["num_classes"]),
                model="cnn" if spec.kind == "images" else "dnn",
                epochs=2,
                batch_size=batch_size,
                learning_rate=0.001,
                seed=0,
                steps_per_epoch=steps,
                shuffle_buffer=4096,
                warmup_epochs=1,
                threads_per_rank=1,
                evaluate=False,
            ).dump(run_dir / "worker.json")
            launch(TrainConfig(num_ranks=num_ranks, batch_size=batch_size), run_dir, progress)
            metrics = json.loads((run_dir / "metrics.json").read_text())
            # The second epoch: the first includes graph tracing and filling the pipeline.
            throughput[num_ranks] = steps * batch_size * num_ranks / metrics["epoch_seconds"][-1]
            progress(f"bench scaling: {num_ranks} rank(s): {throughput[num_ranks]:.0f} samples/s")
    if not throughput[1] > 0:
        raise ShardflowError("bench scaling: the 1-rank run measured no throughput")
    return {
        "benchmark": "scaling",
        "dataset": manifest.name,
        "version": manifest.version,
        "ratio": throughput[2] / throughput[1],
        "samples_per_second": {str(k): v for k, v in throughput.items()},
        "steps_per_rank": steps,
        "batch_size": batch_size,
        "threads_per_rank": 1,
    }


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

    rows = []
    for num_ranks in ranks:
        for k in passes:
            progress(f"bench aggregation: {num_ranks} ranks, {k} backward passes per step")
            manifest, metrics = train(
                catalog,
                dataset,
                config=TrainConfig(num_ranks=num_ranks, epochs=epochs, backward_passes_per_step=k),
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
