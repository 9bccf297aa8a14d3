"""Preprocess the latest raw version of a dataset: the one preprocess driver.

raw version ──plan (registry)──▶ Job ──driver.run_job (runner)──▶ files in the job's folder
    ──commit──▶ processed version "<dataset>-processed" (parent: the raw version)

The CLI passes a runner on a plain Dask client, the Prefect flow one that makes every task a
task run; both come here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest
from preprocessing import datasets
from preprocessing.config import JobOptions
from preprocessing.driver import Job, OnProgress, Progress, RunnerFactory, run_job


def plan(catalog: Catalog, dataset: str, options: JobOptions) -> Job:
    """The job that processes the latest raw version of ``dataset`` (reads manifests only)."""
    return datasets.dataset(dataset).plan_preprocessing(catalog, options)


def preprocess(
    catalog: Catalog,
    dataset: str,
    *,
    options: JobOptions,
    runner: RunnerFactory,
    work_root: Path | None = None,
    progress: Progress = lambda _msg: None,
    on_progress: OnProgress | None = None,
    on_usage: Callable[[dict[str, Any]], None] | None = None,
) -> Manifest:
    """Turn the latest raw version of ``dataset`` into a processed version.

    Returns the existing version, doing no work, when the same raw version was already
    processed with the same parameters and code.
    """
    job = plan(catalog, dataset, options)
    return run_job(
        catalog,
        job,
        runner=runner,
        work_root=work_root,
        progress=progress,
        on_progress=on_progress,
        on_usage=on_usage,
    )
