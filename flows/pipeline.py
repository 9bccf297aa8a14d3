"""Prefect flows: each stage a flow of its own, and the pipeline flow running all three.

    shardflow-pipeline
      ├─ shardflow-ingest       the driver: a task run per pass ("convert"), its tasks (one
      │                         per input file) run as the CLI runs them (threads, or plain
      │                         Dask tasks); progress, a table per pass,
      │                         a table of the raw version's files
      ├─ shardflow-preprocess   the driver: a task run per pass ("scan", ..., "write"), on
      │                         the `cluster` parameter's Dask cluster (a LocalCluster, or a
      │                         scheduler's); progress, a table per pass, table of shards,
      │                         summary with the Dask dashboard
      └─ shardflow-train        task horovodrun (its output streamed into the flow's logs);
                                the input table per epoch while it runs; table of per-epoch
                                metrics, summary

What the Prefect API records of a run grows with its passes and epochs, never with its tasks
(:mod:`flows.passes`): a terabyte's 57,000 preprocessing tasks are four task runs.

Each stage's flow run starts the same way (:func:`_start`): its settings read once from
``home`` and the environment, one catalog, the dataset's registry entry looked up once; it
hands them to :mod:`flows.stages` with a runner whose passes are task runs. Flows only wire
library calls; the libraries never import Prefect.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest, model_name
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from flows import stages
from flows.logs import route_library_logs
from flows.prefect_runtime import (
    blocks_on_first_use,
    freeze_imports,
    heartbeats_without_join,
    logging_settings_on_demand,
    long_lived_imports,
    parameters_as_json,
    verified_tls_shared,
)
from flows.results import IngestResult, PipelineResult, PreprocessResult, TrainResult
from flows.settings import Settings
from flows.stages import OnEpoch
from preprocessing import datasets
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import Dataset, IngestRequest, SkyServerOptions
from preprocessing.driver import PassProgress
from training.config import LaunchConfig, TrainConfig

# Last, and apart: what imports Prefect (flows.prefect_runtime says why).
with long_lived_imports(), blocks_on_first_use():
    # Before prefect.main, whose import sets Prefect's logging up.
    from flows.prefect_flow import flow

    logging_settings_on_demand()
    from prefect import get_run_logger, task
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.cache_policies import NO_CACHE
    from prefect.runtime import flow_run

    from flows.passes import PassRuns, StageWatch

# Every flow run of this process ends when its function returns, not up to a second later
# (flows.prefect_runtime): set before any flow runs, as a deployment's worker only imports this
# module and calls the flow.
heartbeats_without_join()
# Prefect's API clients share one verified TLS context instead of parsing certifi's bundle each.
verified_tls_shared()

# Set by the CLI's --debug: keep the tracebacks of user errors in the flow logs.
DEBUG_ENV = "SHARDFLOW_DEBUG"


class _UserErrorsWithoutTracebacks(logging.Filter):
    """Bad input is reported in one line: drop the traceback Prefect attaches to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ShardflowError):
            record.exc_info = None
            record.exc_text = None
        return True


def _flow_run_edge(dataset: str, home: str | None) -> tuple[Settings, Dataset]:
    """What every flow does first, once: one-line user errors; the dataset's registry entry
    (an unknown name fails here, in one line); its settings, from ``home`` and the
    environment."""
    from prefect.logging.handlers import PrefectConsoleHandler

    freeze_imports()
    if not os.environ.get(DEBUG_ENV):
        for handler in logging.getLogger().handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _UserErrorsWithoutTracebacks) for f in handler.filters
            ):
                handler.addFilter(_UserErrorsWithoutTracebacks())
    entry = datasets.dataset(dataset)
    settings = Settings.from_env(home=home)
    route_library_logs(settings.home / "logs")
    return settings, entry


def _start(dataset: str, home: str | None) -> tuple[Settings, Catalog, Dataset]:
    """A stage's flow run: :func:`_flow_run_edge`, and its one catalog, which the stage and
    the artifacts share."""
    settings, entry = _flow_run_edge(dataset, home)
    return settings, settings.catalog(), entry


def _found(manifest: Manifest, started: datetime) -> bool:
    """Whether ``manifest``'s version was in the catalog before this flow run ``started``
    (found, not made). Its artifacts were published by the run that committed it: publishing
    them again stores another copy of each for nothing (a nightly run with nothing new)."""
    created = datetime.fromisoformat(manifest.created)
    found = (created if created.tzinfo else created.replace(tzinfo=UTC)) < started
    if found:
        get_run_logger().info(
            f"{manifest.name}@{manifest.version}: artifacts as published by the run that made it"
        )
    return found


def _key(*parts: str) -> str:
    """An artifact key (lowercase letters, digits and dashes only)."""
    return "-".join(parts).lower().replace("_", "-").replace(".", "-")


# --- ingest --------------------------------------------------------------------------------


@parameters_as_json
@flow(name="shardflow-ingest")
def ingest_flow(
    dataset: str,
    home: str | None = None,
    source: str | None = None,
    skyserver: SkyServerOptions | None = None,
    cluster: ClusterConfig | None = None,
) -> dict[str, Any]:
    """Fetch and check the raw files of ``dataset`` into a raw catalog version: a task run per
    pass of the ingest job, its tasks (one per input file) run where `shardflow ingest` runs
    them: in this process or its threads when the plan is small or Arrow-bound, else plain
    Dask tasks on the cluster ``cluster`` describes (default: a LocalCluster of one worker
    per usable core)."""
    started = datetime.now(UTC)
    settings, catalog, entry = _start(dataset, home)
    watch = StageWatch(
        _key(dataset, "ingest"), f"listing {source or dataset}", lambda state: state.fraction
    )
    with _skyserver_slot(entry, source):
        result = stages.ingest(
            settings,
            catalog,
            entry,
            IngestRequest(source=source, skyserver=skyserver or SkyServerOptions()),
            runner=PassRuns(cluster or ClusterConfig(), watch, get_run_logger().info),
            progress=get_run_logger().info,
            on_progress=watch,
        )
    manifest = catalog.get(result.dataset, result.version)
    watch.finish(f"{len(manifest.files)} files, {manifest.rows:,} rows checked")
    if _found(manifest, started):
        return result.to_json()
    create_table_artifact(
        key=_key(dataset, "raw-files"),
        table=[
            {"file": f.path, "rows": f.rows, "bytes": f.bytes, "sha256": f.sha256}
            for f in manifest.files[:TABLE_ROWS]
        ],
        description=f"{dataset}@{manifest.version}: " + _files_shown(manifest, "the fetched files"),
    )
    return result.to_json()


# The global concurrency limit (created by `shardflow deploy`) of which every SkyServer ingest
# holds one slot while it queries: SkyServer is a shared public service, and flow runs on many
# workers must not add their queries up. Each ingest's own queries in flight stay its
# `skyserver.concurrency`.
SKYSERVER_LIMIT = "skyserver"


def _skyserver_slot(entry: Dataset, source: str | None) -> AbstractContextManager[None]:
    """A slot of :data:`SKYSERVER_LIMIT` while an ingest queries SkyServer (sdss without a
    ``source``: preprocessing.datasets' SDSS ingest); nothing for any other ingest.

    Not strict: on a server without the limit (a local run, the test harness, a server
    `shardflow deploy` never set up) Prefect logs "Concurrency limits ['skyserver'] do not
    exist - skipping acquisition." in the flow run and the ingest goes on. Refusing there
    would make every SkyServer ingest depend on a deploy step that only scheduled runs need.
    The slot's lease is renewed while it is held, and released when the ingest ends or fails.
    """
    if entry.name != "sdss" or source is not None:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(SKYSERVER_LIMIT, occupy=1, strict=False)


# A table artifact lists at most this many files: the API stores it and the UI downloads it
# whole, so a version of 57,000 files would make every view of the run slow.
TABLE_ROWS = 100


def _files_shown(manifest: Manifest, what: str) -> str:
    if len(manifest.files) <= TABLE_ROWS:
        return what
    return (
        f"{what}, the first {TABLE_ROWS} of {len(manifest.files):,} "
        f"(all: `shardflow catalog show {manifest.name}@{manifest.version}`)"
    )


# --- preprocess ----------------------------------------------------------------------------


# Where each pass's share of the bar starts and ends: the first pass scans the input; SDSS
# then finds (objid, specobjid) repeated across pieces and rescans the pieces holding them
# (both short); the write pass takes most of the bar.
_PREPROCESS_BAR = {
    "scan": (0.0, 0.1),
    "decode": (0.0, 0.1),
    "matches": (0.1, 0.11),
    "duplicates": (0.11, 0.12),
    "rescan": (0.12, 0.15),
}


def _preprocess_bar(state: PassProgress) -> float:
    start, end = _PREPROCESS_BAR.get(state.pass_name, (0.15, 1.0))
    return start + (end - start) * state.fraction


@parameters_as_json
@flow(name="shardflow-preprocess")
def preprocess_flow(
    dataset: str,
    home: str | None = None,
    cluster: ClusterConfig | None = None,
    options: JobOptions | None = None,
) -> dict[str, Any]:
    """The latest raw version → processed shards: a task run per pass of the job, its tasks
    run where `shardflow preprocess` runs them: a small job in this process, else plain Dask
    tasks on the cluster ``cluster`` describes: a LocalCluster (default: one worker per
    usable core), or the cluster of its ``scheduler`` (tcp://host:8786), whose workers must
    see the catalog at the same path."""
    started = datetime.now(UTC)
    settings, catalog, entry = _start(dataset, home)
    watch = StageWatch(_key(dataset, "preprocess"), "planning", _preprocess_bar)
    runs = PassRuns(cluster or ClusterConfig(), watch, get_run_logger().info)
    result = stages.preprocess(
        settings,
        catalog,
        entry,
        options=options or JobOptions(),
        runner=runs,
        progress=get_run_logger().info,
        on_progress=watch,
    )
    manifest = catalog.get(result.name, result.version)
    watch.finish(f"{manifest.rows:,} rows")
    if not _found(manifest, started):
        _preprocess_artifacts(dataset, manifest, runs.dashboard)
    return result.to_json()


def _preprocess_artifacts(dataset: str, manifest: Manifest, dashboard: str | None) -> None:
    create_table_artifact(
        key=_key(dataset, "shards"),
        table=[
            {"path": f.path, "rows": f.rows, "row_groups": f.row_groups, "bytes": f.bytes}
            for f in manifest.files[:TABLE_ROWS]
        ],
        description=f"{manifest.name}@{manifest.version}: "
        + _files_shown(manifest, "output files"),
    )
    layout = ProcessedLayout.of(manifest)
    create_markdown_artifact(
        key=_key(dataset, "preprocess-summary"),
        markdown=(
            f"## {manifest.name}@{manifest.version}\n\n"
            f"- {manifest.rows:,} rows in {len(manifest.files)} files "
            f"({layout.format}), parent `{manifest.parents[0]}`\n"
            f"- training row groups: {layout.train.num_row_groups} of "
            f"{layout.train.rows_per_group} rows\n"
            + "".join(
                f"- {name}: {split.rows:,} rows\n"
                for name, split in layout.splits.items()
                if name != "train"
            )
            + (f"- quarantined: {layout.quarantine.rows:,} rows\n" if layout.quarantine else "")
            + (
                f"- Dask dashboard: {dashboard}\n"
                if dashboard
                else "- ran in the flow run's process: no Dask cluster was started\n"
            )
            + f"- catalog: `shardflow catalog show {manifest.name}@{manifest.version}`\n"
        ),
    )


# --- train ---------------------------------------------------------------------------------


@task(name="horovodrun", cache_policy=NO_CACHE)
def train_task(
    settings: Settings,
    catalog: Catalog,
    dataset: Dataset,
    config: TrainConfig,
    launch: LaunchConfig,
    on_epoch: OnEpoch,
) -> TrainResult:
    return stages.train(
        settings,
        catalog,
        dataset,
        config,
        launch,
        progress=get_run_logger().info,
        on_epoch=on_epoch,
    )


@parameters_as_json
@flow(name="shardflow-train")
def train_flow(
    dataset: str,
    home: str | None = None,
    config: TrainConfig | None = None,
    launch: LaunchConfig | None = None,
    timeout_seconds: float | None = None,
) -> dict[str, Any]:
    """Train on the latest processed version with horovodrun, where and how ``launch`` says;
    commit the model (the dataset's default model unless ``config`` names one). With
    ``timeout_seconds``, training that runs longer fails, horovodrun and its ranks stopped."""
    started = datetime.now(UTC)
    if timeout_seconds is not None and not timeout_seconds > 0:
        raise ShardflowError(
            f"timeout_seconds {timeout_seconds!r} must be a positive number of seconds"
        )
    settings, catalog, entry = _start(dataset, home)
    config = stages.with_default_model(entry, config or TrainConfig())
    assert config.model is not None  # with_default_model resolves it
    on_epoch = input_by_epoch_table(model_name(entry.name, config.model), get_run_logger().info)
    result = _train_within(
        timeout_seconds, settings, catalog, entry, config, launch or LaunchConfig(), on_epoch
    )
    if not _found(catalog.get(result.model_name, result.version), started):
        _train_artifacts(result)
        _input_artifacts(result)
    return result.to_json()


def _train_within(
    timeout_seconds: float | None,
    settings: Settings,
    catalog: Catalog,
    entry: Dataset,
    config: TrainConfig,
    launch: LaunchConfig,
    on_epoch: OnEpoch,
) -> TrainResult:
    """:func:`train_task` under Prefect's task timeout. In the flow run's main thread (a
    worker's flow run, the CLI) Prefect's timeout is SIGALRM, which interrupts the launcher's
    wait on horovodrun's output at once; the launcher then stops horovodrun and its ranks
    (``training.launcher.run_ranks`` on any exception) before the timeout goes on. In another
    thread Prefect can only raise it there at the next line horovodrun prints."""
    from prefect.task_engine import TaskRunTimeoutError

    try:
        return train_task.with_options(timeout_seconds=timeout_seconds)(
            settings, catalog, entry, config, launch, on_epoch
        )
    except TaskRunTimeoutError as exc:
        raise ShardflowError(
            f"training stopped after its timeout of {timeout_seconds:g} s (timeout_seconds): "
            "horovodrun and its ranks were stopped, no model committed"
        ) from exc


def input_by_epoch_table(model: str, progress: stages.Progress) -> OnEpoch:
    """An epoch hook publishing each epoch's per-rank input table as a new version of the
    table artifact ``<model>-input-by-epoch``, in the flow or task run it is called in."""
    from training.input_metrics import epoch_table

    def publish(entry: dict[str, Any]) -> None:
        try:
            create_table_artifact(
                key=_key(model, "input-by-epoch"),
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


def _input_artifacts(result: TrainResult) -> None:
    """Every rank's input after training, as a table (the train stage wrote the HTML report
    in the run folder)."""
    if not result.input_by_rank:
        return
    flags = (result.input_summary or {}).get("flags", {})
    create_table_artifact(
        key=_key(result.model_name, "input-by-rank"),
        table=[
            {
                "rank": r["rank"],
                "input-bound %": round(100 * r["input_bound"], 1),
                "mean step ms": round(1000 * r["mean_step_seconds"], 2),
                "input ms/batch": round(1000 * r["input_seconds_per_batch"], 2),
                "rows/s": round(r["rows_per_second"]),
                "MB read": round(r["bytes_read"] / 1e6, 1),
                "row groups read": r["row_groups_read"],
                "flags": ", ".join(flags.get(str(r["rank"]), [])),
            }
            for r in result.input_by_rank
        ],
        description=f"{result.model_version}: each rank's input",
    )


def _train_artifacts(result: TrainResult) -> None:
    history = result.history
    create_table_artifact(
        key=_key(result.model_name, "epochs"),
        table=[
            {
                "epoch": epoch + 1 + result.resumed_after_epoch,
                **{name: values[epoch] for name, values in history.items()},
            }
            for epoch in range(len(history.get("loss", [])))
        ],
        description=f"{result.model_version}: per-epoch metrics (rank 0)",
    )
    curves = Path(result.run_dir) / "curves.png" if result.run_dir else None
    if curves is not None and curves.exists():
        # The UI has no image upload; an inline PNG in markdown renders on the artifact page.
        encoded = base64.b64encode(curves.read_bytes()).decode()
        create_markdown_artifact(
            key=_key(result.model_name, "curves"),
            markdown=f"## {result.model_version}: training curves\n\n"
            f"![training curves](data:image/png;base64,{encoded})\n",
            description="per-epoch loss and accuracy from rank 0",
        )
    create_markdown_artifact(
        key=_key(result.model_name, "summary"),
        markdown=(
            f"## {result.model_version}\n\n"
            f"- test accuracy **{result.test_accuracy:.4f}** on {result.test_rows:,} "
            f"held-out rows\n"
            f"- {result.num_ranks} ranks, {result.epochs} epochs, "
            f"{result.samples_per_second:.0f} samples/s\n"
            f"- allreduce payload per rank per epoch: {result.allreduce_bytes_per_epoch:,} "
            f"bytes\n"
            f"- trained on `{result.dataset_version}`; run directory `{result.run_dir}`\n"
            f"- training curves: `{result.run_dir}/curves.png`, TensorBoard logs: "
            f"`tensorboard --logdir {result.run_dir}/tensorboard`\n"
        ),
    )


# --- catalog -------------------------------------------------------------------------------


@parameters_as_json
@flow(name="shardflow-catalog-verify")
def catalog_verify_flow(home: str | None = None) -> dict[str, Any]:
    """Recompute every file digest of the catalog; fails naming each damaged file."""
    catalog = Settings.from_env(home=home).catalog()
    problems = catalog.verify()
    versions = sum(len(catalog.versions(name)) for name in catalog.names())
    create_markdown_artifact(
        key="catalog-verify",
        markdown=f"## catalog verify\n\n{versions} versions checked, {len(problems)} problems\n"
        + "".join(f"- `{p.path}`: {p.reason}\n" for p in problems),
    )
    if problems:
        raise ShardflowError(
            f"{len(problems)} damaged files, e.g. {problems[0].path}: {problems[0].reason}"
        )
    return {"ok": True, "versions": versions}


# --- pipeline ------------------------------------------------------------------------------


@parameters_as_json
@flow(name="shardflow-pipeline")
def pipeline(
    dataset: str,
    home: str | None = None,
    source: str | None = None,
    skyserver: SkyServerOptions | None = None,
    cluster: ClusterConfig | None = None,
    options: JobOptions | None = None,
    train: TrainConfig | None = None,
    launch: LaunchConfig | None = None,
    train_timeout_seconds: float | None = None,
) -> dict[str, Any]:
    """Ingest → preprocess → train, each a flow run of its own under this one, on the same
    ``home`` and Dask ``cluster``; training fails after ``train_timeout_seconds`` if given."""
    # Before any stage's flow run: an unknown dataset or an unusable home fails here. The
    # stages' flow runs get (and record) the same resolved home and cluster.
    settings, _entry = _flow_run_edge(dataset, home)
    home = str(settings.home)
    cluster = cluster or ClusterConfig()
    raw = IngestResult.from_json(
        ingest_flow(dataset=dataset, home=home, source=source, skyserver=skyserver, cluster=cluster)
    )
    processed = PreprocessResult.from_json(
        preprocess_flow(dataset=dataset, home=home, cluster=cluster, options=options)
    )
    trained = TrainResult.from_json(
        train_flow(
            dataset=dataset,
            home=home,
            config=train,
            launch=launch,
            timeout_seconds=train_timeout_seconds,
        )
    )
    return PipelineResult(
        trained=trained,
        raw_version=raw.version,
        processed_version=processed.version,
        rows=raw.rows,
        flow_run_id=str(flow_run.id),
    ).to_json()
