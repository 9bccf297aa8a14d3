"""The three stages as plain calls returning JSON-ready results (:mod:`flows.results`).

The CLI calls these directly; the Prefect flows in ``flows.pipeline`` call the same functions
inside their flow runs, handing preprocessing a runner that makes every task a task run.
Nothing here imports Prefect but :func:`prefect_epoch_table`, and only inside a Prefect run
(where Prefect is loaded already).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flows import results
from flows.settings import Settings
from preprocessing import datasets
from preprocessing.cluster import dask_runner
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import IngestRequest
from preprocessing.driver import OnProgress, PassProgress, RunnerFactory, run_job
from training.config import TrainConfig

Progress = Callable[[str], None]
OnEpoch = Callable[[dict[str, Any]], None]
"""Called with each finished epoch's entry of training.input_metrics.EpochLog."""


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
    manifest = datasets.dataset(dataset).preprocess(
        settings.catalog(),
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


def artifact_key(name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{name}-{what}".lower()).strip("-")


def prefect_epoch_table(model: str, progress: Progress) -> OnEpoch | None:
    """Inside a Prefect flow or task run: a callback publishing each epoch's per-rank input
    table as a new version of the table artifact ``<model>-input-by-epoch``; None elsewhere
    (the CLI, which does not load Prefect)."""
    if "prefect" not in sys.modules:
        return None
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return None
    from training.input_metrics import epoch_table

    def publish(entry: dict[str, Any]) -> None:
        try:
            create_table_artifact(
                key=artifact_key(model, "input-by-epoch"),
                table=epoch_table(entry),
                description=f"{model}: each rank's input in epoch {entry['epoch'] + 1}, and "
                "its rolling window at the epoch's end",
            )
        except Exception as exc:
            # Any API failure: raising here would stop horovodrun (the launcher stops it on any
            # exception from its progress callback), and a view must not stop training. Said,
            # not swallowed; the table after training still comes.
            progress(f"input view: epoch {entry['epoch'] + 1} not published: {exc!r}")

    return publish


def train(
    settings: Settings,
    dataset: str,
    config: TrainConfig,
    *,
    progress: Progress,
    on_epoch: OnEpoch | None = None,
) -> dict[str, Any]:
    """Train on the latest processed version with horovodrun; commit the model.

    ``on_epoch`` receives every rank's input figures after each epoch, while training runs;
    by default, inside a Prefect run, they become a new version of a table artifact per epoch
    (:func:`prefect_epoch_table`).
    """
    from data_catalog import model_name
    from training.launcher import train as train_model

    config = with_default_model(dataset, config)
    assert config.model is not None  # with_default_model resolves it
    if on_epoch is None:
        on_epoch = prefect_epoch_table(model_name(dataset, config.model), progress)
    manifest, metrics = train_model(
        settings.catalog(),
        dataset,
        config=config,
        runs_dir=settings.runs_dir,
        progress=EpochWatch(progress, on_epoch) if on_epoch is not None else progress,
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
