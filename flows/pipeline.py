"""Prefect flows: each stage a flow of its own, and the pipeline flow running all three.

    shardflow-pipeline
      ├─ shardflow-ingest       the driver: a task run per input file on Dask; progress, a
      │                         table of finished tasks, a table of the raw version's files
      ├─ shardflow-preprocess   the driver: every scan and write task a task run on Dask
      │                         (a LocalCluster, or the `scheduler` parameter's cluster);
      │                         progress, table of shards, summary with the Dask dashboard
      └─ shardflow-train        task horovodrun (its output streamed into the flow's logs);
                                table of per-epoch metrics, summary

Flows only wire library calls (through :mod:`flows.stages`); the libraries never import
Prefect.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.artifacts import create_progress_artifact as _create_progress_artifact
from prefect.artifacts import update_progress_artifact as _update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from data_catalog import Manifest
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from flows import stages
from flows.logs import route_library_logs
from flows.settings import Settings
from preprocessing import datasets
from preprocessing.config import DEFAULT_MEMORY_LIMIT, ClusterConfig, JobOptions, usable_cores
from preprocessing.datasets import IngestRequest, SkyServerOptions
from preprocessing.driver import PassProgress, Result, Runner, TaskSpec, dask_runner
from training.config import TrainConfig


# Prefect's artifact functions are "sync compatible": typed as returning a value or a coroutine,
# they return the value when called from a synchronous flow, as every flow here is.
def create_progress_artifact(**kwargs: Any) -> UUID:
    return cast(UUID, _create_progress_artifact(**kwargs))


def update_progress_artifact(artifact_id: UUID, **kwargs: Any) -> None:
    _update_progress_artifact(artifact_id, **kwargs)


# Set by the CLI's --debug: keep the tracebacks of user errors in the flow logs.
DEBUG_ENV = "SHARDFLOW_DEBUG"


class _UserErrorsWithoutTracebacks(logging.Filter):
    """Bad input is reported in one line: drop the traceback Prefect attaches to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ShardflowError):
            record.exc_info = None
            record.exc_text = None
        return True


def _start(dataset: str, home: str | None) -> Settings:
    """What every flow does first: one-line user errors, its settings, a known dataset."""
    from prefect.logging.handlers import PrefectConsoleHandler

    if not os.environ.get(DEBUG_ENV):
        for handler in logging.getLogger().handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _UserErrorsWithoutTracebacks) for f in handler.filters
            ):
                handler.addFilter(_UserErrorsWithoutTracebacks())
    datasets.dataset(dataset)  # an unknown name fails here, in one line
    settings = Settings.from_env(home=home)
    route_library_logs(settings.home / "logs")
    return settings


def _key(*parts: str) -> str:
    """An artifact key (lowercase letters, digits and dashes only)."""
    return "-".join(parts).lower().replace("_", "-").replace(".", "-")


# --- tasks on Dask ------------------------------------------------------------------------


@task(name="stage-task", task_run_name="{key}", cache_policy=NO_CACHE)
def stage_task(key: str, fn: Callable[..., Result], args: tuple[Any, ...]) -> Result:
    """One task of an ingest or preprocessing job (see preprocessing.driver)."""
    return fn(*args)


def submit_task_run(client: Any, spec: TaskSpec, key: str) -> Any:
    """Submit ``spec`` through Prefect's Dask client: a task run of the running flow run."""
    return client.submit(
        stage_task,
        parameters={"key": spec.key, "fn": spec.fn, "args": spec.args},
        key=key,
        pure=False,
    )


class _TaskRuns:
    """The runner of a flow's driver: every task a task run on the Dask cluster ``cluster``
    describes; keeps the cluster's dashboard link for the summary."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.dashboard: str | None = None

    @contextmanager
    def __call__(self) -> Iterator[Runner]:
        from prefect.settings import PREFECT_API_URL
        from prefect_dask.client import PrefectDaskClient

        # Worker processes report their task runs to this flow run's API.
        api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())} if PREFECT_API_URL.value() else {}
        with dask_runner(
            self.cluster,
            get_run_logger().info,
            client_class=PrefectDaskClient,
            submit=submit_task_run,
            env=api,
        ) as runner:
            self.dashboard = str(runner.client.dashboard_link)
            yield runner


class _ProgressArtifacts:
    """A progress artifact and a table of finished tasks, kept up to date as tasks finish
    (the table at most every few seconds: each update is a new version of it in the API)."""

    TABLE_SECONDS = 5.0

    def __init__(self, key: str, description: str, bar: Callable[[PassProgress], float]) -> None:
        self.key = key
        self.bar = bar
        self.artifact = create_progress_artifact(
            progress=0.0, key=f"{key}-progress", description=description
        )
        self.rows: list[dict[str, Any]] = []
        self.last_table = 0.0

    def __call__(self, state: PassProgress) -> None:
        get_run_logger().info(state.describe())
        update_progress_artifact(
            self.artifact, progress=100.0 * self.bar(state), description=state.describe()
        )
        result = state.result or {}
        self.rows.append(
            {
                "task": state.task_key,
                "rows": result.get("rows"),
                "bytes": (result.get("input") or {}).get("bytes", result.get("bytes")),
                "reused": bool(result.get("reused")),
                "seconds": round(state.seconds, 1),
            }
        )
        done = state.tasks_done == state.tasks_total
        if done or time.monotonic() - self.last_table > self.TABLE_SECONDS:
            self.last_table = time.monotonic()
            create_table_artifact(
                key=f"{self.key}-tasks",
                table=self.rows,
                description=f"{state.pass_name}: {state.describe()}",
            )

    def finish(self, description: str) -> None:
        update_progress_artifact(self.artifact, progress=100.0, description=description)


def _cluster(workers: int | None, scheduler: str | None, memory_limit: str) -> ClusterConfig:
    return ClusterConfig(
        workers=workers or usable_cores(), scheduler=scheduler, memory_limit=memory_limit
    )


# --- ingest --------------------------------------------------------------------------------


@flow(name="shardflow-ingest")
def ingest_flow(
    dataset: str,
    home: str | None = None,
    source: str | None = None,
    skyserver: SkyServerOptions | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
) -> dict[str, Any]:
    """Fetch and check the raw files of ``dataset`` into a raw catalog version: one task run
    per input file on Dask (a LocalCluster of ``workers``, or ``scheduler``'s cluster)."""
    settings = _start(dataset, home)
    cluster = _cluster(workers, scheduler, memory_limit)
    runs = _TaskRuns(cluster)
    artifacts = _ProgressArtifacts(
        _key(dataset, "ingest"), f"listing {source or dataset}", lambda state: state.fraction
    )
    result = stages.ingest(
        settings,
        dataset,
        IngestRequest(source=source, skyserver=skyserver or SkyServerOptions()),
        cluster=cluster,
        progress=get_run_logger().info,
        runner=runs,
        on_progress=artifacts,
    )
    manifest = settings.catalog().get(dataset, result["version"])
    artifacts.finish(f"{len(manifest.files)} files, {manifest.rows:,} rows checked")
    create_table_artifact(
        key=_key(dataset, "raw-files"),
        table=[
            {"file": f.path, "rows": f.rows, "bytes": f.bytes, "sha256": f.sha256}
            for f in manifest.files
        ],
        description=f"{dataset}@{manifest.version}: the fetched files",
    )
    return result


# --- preprocess ----------------------------------------------------------------------------


# Where each pass's share of the bar starts and ends: the first pass scans the input; SDSS
# then finds (objid, specobjid) repeated across pieces and rescans the pieces holding them
# (both short); the write pass takes most of the bar.
_PREPROCESS_BAR = {
    "scan": (0.0, 0.1),
    "decode": (0.0, 0.1),
    "duplicates": (0.1, 0.12),
    "rescan": (0.12, 0.15),
}


def _preprocess_bar(state: PassProgress) -> float:
    start, end = _PREPROCESS_BAR.get(state.pass_name, (0.15, 1.0))
    return start + (end - start) * state.fraction


@flow(name="shardflow-preprocess")
def preprocess_flow(
    dataset: str,
    home: str | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    options: JobOptions | None = None,
) -> dict[str, Any]:
    """The latest raw version → processed shards, every task a task run on Dask: a
    LocalCluster of ``workers`` processes, or the cluster of ``scheduler``
    (tcp://host:8786), whose workers must see the catalog at the same path."""
    settings = _start(dataset, home)
    cluster = _cluster(workers, scheduler, memory_limit)
    runs = _TaskRuns(cluster)
    artifacts = _ProgressArtifacts(_key(dataset, "preprocess"), "planning", _preprocess_bar)
    result = stages.preprocess(
        settings,
        dataset,
        options=options or JobOptions(),
        cluster=cluster,
        progress=get_run_logger().info,
        runner=runs,
        on_progress=artifacts,
    )
    manifest = settings.catalog().get(result["name"], result["version"])
    artifacts.finish(f"{manifest.rows:,} rows")
    _preprocess_artifacts(dataset, manifest, runs.dashboard)
    return result


def _preprocess_artifacts(dataset: str, manifest: Manifest, dashboard: str | None) -> None:
    create_table_artifact(
        key=_key(dataset, "shards"),
        table=[
            {"path": f.path, "rows": f.rows, "row_groups": f.row_groups, "bytes": f.bytes}
            for f in manifest.files
        ],
        description=f"{manifest.name}@{manifest.version}: output files",
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
            + (f"- Dask dashboard: {dashboard}\n" if dashboard else "- already in the catalog\n")
            + f"- catalog: `shardflow catalog show {manifest.name}@{manifest.version}`\n"
        ),
    )


# --- train ---------------------------------------------------------------------------------


@task(name="horovodrun")
def train_task(settings: Settings, dataset: str, config: TrainConfig) -> dict[str, Any]:
    return stages.train(settings, dataset, config, progress=get_run_logger().info)


@flow(name="shardflow-train")
def train_flow(
    dataset: str, home: str | None = None, config: TrainConfig | None = None
) -> dict[str, Any]:
    """Train on the latest processed version with horovodrun; commit the model (the
    dataset's default model unless ``config`` names one)."""
    settings = _start(dataset, home)
    result = train_task(settings, dataset, config or TrainConfig())
    _train_artifacts(result)
    _input_artifacts(settings, result)
    return result


def _input_artifacts(settings: Settings, result: dict[str, Any]) -> None:
    """Every rank's input after training, as a table (the train stage wrote the HTML report
    in the run folder)."""
    input_by_rank = result.get("input_by_rank")
    if not input_by_rank:
        return
    flags = (result.get("input_summary") or {}).get("flags", {})
    create_table_artifact(
        key=_key(result["model_name"], "input-by-rank"),
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
            for r in input_by_rank
        ],
        description=f"{result['model_name']}@{result['version']}: each rank's input",
    )


def _train_artifacts(result: dict[str, Any]) -> None:
    history = result["history"]
    create_table_artifact(
        key=_key(result["model_name"], "epochs"),
        table=[
            {
                "epoch": epoch + 1 + result["resumed_after_epoch"],
                **{name: values[epoch] for name, values in history.items()},
            }
            for epoch in range(len(history.get("loss", [])))
        ],
        description=f"{result['model_name']}@{result['version']}: per-epoch metrics (rank 0)",
    )
    curves = Path(result["run_dir"]) / "curves.png"
    if curves.exists():
        # The UI has no image upload; an inline PNG in markdown renders on the artifact page.
        encoded = base64.b64encode(curves.read_bytes()).decode()
        create_markdown_artifact(
            key=_key(result["model_name"], "curves"),
            markdown=f"## {result['model_name']}@{result['version']}: training curves\n\n"
            f"![training curves](data:image/png;base64,{encoded})\n",
            description="per-epoch loss and accuracy from rank 0",
        )
    create_markdown_artifact(
        key=_key(result["model_name"], "summary"),
        markdown=(
            f"## {result['model_name']}@{result['version']}\n\n"
            f"- test accuracy **{result['test_accuracy']:.4f}** on {result['test_rows']:,} "
            f"held-out rows\n"
            f"- {result['num_ranks']} ranks, {result['epochs']} epochs, "
            f"{result['samples_per_second']:.0f} samples/s\n"
            f"- allreduce payload per rank per epoch: {result['allreduce_bytes_per_epoch']:,} "
            f"bytes\n"
            f"- trained on `{result['dataset_version']}`; run directory `{result['run_dir']}`\n"
            f"- training curves: `{result['run_dir']}/curves.png`, TensorBoard logs: "
            f"`tensorboard --logdir {result['run_dir']}/tensorboard`\n"
        ),
    )


# --- catalog -------------------------------------------------------------------------------


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


@flow(name="shardflow-pipeline")
def pipeline(
    dataset: str,
    home: str | None = None,
    source: str | None = None,
    skyserver: SkyServerOptions | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    options: JobOptions | None = None,
    train: TrainConfig | None = None,
) -> dict[str, Any]:
    """Ingest → preprocess → train, each a flow run of its own under this one."""
    settings = _start(dataset, home)
    home = str(settings.home)
    raw = ingest_flow(
        dataset=dataset,
        home=home,
        source=source,
        skyserver=skyserver,
        workers=workers,
        scheduler=scheduler,
        memory_limit=memory_limit,
    )
    processed = preprocess_flow(
        dataset=dataset,
        home=home,
        workers=workers,
        scheduler=scheduler,
        memory_limit=memory_limit,
        options=options,
    )
    trained = train_flow(dataset=dataset, home=home, config=train)
    return {
        **trained,
        "raw_version": raw["version"],
        "processed_version": processed["version"],
        "rows": raw["rows"],
        "flow_run_id": str(flow_run.id),
    }
