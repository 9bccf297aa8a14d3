"""Prefect flows: each stage a flow of its own, and the pipeline flow running all three.

    shardflow-pipeline
      ├─ shardflow-ingest       task fetch-and-check; progress + table of fetched files
      ├─ shardflow-preprocess   scan tasks, then one write task per shard, on a DaskTaskRunner;
      │                         progress, table of shards, summary with the Dask dashboard
      └─ shardflow-train        task horovodrun (its output streamed into the flow's logs);
                                table of per-epoch metrics, summary

Flows only wire library calls; the libraries never import Prefect.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.artifacts import create_progress_artifact as _create_progress_artifact
from prefect.artifacts import update_progress_artifact as _update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import TaskRunner
from prefect_dask.task_runners import DaskTaskRunner

from data_catalog import Catalog
from data_catalog.errors import ShardflowError
from flows import stages
from preprocessing.engine import (
    DEFAULT_MEMORY_LIMIT,
    ClusterConfig,
    JobOptions,
    Result,
    TaskSpec,
    job_dir,
    usable_cores,
)
from preprocessing.jobs import plan as plan_preprocessing
from preprocessing.sources.sdss import SkyServerOptions
from training.launcher import TrainConfig
from training.launcher import train as train_model


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


def _hide_user_error_tracebacks() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    if os.environ.get(DEBUG_ENV):
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _UserErrorsWithoutTracebacks) for f in handler.filters
        ):
            handler.addFilter(_UserErrorsWithoutTracebacks())


DEFAULT_HOME = "~/.shardflow"


def resolve_home(home: str | None) -> str:
    """The flow's ``home`` parameter, else $SHARDFLOW_HOME of the process running the flow
    (a deployment's worker), else ~/.shardflow."""
    chosen = home or os.environ.get("SHARDFLOW_HOME") or DEFAULT_HOME
    return str(Path(chosen).expanduser().resolve())


def _catalog(home: str) -> Catalog:
    location = os.environ.get("SHARDFLOW_CATALOG") or Path(home) / "catalog"
    return Catalog(location, index_url=os.environ.get("SHARDFLOW_CATALOG_URL"))


def _key(*parts: str) -> str:
    """An artifact key (lowercase letters, digits and dashes only)."""
    return "-".join(parts).lower().replace("_", "-").replace(".", "-")


# --- ingest --------------------------------------------------------------------------------


@task(name="fetch-and-check")
def ingest_task(
    home: str,
    dataset: str,
    source: str | None,
    artifact: UUID,
    skyserver: SkyServerOptions | None = None,
) -> dict[str, Any]:
    logger = get_run_logger()
    done: list[dict[str, Any]] = []

    def on_file(fetched: dict[str, Any]) -> None:
        done.append(fetched)
        fetched_bytes = sum(int(f["bytes"]) for f in done)
        # Four files, then the checks: the last fifth of the bar is the validation.
        update_progress_artifact(
            artifact,
            progress=80.0 * len(done) / 4,
            description=f"{len(done)}/4 files fetched, {fetched_bytes:,} bytes",
        )

    return stages.ingest(
        _catalog(home),
        dataset,
        source=source,
        progress=logger.info,
        on_file=on_file,
        work_dir=Path(home) / "work",
        skyserver=skyserver,
    )


@flow(name="shardflow-ingest")
def ingest_flow(
    dataset: str,
    home: str | None = None,
    source: str | None = None,
    skyserver: SkyServerOptions | None = None,
) -> dict[str, Any]:
    """Fetch and check the raw files of ``dataset`` into a raw catalog version."""
    _hide_user_error_tracebacks()
    home = resolve_home(home)
    artifact = create_progress_artifact(
        progress=0.0, key=_key(dataset, "ingest-progress"), description=f"fetching {dataset}"
    )
    result = ingest_task(home, dataset, source, artifact, skyserver)
    manifest = _catalog(home).get(dataset, result["version"])
    update_progress_artifact(
        artifact,
        progress=100.0,
        description=f"{len(manifest.files)} files, {manifest.rows:,} rows checked",
    )
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


@task(name="preprocess-task", task_run_name="{key}", cache_policy=NO_CACHE)
def preprocess_task(key: str, fn: Callable[..., Result], args: tuple[Any, ...]) -> Result:
    """One scan or write task of a preprocessing job (see preprocessing.engine)."""
    return fn(*args)


def _dask_runner(cluster: ClusterConfig) -> TaskRunner[Any]:
    # Typed as the base class: flows declare TaskRunner[PrefectFuture[Any]], and a TaskRunner
    # of PrefectDaskFuture is not one to mypy (the type parameter is invariant).
    if cluster.scheduler is not None:
        runner = DaskTaskRunner(address=cluster.scheduler)
    else:
        runner = DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={
                "n_workers": cluster.workers,
                "threads_per_worker": 1,
                "processes": True,
                "memory_limit": cluster.memory_limit,
                "dashboard_address": "127.0.0.1:0",
            },
        )
    return cast(TaskRunner[Any], runner)


def _run_in_window(
    specs: Sequence[TaskSpec], workers: int, on_done: Callable[[int, int], None]
) -> list[Result]:
    """Submit ``specs`` as task runs, a bounded window in flight; results in spec order."""
    results: list[Result | None] = [None] * len(specs)
    size = 2 * max(workers, 1)
    done = 0
    for first in range(0, len(specs), size):
        futures = {
            preprocess_task.submit(spec.key, spec.fn, spec.args): first + offset
            for offset, spec in enumerate(specs[first : first + size])
        }
        for future in as_completed(list(futures)):
            number = futures[future]
            results[number] = future.result()
            done += 1
            on_done(done, specs[number].rows)
    return [r for r in results if r is not None]


@flow(name="shardflow-preprocess", task_runner=_dask_runner(ClusterConfig()))
def preprocess_flow(
    dataset: str,
    home: str | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    options: JobOptions | None = None,
) -> dict[str, Any]:
    """The latest raw version → processed shards: scan and write task runs on Dask."""
    _hide_user_error_tracebacks()
    home = resolve_home(home)
    workers = workers or usable_cores()
    logger = get_run_logger()
    catalog = _catalog(home)
    job = plan_preprocessing(catalog, dataset, options or JobOptions())
    if catalog.exists(job.name, job.version):
        logger.info("%s@%s already in the catalog; nothing to do", job.name, job.version)
        return stages.preprocess_result(dataset, catalog.get(job.name, job.version))

    context = FlowRunContext.get()
    runner = context.task_runner if context else None
    dashboard = getattr(getattr(runner, "client", None), "dashboard_link", None)
    logger.info("Dask dashboard: %s", dashboard)
    # Files go to the job's own folder: a rerun after a crash keeps the finished ones.
    work = job_dir(Path(home) / "work", job)
    work.mkdir(parents=True, exist_ok=True)
    artifact = create_progress_artifact(
        progress=0.0, key=_key(dataset, "preprocess-progress"), description="scanning the input"
    )
    scan_specs = job.scan_tasks(work)
    scans = _run_in_window(
        scan_specs,
        workers,
        lambda done, _rows: update_progress_artifact(
            artifact,
            progress=10.0 * done / len(scan_specs),
            description=f"scan: {done}/{len(scan_specs)} input pieces",
        ),
    )
    write_specs = job.write_tasks(scans, work)
    total_rows = sum(s.rows for s in write_specs)
    rows_done = [0]

    def on_written(done: int, rows: int) -> None:
        rows_done[0] += rows
        update_progress_artifact(
            artifact,
            progress=10.0 + 90.0 * done / len(write_specs),
            description=f"{done}/{len(write_specs)} shards, {rows_done[0]:,}/{total_rows:,} rows",
        )

    written = _run_in_window(write_specs, workers, on_written)
    with catalog.stage(job.name, kind="processed") as stage:
        manifest = job.commit(stage, scans, written, work)
    shutil.rmtree(work, ignore_errors=True)
    create_table_artifact(
        key=_key(dataset, "shards"),
        table=[
            {"path": f.path, "rows": f.rows, "row_groups": f.row_groups, "bytes": f.bytes}
            for f in manifest.files
        ],
        description=f"{manifest.name}@{manifest.version}: output files",
    )
    create_markdown_artifact(
        key=_key(dataset, "preprocess-summary"),
        markdown=(
            f"## {manifest.name}@{manifest.version}\n\n"
            f"- {manifest.rows:,} rows in {len(manifest.files)} files "
            f"({manifest.schema.get('format', 'parquet')}), parent `{manifest.parents[0]}`\n"
            f"- training row groups: {manifest.statistics['train']['num_row_groups']} of "
            f"{manifest.statistics['train']['rows_per_group']} rows\n"
            + "".join(
                f"- {split}: {manifest.statistics[split]['rows']:,} rows\n"
                for split in ("validation", "test")
                if split in manifest.statistics
            )
            + (
                f"- quarantined: {manifest.statistics['quarantine']['rows']:,} rows\n"
                if "quarantine" in manifest.statistics
                else ""
            )
            + f"- Dask dashboard: {dashboard}\n"
            f"- catalog: `shardflow catalog show {manifest.name}@{manifest.version}`\n"
        ),
    )
    return stages.preprocess_result(dataset, manifest)


def _share_api_with_dask_workers() -> None:
    """Point Dask worker processes at this process's Prefect API.

    Without a configured server Prefect runs a temporary one for this process only; worker
    processes that inherit no PREFECT_API_URL would each start their own, and the shard task
    runs would be recorded there instead of in this flow run.
    """
    if os.environ.get("PREFECT_API_URL"):
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        os.environ["PREFECT_API_URL"] = str(client.api_url)


def run_preprocess_flow(
    dataset: str,
    home: str,
    workers: int | None,
    scheduler: str | None,
    options: JobOptions,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
) -> dict[str, Any]:
    """The preprocess flow on a Dask cluster of the asked shape."""
    _share_api_with_dask_workers()
    cluster = ClusterConfig(
        workers=workers or usable_cores(), scheduler=scheduler, memory_limit=memory_limit
    )
    runner = _dask_runner(cluster)
    result: dict[str, Any] = preprocess_flow.with_options(task_runner=runner)(
        dataset=dataset,
        home=home,
        workers=cluster.workers,
        scheduler=scheduler,
        options=options,
    )
    return result


# --- train ---------------------------------------------------------------------------------


@task(name="horovodrun")
def train_task(home: str, dataset: str, config: TrainConfig) -> dict[str, Any]:
    catalog = _catalog(home)
    manifest, metrics = train_model(
        catalog,
        dataset,
        config=config,
        runs_dir=Path(home) / "runs",
        progress=get_run_logger().info,
    )
    return stages.train_result(dataset, manifest, metrics)


@flow(name="shardflow-train")
def train_flow(
    dataset: str, home: str | None = None, config: TrainConfig | None = None
) -> dict[str, Any]:
    """Train on the latest processed version with horovodrun; commit the model."""
    _hide_user_error_tracebacks()
    home = resolve_home(home)
    result = train_task(home, dataset, config or TrainConfig())
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
    return result


# --- catalog -------------------------------------------------------------------------------


@flow(name="shardflow-catalog-verify")
def catalog_verify_flow(home: str | None = None) -> dict[str, Any]:
    """Recompute every file digest of the catalog; fails naming each damaged file."""
    _hide_user_error_tracebacks()
    catalog = _catalog(resolve_home(home))
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
    options: JobOptions | None = None,
    train: TrainConfig | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
) -> dict[str, Any]:
    """Ingest → preprocess → train, each a flow run of its own under this one."""
    _hide_user_error_tracebacks()
    home = resolve_home(home)
    raw = ingest_flow(dataset=dataset, home=home, source=source, skyserver=skyserver)
    processed = run_preprocess_flow(
        dataset, home, workers, scheduler, options or JobOptions(), memory_limit
    )
    trained = train_flow(dataset=dataset, home=home, config=train)
    return {
        **trained,
        "raw_version": raw["version"],
        "processed_version": processed["version"],
        "rows": raw["rows"],
        "flow_run_id": str(flow_run.id),
    }
