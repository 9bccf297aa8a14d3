"""Preprocess the latest raw version of a dataset: pick its job, run it on Dask, commit.

raw version ──plan──▶ Job ──run_job (Dask)──▶ files in the job's folder ──commit──▶
processed version "<dataset>-processed" (parent: the raw version)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

from data_catalog import Catalog, Manifest
from data_catalog.errors import ShardflowError
from preprocessing.engine import ClusterConfig, Job, JobOptions, Progress, dask_client, job_dir
from preprocessing.engine import run_job as run_job_on_dask

TABULAR_DATASETS = ("sdss",)


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    options: JobOptions = field(default_factory=JobOptions)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def processed_name(dataset: str) -> str:
    return f"{dataset}-processed"


def plan(catalog: Catalog, dataset: str, options: JobOptions) -> Job:
    """The job that processes the latest raw version of ``dataset`` (reads manifests only)."""
    if not catalog.is_local:
        raise ShardflowError(
            f"preprocessing reads raw files by path: the catalog {catalog.url} is not on a local "
            "or mounted filesystem (object-store catalogs take ingest and catalog commands)"
        )
    raw = catalog.get(dataset)
    if raw.kind != "raw":
        raise ShardflowError(f"{dataset}@{raw.version} is {raw.kind}, expected a raw version")
    if dataset in TABULAR_DATASETS:
        from preprocessing.sdss import plan_sdss_job

        job: Job = plan_sdss_job(catalog, raw, options)
        return job
    from preprocessing.images import plan_job

    return plan_job(catalog, raw, options)


def preprocess(
    catalog: Catalog,
    dataset: str,
    *,
    config: PreprocessConfig | None = None,
    progress: Progress = lambda _msg: None,
) -> Manifest:
    """Turn the latest raw version of ``dataset`` into a processed version on Dask.

    Returns the existing version, doing no work, when the same raw version was already
    processed with the same parameters and code.
    """
    config = config or PreprocessConfig()
    job = plan(catalog, dataset, config.options)
    if catalog.exists(job.name, job.version):
        progress(f"{job.name}@{job.version} already in the catalog; nothing to do")
        return catalog.get(job.name, job.version)
    with (
        catalog.stage(job.name, kind="processed") as stage,
        dask_client(config.cluster, progress) as client,
    ):
        work_root = config.cluster.work_dir
        # Beside staging (never inside: staging is what gets committed) unless a work folder
        # was given, where a rerun after a crash finds what the crashed run finished.
        work = (
            job_dir(work_root, job)
            if work_root is not None
            else stage.path.with_name(stage.path.name + ".work")
        )
        scans, written = run_job_on_dask(client, job, work, progress)
        manifest = job.commit(stage, scans, written, work)
    shutil.rmtree(work, ignore_errors=True)
    return manifest
