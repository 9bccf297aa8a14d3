"""The Dask side of preprocessing, for every kind of dataset.

A preprocessing *job* runs in two distributed passes and a commit:

    scan tasks   one per input piece: decode, count, check   -> small result dicts
        │  (the job plans its output shards from the scan results: a pure function)
    write tasks  one per output shard, whole-or-absent files  -> small result dicts
        │
    commit       the job turns the written files and the results (row counts, partial
                 statistics) into one catalog version

Tasks are plain functions of plain arguments, submitted in a bounded window so that memory
does not grow with the number of shards. The CLI drives them with :func:`run_job`; the Prefect
flow submits the same :class:`TaskSpec` s as task runs. Nothing here imports Prefect.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from data_catalog import Manifest, Staging
from data_catalog.errors import ShardflowError
from preprocessing.plan import PlanConfig

Progress = Callable[[str], None]
Result = dict[str, Any]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset
    narrow), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Per LocalCluster worker: a shard task needs a few hundred MiB (docs/preprocessing.md).
DEFAULT_MEMORY_LIMIT = "2GiB"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the Dask work runs."""

    workers: int = field(default_factory=usable_cores)
    """Worker processes of the LocalCluster (one thread each; default: one per usable core);
    ignored with ``scheduler``."""
    scheduler: str | None = None
    """Address of an existing Dask scheduler (tcp://host:8786); its workers must see the
    catalog's directory at the same path."""
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    """Per-worker memory limit of the LocalCluster, in Dask's notation ("2GiB", "500MB")."""
    work_dir: Path | None = None
    """Where a job keeps its intermediate files and shards before the commit, one folder per
    job: a rerun of an interrupted job keeps what it finished. None: a folder in staging."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ShardflowError(f"--workers must be at least 1, got {self.workers}")
        from dask.utils import parse_bytes

        try:
            limit = parse_bytes(self.memory_limit)
        except (ValueError, TypeError):
            limit = 0
        if limit < 512 * 2**20:
            raise ShardflowError(
                f"--memory-limit {self.memory_limit!r}: give a size of at least 512MiB per "
                "worker, such as 2GiB or 1500MB"
            )


FORMATS = ("parquet", "petastorm")


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What a user chooses about the output (all part of the version's identity)."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    format: str | None = None
    """"parquet" (read with petastorm's make_batch_reader) or "petastorm" (a Unischema
    dataset read with make_reader); None: the dataset's default."""
    validation_fraction: float | None = None
    """Share of the training source hashed into the validation split; None: the dataset's
    default."""
    test_fraction: float | None = None
    """Share hashed into the test split, for sources without an official test split."""

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ShardflowError(f"unknown format {self.format!r}; known: {', '.join(FORMATS)}")
        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ShardflowError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One Dask task: ``fn(*args)`` returns a small, picklable result dict."""

    key: str
    """Unique in its job, e.g. "write-train-00003"; also the Prefect task-run name."""
    fn: Callable[..., Result]
    args: tuple[Any, ...]
    rows: int = 0
    """Rows the task handles (for progress)."""


class Job(Protocol):
    """A planned preprocessing run of one raw version (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def scan_tasks(self, work: Path) -> Sequence[TaskSpec]: ...

    def write_tasks(self, scans: Sequence[Result], work: Path) -> Sequence[TaskSpec]: ...

    def commit(
        self, stage: Staging, scans: Sequence[Result], written: Sequence[Result], work: Path
    ) -> Manifest: ...


def job_dir(work_dir: Path, job: Job) -> Path:
    """The folder of ``job``'s files before the commit (same job, same folder)."""
    return work_dir / f"{job.name}-{job.version}"


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


def run_tasks(
    client: Any,
    tasks: Sequence[TaskSpec],
    *,
    job_key: str,
    progress: Progress,
    label: str,
) -> list[Result]:
    """Run ``tasks`` on Dask, at most two per worker in flight; results in task order.

    A worker that dies mid-task loses nothing: the scheduler runs its task again elsewhere,
    and tasks write whole-or-absent files, so a rerun overwrites nothing half-done.
    """
    from distributed import as_completed

    if not tasks:
        return []
    window = max(2, 2 * len(client.scheduler_info().get("workers", {})))
    pending = iter(enumerate(tasks))
    futures = as_completed()
    position: dict[str, int] = {}

    def submit(number: int, spec: TaskSpec) -> None:
        key = f"{spec.key}-{job_key}-{os.getpid()}"
        position[key] = number
        futures.add(client.submit(spec.fn, *spec.args, key=key, pure=False))

    for number, spec in [item for _, item in zip(range(window), pending, strict=False)]:
        submit(number, spec)
    results: list[Result | None] = [None] * len(tasks)
    rows = 0
    total_rows = sum(t.rows for t in tasks)
    for done, future in enumerate(futures, start=1):
        results[position[future.key]] = future.result()
        rows += tasks[position[future.key]].rows
        counted = f", {rows:,}/{total_rows:,} rows" if total_rows else ""
        progress(f"preprocess: {label} {done}/{len(tasks)}{counted}")
        following = next(pending, None)
        if following is not None:
            submit(*following)
    return [r for r in results if r is not None]


def run_job(client: Any, job: Job, work: Path, progress: Progress) -> tuple[list[Result], ...]:
    """Both passes of ``job`` on Dask; returns (scan results, write results)."""
    work.mkdir(parents=True, exist_ok=True)
    scans = run_tasks(
        client, job.scan_tasks(work), job_key=job.version, progress=progress, label="scan"
    )
    written = run_tasks(
        client,
        job.write_tasks(scans, work),
        job_key=job.version,
        progress=progress,
        label="shards",
    )
    reused = sum(1 for r in written if r.get("reused"))
    if reused:
        progress(f"preprocess: {reused} shards kept from an interrupted run")
    return scans, written


def run_locally(job: Job, work: Path) -> tuple[list[Result], list[Result]]:
    """Both passes in this process, one task after the other (the benchmark's baseline)."""
    work.mkdir(parents=True, exist_ok=True)
    scans = [t.fn(*t.args) for t in job.scan_tasks(work)]
    written = [t.fn(*t.args) for t in job.write_tasks(scans, work)]
    return scans, written


def finished_parquet(path: Path, *, rows: int, row_groups: int) -> Result | None:
    """The result of a shard an earlier, interrupted run already wrote whole, if any."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except (OSError, pa.ArrowInvalid):
        return None
    if metadata.num_rows != rows or metadata.num_row_groups != row_groups:
        return None
    return {"rows": rows, "bytes": path.stat().st_size, "reused": True}


def write_parquet(table: Any, path: Path, *, row_group_size: int) -> int:
    """Write ``table`` to ``path`` whole or not at all; returns its size in bytes."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial, row_group_size=row_group_size)
    os.replace(partial, path)  # a shard is whole or absent
    crash_point("after-shard", path)
    return path.stat().st_size


def crash_point(where: str, path: Path) -> None:
    """Failpoint for the crash tests: with ``SHARDFLOW_PREPROCESS_CRASH_AT=after-shard:N`` the
    worker process writing its N-th shard (counting from 1, across the whole job) dies by
    SIGKILL right after the file is in place, once per job folder."""
    spec = os.environ.get("SHARDFLOW_PREPROCESS_CRASH_AT")
    if not spec or not spec.startswith(where + ":"):
        return
    import fcntl
    import hashlib
    import signal
    import tempfile

    nth = int(spec.split(":", 1)[1])
    job_folder = str(path.parent.parent.resolve())
    marker = Path(tempfile.gettempdir()) / (
        "shardflow-crash-" + hashlib.sha256(job_folder.encode()).hexdigest()[:16]
    )
    with open(marker, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        count = len(f.read().splitlines()) + 1
        f.write(f"{path.name}\n")
        f.flush()
    if count == nth:
        os.kill(os.getpid(), signal.SIGKILL)
