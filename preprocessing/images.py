"""Raw IDX image versions → Parquet shards with equal row groups, one Dask task per shard.

raw version (4 IDX files)
    │  plan (pure): splits → shards → equal row groups
    ▼
Dask cluster: one task per shard, a bounded window in flight
    │  each task reads only its records (seek, or a streamed gunzip) and writes
    │  <staging>/<split>/part-NNNNN.parquet
    ▼
processed version "<dataset>-processed" (parent: the raw version)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest, ParentRef, Staging, code_version, version_id
from data_catalog.errors import ShardflowError
from preprocessing import schemas
from preprocessing.plan import (
    PlanConfig,
    Shard,
    SplitPlan,
    plan_evaluation_split,
    plan_training_split,
)
from preprocessing.sources import idx

Progress = Callable[[str], None]

# Bumped when the bytes this module writes change for the same input and parameters.
WRITER_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the Dask work runs."""

    workers: int = 2
    """Worker processes of the LocalCluster (one thread each); ignored with ``scheduler``."""
    scheduler: str | None = None
    """Address of an existing Dask scheduler (tcp://host:8786); its workers must see the
    catalog's directory at the same path."""
    memory_limit: str = "2GiB"
    """Per-worker memory limit of the LocalCluster."""
    work_dir: Path | None = None
    """Where shards are written before the commit, one folder per job: a rerun of an
    interrupted job keeps its finished shards. None writes straight into catalog staging."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ShardflowError(f"--workers must be at least 1, got {self.workers}")


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    plan: PlanConfig = field(default_factory=PlanConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def processed_name(dataset: str) -> str:
    return f"{dataset}-processed"


def finished_shard(shard: Shard, out_dir: str) -> dict[str, Any] | None:
    """The result of a shard an earlier, interrupted run already wrote whole, if any."""
    path = Path(out_dir) / shard.path
    try:
        metadata = pq.read_metadata(path)
    except (OSError, pa.ArrowInvalid):
        return None
    if metadata.num_rows != shard.rows or metadata.num_row_groups != shard.num_row_groups:
        return None
    return {"path": shard.path, "rows": shard.rows, "bytes": path.stat().st_size, "reused": True}


def write_shard(images: str, labels: str, shard: Shard, out_dir: str) -> dict[str, Any]:
    """Dask task: write one shard's rows as Parquet with row groups of equal size, unless a
    run of the same job already wrote it whole."""
    finished = finished_shard(shard, out_dir)
    if finished is not None:
        return finished
    pixels = idx.read_records(images, shard.start, shard.rows)
    targets = idx.read_records(labels, shard.start, shard.rows)
    flat = pixels.reshape(shard.rows, -1)
    item = flat.shape[1]
    # One contiguous buffer + offsets: the binary column without a Python object per image.
    offsets = pa.array(range(0, (shard.rows + 1) * item, item), type=pa.int32())
    image_column = pa.BinaryArray.from_buffers(
        pa.binary(), shard.rows, [None, offsets.buffers()[1], pa.py_buffer(flat.tobytes())]
    )
    table = pa.Table.from_arrays(
        [
            pa.array(range(shard.start, shard.start + shard.rows), type=pa.int64()),
            image_column,
            pa.array(targets.astype("int64")),
        ],
        schema=schemas.IMAGE_SCHEMA,
    )
    path = Path(out_dir) / shard.path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial, row_group_size=shard.rows_per_group)
    os.replace(partial, path)  # a shard is whole or absent
    return {"path": shard.path, "rows": shard.rows, "bytes": path.stat().st_size}


@contextmanager
def dask_client(config: ClusterConfig, progress: Progress) -> Iterator[Any]:
    """A Dask client on an existing scheduler or on a fresh LocalCluster."""
    from distributed import Client, LocalCluster

    if config.scheduler is not None:
        try:
            client = Client(config.scheduler, timeout="10s")
        except OSError as exc:
            raise ShardflowError(f"cannot reach Dask scheduler {config.scheduler}: {exc}") from exc
        with client:
            progress(f"dask: using scheduler {config.scheduler}, dashboard {client.dashboard_link}")
            yield client
        return
    with (
        LocalCluster(
            n_workers=config.workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=config.memory_limit,
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        progress(
            f"dask: LocalCluster with {config.workers} workers, dashboard {client.dashboard_link}"
        )
        yield client


@dataclass(frozen=True, kw_only=True)
class ImageJob:
    """A planned preprocessing run: the shards to write and the version they will become."""

    raw: Manifest
    name: str
    version: str
    parents: tuple[ParentRef, ...]
    parameters: dict[str, Any]
    plans: tuple[SplitPlan, ...]
    images: dict[str, str]
    """Raw images file of each split."""
    labels: dict[str, str]

    @property
    def shards(self) -> list[Shard]:
        return [shard for plan in self.plans for shard in plan.shards]

    @property
    def rows(self) -> int:
        return sum(plan.rows for plan in self.plans)

    def write(self, shard: Shard, out_dir: str) -> dict[str, Any]:
        """Write one shard (locally; Dask tasks call :func:`write_shard` with the same args)."""
        return write_shard(self.images[shard.split], self.labels[shard.split], shard, out_dir)


def plan_job(catalog: Catalog, dataset: str, plan: PlanConfig) -> ImageJob:
    """Plan the processing of the latest raw version of ``dataset`` (reads manifests only)."""
    if not catalog.is_local:
        raise ShardflowError(
            f"preprocessing reads raw files by path: the catalog {catalog.url} is not on a local "
            "or mounted filesystem (object-store catalogs take ingest and catalog commands)"
        )
    raw = catalog.get(dataset)
    if raw.kind != "raw":
        raise ShardflowError(f"{dataset}@{raw.version} is {raw.kind}, expected a raw version")
    files = raw.schema["files"]
    path_of = {e.path: catalog.file_path(raw, e) for e in raw.files}
    name = processed_name(dataset)
    parents = (raw.ref,)
    parameters = {"plan": asdict(plan), "writer_version": WRITER_VERSION}
    return ImageJob(
        raw=raw,
        name=name,
        version=version_id(
            name=name,
            kind="processed",
            parents=parents,
            sources=(),
            parameters=parameters,
            code_version=code_version(),
        ),
        parents=parents,
        parameters=parameters,
        plans=(
            plan_training_split("train", int(raw.statistics["train_rows"]), plan),
            plan_evaluation_split("test", int(raw.statistics["test_rows"]), plan),
        ),
        images={
            "train": str(path_of[files["train-images-idx3-ubyte"]]),
            "test": str(path_of[files["t10k-images-idx3-ubyte"]]),
        },
        labels={
            "train": str(path_of[files["train-labels-idx1-ubyte"]]),
            "test": str(path_of[files["t10k-labels-idx1-ubyte"]]),
        },
    )


def job_dir(work_dir: Path, job: ImageJob) -> Path:
    """The folder of ``job``'s shards before the commit (same job, same folder)."""
    return work_dir / f"{job.name}-{job.version}"


def commit_job(
    job: ImageJob, stage: Staging, written: list[dict[str, Any]], shards_dir: Path
) -> Manifest:
    """Commit the shards written into ``shards_dir`` as the job's processed version."""
    expected = {shard.path for shard in job.shards}
    missing = expected - {str(r["path"]) for r in written}
    if missing:
        raise ShardflowError(f"{len(missing)} shards were not written, e.g. {min(missing)}")
    if shards_dir != stage.path:
        for shard_path in sorted(expected):
            stage.adopt(shards_dir / shard_path, shard_path)
    raw = job.raw
    manifest = stage.commit(
        parents=job.parents,
        parameters=job.parameters,
        schema={
            "format": "parquet",
            "arrow_schema": schemas.IMAGE_SCHEMA.to_string(),
            "columns": list(schemas.IMAGE_COLUMNS),
            "image_shape": raw.schema["image_shape"],
            "num_classes": raw.schema["num_classes"],
            "class_names": raw.schema["class_names"],
            "splits": {p.split: p.split for p in job.plans},
        },
        statistics={
            p.split: {
                "rows": p.rows,
                "source_rows": p.source_rows,
                "dropped_rows": p.dropped_rows,
                "rows_per_group": p.rows_per_group,
                "num_row_groups": p.num_row_groups,
                "num_shards": len(p.shards),
                "policy": "drop" if p.split == "train" else "whole",
            }
            for p in job.plans
        },
        rows=sum(int(r["rows"]) for r in written),
    )
    if shards_dir != stage.path:
        shutil.rmtree(shards_dir, ignore_errors=True)
    return manifest


def run_shards(
    client: Any,
    job: ImageJob,
    out_dir: Path,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Submit one task per shard, at most two per worker in flight, so that memory does not
    grow with the number of shards."""
    from distributed import as_completed

    shards = job.shards
    window = max(2, 2 * len(client.scheduler_info().get("workers", {})))
    pending = iter(shards)
    futures = as_completed()

    def submit(shard: Shard) -> None:
        futures.add(
            client.submit(
                write_shard,
                job.images[shard.split],
                job.labels[shard.split],
                shard,
                str(out_dir),
                key=f"write-shard-{job.version}-{shard.split}-{shard.index:05d}-{os.getpid()}",
                pure=False,
            )
        )

    for shard in [s for _, s in zip(range(window), pending, strict=False)]:
        submit(shard)
    results = []
    rows_done = 0
    for future in futures:
        result = future.result()
        results.append(result)
        rows_done += result["rows"]
        progress(
            f"preprocess: {len(results)}/{len(shards)} shards, {rows_done:,}/{job.rows:,} rows"
        )
        following = next(pending, None)
        if following is not None:
            submit(following)
    return sorted(results, key=lambda r: str(r["path"]))


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
    job = plan_job(catalog, dataset, config.plan)
    if catalog.exists(job.name, job.version):
        progress(f"{job.name}@{job.version} already in the catalog; nothing to do")
        return catalog.get(job.name, job.version)
    with (
        catalog.stage(job.name, kind="processed") as stage,
        dask_client(config.cluster, progress) as client,
    ):
        work = config.cluster.work_dir
        shards_dir = job_dir(work, job) if work is not None else stage.path
        shards_dir.mkdir(parents=True, exist_ok=True)
        written = run_shards(client, job, shards_dir, progress)
        reused = sum(1 for r in written if r.get("reused"))
        if reused:
            progress(f"preprocess: {reused} shards kept from an interrupted run")
        return commit_job(job, stage, written, shards_dir)
