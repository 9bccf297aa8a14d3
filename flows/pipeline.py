"""Prefect flows: the stages of ``flows.stages`` as tasks of one pipeline flow run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from data_catalog import Catalog
from data_catalog.errors import ShardflowError
from flows import stages


class _UserErrorsWithoutTracebacks(logging.Filter):
    """Bad input is reported in one line: drop the traceback Prefect attaches to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ShardflowError):
            record.exc_info = None
            record.exc_text = None
        return True


def _hide_user_error_tracebacks() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _UserErrorsWithoutTracebacks) for f in handler.filters
        ):
            handler.addFilter(_UserErrorsWithoutTracebacks())


def _catalog(home: str) -> Catalog:
    import os

    return Catalog(Path(home) / "catalog", index_url=os.environ.get("SHARDFLOW_CATALOG_URL"))


def _logger_progress() -> Any:
    logger = get_run_logger()
    return logger.info


@task(name="ingest")
def ingest_task(home: str, dataset: str, source: str | None) -> dict[str, Any]:
    return stages.ingest(_catalog(home), dataset, source=source, progress=_logger_progress())


@task(name="preprocess")
def preprocess_task(home: str, dataset: str, workers: int, scheduler: str | None) -> dict[str, Any]:
    return stages.preprocess(
        _catalog(home),
        dataset,
        workers=workers,
        scheduler=scheduler,
        progress=_logger_progress(),
    )


@task(name="train")
def train_task(home: str, dataset: str, options: dict[str, Any]) -> dict[str, Any]:
    return stages.train(
        _catalog(home),
        dataset,
        runs_dir=Path(home) / "runs",
        progress=_logger_progress(),
        **options,
    )


@flow(name="shardflow-pipeline")
def pipeline(
    dataset: str,
    home: str,
    source: str | None = None,
    workers: int = 2,
    scheduler: str | None = None,
    num_ranks: int = 2,
    epochs: int = 3,
    batch_size: int = 32,
    model: str = "cnn",
    learning_rate: float = 0.001,
    seed: int = 0,
    hosts: str | None = None,
    backward_passes_per_step: int = 1,
    compression: str = "none",
    resume: bool = False,
    timeline: bool = False,
    show_tracebacks: bool = False,
) -> dict[str, Any]:
    """Ingest → preprocess → train, each a task of this flow run."""
    if not show_tracebacks:
        _hide_user_error_tracebacks()
    raw = ingest_task(home, dataset, source)
    processed = preprocess_task(home, dataset, workers, scheduler)
    trained = train_task(
        home,
        dataset,
        {
            "num_ranks": num_ranks,
            "epochs": epochs,
            "batch_size": batch_size,
            "model": model,
            "learning_rate": learning_rate,
            "seed": seed,
            "hosts": hosts,
            "backward_passes_per_step": backward_passes_per_step,
            "compression": compression,
            "resume": resume,
            "timeline": timeline,
        },
    )
    return {
        **trained,
        "raw_version": raw["version"],
        "processed_version": processed["version"],
        "rows": raw["rows"],
        "flow_run_id": str(flow_run.id),
    }
