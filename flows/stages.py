"""The three stages as plain calls returning JSON-ready results.

The CLI calls these directly; the Prefect flows in ``flows.pipeline`` call the same library
functions inside tasks and use the same result shapes. Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest
from data_catalog.errors import ShardflowError
from preprocessing.engine import DEFAULT_MEMORY_LIMIT, ClusterConfig, JobOptions
from preprocessing.jobs import PreprocessConfig
from preprocessing.jobs import preprocess as run_preprocessing
from preprocessing.sources import cifar10, mnist, sdss
from training.launcher import TrainConfig
from training.launcher import train as train_model

Progress = Callable[[str], None]


def ingest_result(dataset: str, manifest: Manifest) -> dict[str, Any]:
    result = {
        "dataset": dataset,
        "version": manifest.version,
        "rows": manifest.rows,
        "files": len(manifest.files),
        "sources": [s.get("uri") or s.get("url") or s.get("file") for s in manifest.sources],
    }
    for key in ("train_rows", "test_rows", "pages", "count_reported", "synthetic_rows"):
        if key in manifest.statistics:
            result[key] = manifest.statistics[key]
    return result


def preprocess_result(dataset: str, manifest: Manifest) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "name": manifest.name,
        "version": manifest.version,
        "parent": str(manifest.parents[0]),
        "rows": manifest.rows,
        "num_files": len(manifest.files),
        "format": manifest.schema.get("format", "parquet"),
        "splits": {
            split: manifest.statistics[split]
            for split in ("train", "validation", "test")
            if split in manifest.statistics
        },
        **{
            key: manifest.statistics[key]
            for key in ("normalization", "quarantine", "rows_in")
            if key in manifest.statistics
        },
    }


def train_result(dataset: str, manifest: Manifest, metrics: dict[str, Any]) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "model_name": manifest.name,
        "version": manifest.version,
        "dataset_version": str(manifest.parents[0]),
        "num_ranks": metrics["num_ranks"],
        "epochs": metrics["epochs"],
        "steps_per_epoch": metrics["steps_per_epoch"],
        "test_accuracy": metrics["test_accuracy"],
        "test_rows": metrics["test_rows"],
        "train_seconds": metrics["train_seconds"],
        "samples_per_second": metrics["samples_per_second"],
        "history": metrics["history"],
        "backward_passes_per_step": metrics["backward_passes_per_step"],
        "compression": metrics["compression"],
        "allreduce_bytes_per_epoch": metrics["allreduce_bytes_per_epoch"],
        "allreduce_bytes_by_epoch": metrics.get("allreduce_bytes_by_epoch"),
        "allreduce_bytes_per_epoch_computed": metrics.get("allreduce_bytes_per_epoch_computed"),
        "resumed_after_epoch": metrics["resumed_after_epoch"],
        "run_dir": manifest.extra.get("run_dir"),
    }


def ingest(
    catalog: Catalog,
    dataset: str,
    *,
    source: str | None,
    progress: Progress,
    work_dir: Path,
    on_file: Callable[[dict[str, Any]], None] = lambda _file: None,
    skyserver: sdss.SkyServerOptions | None = None,
) -> dict[str, Any]:
    """Any dataset's raw files into a raw version: IDX sets (``on_file`` hears of each fetched
    file), CIFAR-10 batches (``source`` required), SDSS exports or SkyServer (``source`` None)."""
    if dataset == "sdss" and source is not None:
        manifest = sdss.ingest_exports(catalog, source=source, progress=progress)
    elif dataset == "sdss":
        skyserver = skyserver or sdss.SkyServerOptions()
        manifest = sdss.ingest_skyserver(
            catalog,
            skyserver_url=skyserver.url,
            data_release=skyserver.data_release,
            limit=skyserver.limit,
            progress=progress,
        )
    elif dataset == "cifar10":
        if source is None:
            raise ShardflowError(
                "cifar10 needs --source: a directory of batches, a .tar.gz, or its URL"
            )
        manifest = cifar10.ingest(catalog, source=source, progress=progress)
    else:
        manifest = mnist.ingest(
            catalog,
            dataset,
            source=source,
            progress=progress,
            on_file=on_file,
            download_cache=work_dir / "downloads",
        )
    return ingest_result(dataset, manifest)


def preprocess(
    catalog: Catalog,
    dataset: str,
    *,
    workers: int,
    scheduler: str | None,
    progress: Progress,
    work_dir: Path,
    options: JobOptions | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
) -> dict[str, Any]:
    config = PreprocessConfig(
        options=options or JobOptions(),
        cluster=ClusterConfig(
            workers=workers, scheduler=scheduler, work_dir=work_dir, memory_limit=memory_limit
        ),
    )
    manifest = run_preprocessing(catalog, dataset, config=config, progress=progress)
    return preprocess_result(dataset, manifest)


def train(
    catalog: Catalog, dataset: str, *, runs_dir: Path, progress: Progress, **options: Any
) -> dict[str, Any]:
    manifest, metrics = train_model(
        catalog, dataset, config=TrainConfig(**options), runs_dir=runs_dir, progress=progress
    )
    return train_result(dataset, manifest, metrics)
