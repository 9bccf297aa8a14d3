"""The three stages as plain calls returning typed results (:mod:`flows.results`).

    the edge: a CLI command, or a flow run of flows.pipeline
      │  Settings (read once), one Catalog, the Dataset (looked up once), a runner factory
      ▼
    ingest ─── Dataset.ingest ─────── driver.run_job ─▶ IngestResult
    preprocess ─ Dataset.preprocess ── driver.run_job ─▶ PreprocessResult
    train ──── training.launcher.train (horovodrun) ──▶ TrainResult (+ the HTML report)

The CLI hands in the planned runner (:func:`dask_runners`: this process, its threads or a Dask
cluster, as the job's plan says); the Prefect flows the same, each pass a task run, and an
epoch hook that publishes the input table while training runs. Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from data_catalog import Catalog
from flows import results
from flows.results import IngestResult, PreprocessResult, TaskTally, TrainResult
from flows.settings import Settings
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import Dataset, IngestRequest
from preprocessing.driver import OnProgress, PassProgress, RunnerFactory
from training.config import LaunchConfig, TrainConfig

Progress = Callable[[str], None]
OnEpoch = Callable[[dict[str, Any]], None]
"""Called with each finished epoch's entry of training.input_metrics.EpochLog."""


def dask_runners(cluster: ClusterConfig, progress: Progress) -> RunnerFactory:
    """The CLI's runner factory: a Dask cluster as ``cluster`` describes (a LocalCluster, a
    scheduler's or SLURM jobs), started only once a job has work to do, and no LocalCluster
    for a job small enough to finish sooner in this process (decided from its plan)."""
    from preprocessing.cluster import planned_runner

    return lambda: planned_runner(cluster, progress)


class _Tally:
    """Passes progress on, and keeps each pass's task count and how many of its tasks found
    their output already there (an interrupted run's), and what the tasks' processes used."""

    def __init__(self, on_progress: OnProgress) -> None:
        self.on_progress = on_progress
        self.counts: dict[str, dict[str, int]] = {}
        self.usage: dict[str, Any] | None = None

    def __call__(self, state: PassProgress) -> None:
        self.counts[state.pass_name] = {"tasks": state.tasks_total, "reused": state.reused}
        self.on_progress(state)

    def keep_usage(self, usage: dict[str, Any]) -> None:
        self.usage = usage

    def result(self) -> TaskTally:
        return TaskTally(tasks=self.counts, resources=self.usage)


def ingest(
    settings: Settings,
    catalog: Catalog,
    dataset: Dataset,
    request: IngestRequest,
    *,
    runner: RunnerFactory,
    progress: Progress,
    on_progress: OnProgress | None = None,
) -> IngestResult:
    """The dataset's raw files into a raw version: one task per input file on ``runner``."""
    if request.work_dir is None:
        request = replace(request, work_dir=settings.work_dir)
    tally = _Tally(on_progress or (lambda state: progress(state.describe())))
    manifest = dataset.ingest(
        catalog,
        request,
        runner=runner,
        work_root=settings.work_dir,
        progress=progress,
        on_progress=tally,
        on_usage=tally.keep_usage,
    )
    return results.ingest_result(dataset.name, manifest, tally.result())


def preprocess(
    settings: Settings,
    catalog: Catalog,
    dataset: Dataset,
    *,
    options: JobOptions,
    runner: RunnerFactory,
    progress: Progress,
    on_progress: OnProgress | None = None,
) -> PreprocessResult:
    """The latest raw version into a processed version, its tasks on ``runner``."""
    tally = _Tally(on_progress or (lambda state: progress(state.describe())))
    manifest = dataset.preprocess(
        catalog,
        options=options,
        runner=runner,
        work_root=settings.work_dir,
        progress=progress,
        on_progress=tally,
        on_usage=tally.keep_usage,
    )
    return results.preprocess_result(dataset.name, manifest, tally.result())


def with_default_model(dataset: Dataset, config: TrainConfig) -> TrainConfig:
    """``config`` with the dataset's default model where it names none."""
    if config.model is not None:
        return config
    return replace(config, model=dataset.default_model)


class EpochWatch:
    """A progress callback for the training run: passes every line on and, on the line rank 0
    prints once the run folder's per-epoch file holds a new epoch
    (:func:`training.input_metrics.epoch_line`), reads that file and hands each epoch not yet
    seen to ``on_epoch``.

    The launcher calls its progress callback from the loop that waits on horovodrun's output,
    so the file is read there, in this thread, once per epoch and never between: no thread or
    timer of its own, and nothing changes how horovodrun is started or stopped.
    """

    def __init__(self, progress: Progress, on_epoch: OnEpoch) -> None:
        self.progress = progress
        self.on_epoch = on_epoch
        self.seen: set[int] = set()

    def __call__(self, line: str) -> None:
        from training.input_metrics import epoch_log_path, read_epoch_log

        self.progress(line)
        path = epoch_log_path(line)
        if path is None:
            return
        try:
            epochs = read_epoch_log(path)
        except (OSError, ValueError) as exc:
            # On another host's disk, or unreadable: the run goes on; the report comes after.
            self.progress(f"input view: cannot read {path}: {exc}")
            return
        for entry in epochs:
            if entry["epoch"] not in self.seen:
                self.seen.add(entry["epoch"])
                self.on_epoch(entry)


def train(
    settings: Settings,
    catalog: Catalog,
    dataset: Dataset,
    config: TrainConfig,
    launch: LaunchConfig,
    *,
    progress: Progress,
    on_epoch: OnEpoch | None = None,
) -> TrainResult:
    """Train on the latest processed version with horovodrun, as ``launch`` says; commit the
    model.

    ``on_epoch`` receives every rank's input figures after each epoch, while training runs
    (the train flow publishes them as a table artifact); None: only the progress lines.
    """
    from training.launcher import train as train_model

    config = with_default_model(dataset, config)
    manifest, metrics = train_model(
        catalog,
        dataset.name,
        config=config,
        launch=launch,
        runs_dir=settings.runs_dir,
        progress=EpochWatch(progress, on_epoch) if on_epoch is not None else progress,
    )
    result = results.train_result(dataset.name, manifest, metrics)
    if result.run_dir and Path(result.run_dir).is_dir():
        from training.report import REPORT_NAME, write_report

        # The one view of this model version (docs/training.md, "Input view"). A version found
        # committed keeps the report written when it was trained: the version cannot change, and
        # rendering it again cost a nightly run with nothing new a third of its time.
        report = Path(result.run_dir) / REPORT_NAME
        if not report.is_file():
            report = write_report(catalog, manifest.name, manifest.version, None)
        result = replace(result, report=str(report))
        progress(f"report: {report}")
    return result
