"""The three stages as plain calls returning JSON-ready results (:mod:`flows.results`).

The CLI calls these directly; the Prefect flows in ``flows.pipeline`` call the same functions
inside their flow runs, handing preprocessing a runner that makes every task a task run.
Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flows import results
from flows.settings import Settings
from preprocessing import datasets, jobs
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import IngestRequest
from preprocessing.driver import OnProgress, PassProgress, RunnerFactory, dask_runner, run_job
from training.config import TrainConfig

Progress = Callable[[str], None]


class _Tally:
    """Passes progress on, and keeps each pass's task count and how many of its tasks found
    their output already there (an interrupted run's): {pass: {"tasks": n, "reused": k}}, and
    what the tasks' processes used."""

    def __init__(self, on_progress: OnProgress) -> None:
        self.on_progress = on_progress
        self.counts: dict[str, dict[str, int]] = {}
        self.usage: dict[str, Any] | None = None

    def __call__(self, state: PassProgress) -> None:
        self.counts[state.pass_name] = {"tasks": state.tasks_total, "reused": state.reused}
        self.on_progress(state)

    def keep_usage(self, usage: dict[str, Any]) -> None:
        self.usage = usage

    def summary(self) -> dict[str, Any]:
        """{"tasks": ..., "resources": peak RSS and CPU seconds of the workers and driver}."""
        return {"tasks": self.counts, **({"resources": self.usage} if self.usage else {})}


def ingest(
    settings: Settings,
    dataset: str,
    request: IngestRequest,
    *,
    cluster: ClusterConfig,
    progress: Progress,
    runner: RunnerFactory | None = None,
    on_progress: OnProgress | None = None,
) -> dict[str, Any]:
    """The dataset's raw files into a raw version: one task per input file on ``cluster`` (the
    flows pass a ``runner`` of their own on it)."""
    if request.work_dir is None:
        request = replace(request, work_dir=settings.work_dir)
    catalog = settings.catalog()
    job = datasets.dataset(dataset).plan_ingest(catalog, request)
    tally = _Tally(on_progress or (lambda state: progress(state.describe())))
    manifest = run_job(
        catalog,
        job,
        runner=runner or (lambda: dask_runner(cluster, progress)),
        work_root=settings.work_dir,
        progress=progress,
        on_progress=tally,
        on_usage=tally.keep_usage,
    )
    return {**results.ingest_result(dataset, manifest), **tally.summary()}


def preprocess(
    settings: Settings,
    dataset: str,
    *,
    options: JobOptions,
    cluster: ClusterConfig,
    progress: Progress,
    runner: RunnerFactory | None = None,
    on_progress: OnProgress | None = None,
) -> dict[str, Any]:
    """The latest raw version into a processed version, on ``cluster`` (the flows pass a
    ``runner`` of their own on it)."""
    tally = _Tally(on_progress or (lambda state: progress(state.describe())))
    manifest = jobs.preprocess(
        settings.catalog(),
        dataset,
        options=options,
        runner=runner or (lambda: dask_runner(cluster, progress)),
        work_root=settings.work_dir,
        progress=progress,
        on_progress=tally,
        on_usage=tally.keep_usage,
    )
    return {**results.preprocess_result(dataset, manifest), **tally.summary()}


def with_default_model(dataset: str, config: TrainConfig) -> TrainConfig:
    """``config`` with the dataset's default model where it names none."""
    if config.model is not None:
        return config
    return replace(config, model=datasets.dataset(dataset).default_model)


def train(
    settings: Settings, dataset: str, config: TrainConfig, *, progress: Progress
) -> dict[str, Any]:
    """Train on the latest processed version with horovodrun; commit the model."""
    from training.launcher import train as train_model

    manifest, metrics = train_model(
        settings.catalog(),
        dataset,
        config=with_default_model(dataset, config),
        runs_dir=settings.runs_dir,
        progress=progress,
    )
    result = results.train_result(dataset, manifest, metrics)
    run_dir = result.get("run_dir")
    if run_dir and Path(run_dir).is_dir():
        from training.report import write_report

        # The one view of this model version (docs/training.md, "Input view").
        report = write_report(settings.catalog(), manifest.name, manifest.version, None)
        result["report"] = str(report)
        progress(f"report: {report}")
    return result
