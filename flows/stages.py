"""The three stages as plain calls returning JSON-ready results.

The CLI calls these directly; the Prefect flows in ``flows.pipeline`` wrap the same calls in
tasks. Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_catalog import Catalog
from preprocessing.images import ClusterConfig, PreprocessConfig, processed_name
from preprocessing.images import preprocess as preprocess_images
from preprocessing.sources import mnist
from training.launcher import TrainConfig, model_name
from training.launcher import train as train_model

Progress = Callable[[str], None]


def ingest(
    catalog: Catalog, dataset: str, *, source: str | None, progress: Progress
) -> dict[str, Any]:
    manifest = mnist.ingest(catalog, dataset, source=source, progress=progress)
    return {
        "dataset": dataset,
        "version": manifest.version,
        "rows": manifest.rows,
        "train_rows": manifest.statistics["train_rows"],
        "test_rows": manifest.statistics["test_rows"],
        "sources": [s["uri"] for s in manifest.sources],
    }


def preprocess(
    catalog: Catalog, dataset: str, *, workers: int, scheduler: str | None, progress: Progress
) -> dict[str, Any]:
    config = PreprocessConfig(cluster=ClusterConfig(workers=workers, scheduler=scheduler))
    manifest = preprocess_images(catalog, dataset, config=config, progress=progress)
    return {
        "dataset": dataset,
        "name": manifest.name,
        "version": manifest.version,
        "parent": str(manifest.parents[0]),
        "rows": manifest.rows,
        "num_files": len(manifest.files),
        "splits": manifest.statistics,
    }


def train(
    catalog: Catalog, dataset: str, *, runs_dir: Path, progress: Progress, **options: Any
) -> dict[str, Any]:
    config = TrainConfig(**options)
    manifest, metrics = train_model(
        catalog, dataset, config=config, runs_dir=runs_dir, progress=progress
    )
    return {
        "dataset": dataset,
        "model_name": model_name(dataset, config.model),
        "version": manifest.version,
        "dataset_version": str(manifest.parents[0]),
        "processed": processed_name(dataset),
        "num_ranks": metrics["num_ranks"],
        "epochs": metrics["epochs"],
        "test_accuracy": metrics["test_accuracy"],
        "test_rows": metrics["test_rows"],
        "train_seconds": metrics["train_seconds"],
        "samples_per_second": metrics["samples_per_second"],
        "history": metrics["history"],
        "backward_passes_per_step": metrics["backward_passes_per_step"],
        "compression": metrics["compression"],
        "allreduce_bytes_per_epoch": metrics["allreduce_bytes_per_epoch"],
        "resumed_after_epoch": metrics["resumed_after_epoch"],
        "run_dir": manifest.extra.get("run_dir"),
    }
