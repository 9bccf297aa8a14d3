"""The one driver of every stage made of independent tasks plus a commit.

A *job* names the catalog version it makes and runs in passes; each pass is a set of
independent tasks whose results plan the next pass; a commit turns the files the tasks left
in the job's folder, and their results, into one catalog version:

    plan (pure) ─▶ job: name, version, passes ("scan", "write")
        │  the version already in the catalog? return it, doing nothing
        ▼
    pass 1 tasks ─▶ results ─▶ pass 2 tasks (planned from pass 1's results) ─▶ results ...
        │  each task: a plain function of plain arguments, whole-or-absent files, a small
        │  result dict; a rolling window keeps about two tasks per worker thread in flight
        ▼
    commit (in the driver): the job's folder + every pass's results ─▶ one catalog version

How tasks run is an argument, a :data:`RunnerFactory`: a :class:`Runner` around a Dask client
(:mod:`preprocessing.cluster` starts or reaches the cluster; the Prefect flows hand in Prefect's
Dask client so that every task is a task run), or :class:`SerialRunner` in this process, or
:class:`ThreadRunner` on threads of this process for tasks that release the GIL.
Nothing here starts a cluster or imports Prefect.
"""

from __future__ import annotations

import functools
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from data_catalog import Catalog, Manifest, Staging
from data_catalog.errors import ShardflowError
from preprocessing.fingerprint import code_of, stage_codes

Progress = Callable[[str], None]
Result = dict[str, Any]
Results = Mapping[str, Sequence[Result]]
"""Each finished pass's results, in task order, by pass name."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task: ``fn(*args)`` returns a small, picklable result dict."""

    key: str
    """Unique in its job, e.g. "write-train-00003"; also the Prefect task-run name."""
    fn: Callable[..., Result]
    args: tuple[Any, ...]
    rows: int = 0
    """Rows the task handles, as planned (for progress)."""
    bytes: int = 0
    """Input bytes the task reads, as planned (for progress)."""
    threads: bool = False
    """``fn`` spends nearly all its time where the GIL is released (Arrow's CSV parser,
    Parquet reader and writer and compute kernels, numpy's sorts and arithmetic, hashlib,
    fsync): on one machine such tasks may run on threads of the command's process
    (:class:`ThreadRunner`) instead of a cluster's worker processes."""


class Job(Protocol):
    """A planned run of one stage (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str | None:
        """The version it will commit; None when only its inputs' contents will tell (an
        ingest, whose version derives from the digests its tasks compute)."""
        ...

    @property
    def work_key(self) -> str:
        """Names the job's folder of unfinished work: the same job, the same folder, so that
        a rerun finds what an interrupted run finished."""
        ...

    @property
    def kind(self) -> str:
        """The catalog kind of the version it makes: "raw" or "processed"."""
        ...

    @property
    def passes(self) -> tuple[str, ...]:
        """The pass names, in order."""
        ...

    def tasks(self, pass_name: str, done: Results, work: Path) -> Sequence[TaskSpec]:
        """The tasks of ``pass_name``, planned from the passes ``done`` before it."""
        ...

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        """Put the files of ``work`` into ``stage`` and commit it."""
        ...

    # Optional: ``kept(pass_name, done) -> Sequence[Result]``, the results of a pass that an
    # earlier version already holds (an incremental job's unchanged inputs); they are counted
    # as reused, and its ``tasks`` are then the rest.


@dataclass(frozen=True, kw_only=True)
class PassProgress:
    """How far one pass has come, reported after every task that finishes."""

    job: str
    """The job's work key ("<name>-<version>" for preprocessing)."""
    pass_name: str
    tasks_done: int
    tasks_total: int
    rows_done: int
    rows_total: int
    bytes_done: int
    bytes_total: int
    seconds: float
    """Since the pass started."""
    reused: int = 0
    """Tasks that found their output already there (an interrupted run's)."""
    task_key: str = ""
    """The task that just finished."""
    result: Result | None = None
    """Its result."""

    @property
    def fraction(self) -> float:
        """Done, by input bytes where the pass knows them, else by rows, else by tasks."""
        if self.bytes_total:
            return min(1.0, self.bytes_done / self.bytes_total)
        if self.rows_total:
            return min(1.0, self.rows_done / self.rows_total)
        return self.tasks_done / self.tasks_total if self.tasks_total else 1.0

    @property
    def eta_seconds(self) -> float | None:
        if self.fraction <= 0 or self.fraction >= 1:
            return None
        return self.seconds * (1 - self.fraction) / self.fraction

    def describe(self) -> str:
        """One line: "write: 12/64 tasks (write-train-00011), 120,000/640,000 rows, 45.1 MB/s,
        ETA 2 min"."""
        done = f" ({self.task_key})" if self.task_key else ""
        parts = [f"{self.pass_name}: {self.tasks_done}/{self.tasks_total} tasks{done}"]
        if self.rows_total:
            parts.append(f"{self.rows_done:,}/{self.rows_total:,} rows")
        elif self.rows_done:
            parts.append(f"{self.rows_done:,} rows")
        if self.bytes_total:
            parts.append(f"{self.bytes_done / 1e6:,.0f}/{self.bytes_total / 1e6:,.0f} MB")
            if self.seconds > 0:
                parts.append(f"{self.bytes_done / self.seconds / 1e6:.1f} MB/s")
        if self.reused:
            parts.append(f"{self.reused} reused (done by an earlier version or run)")
        eta = self.eta_seconds
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        return ", ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


OnProgress = Callable[[PassProgress], None]


def peak_rss_bytes() -> int:
    """This process's peak RSS: the kernel's VmHWM of its own memory. Not ``ru_maxrss``, which
    starts at the RSS of the parent that spawned it (Linux keeps the high-water mark of the
    memory a process had before its exec, a vfork'd child's being the parent's): a Dask worker
    or a benchmarked command would report its parent's size at least."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _process_usage() -> dict[str, float]:
    return {"peak_rss_bytes": peak_rss_bytes(), "cpu_seconds": time.process_time()}


class CodeVersionError(ShardflowError):
    """A Dask worker runs other code for a stage than the command that gives it tasks."""

    def __init__(self, worker: str, module: str, theirs: str, mine: str) -> None:
        super().__init__(
            f"Dask worker {worker} runs other code for {module} ({theirs}) than this command "
            f"({mine}): install the same code on every worker (and restart them), so that "
            "every file is written by the code the version names"
        )


def run_checked(expected: str, fn: Callable[..., Result], *args: Any) -> Result:
    """``fn(*args)`` on a worker whose code of ``fn``'s stage
    (:func:`preprocessing.fingerprint.code_of`) is ``expected``; else refused."""
    theirs = code_of(fn)
    if theirs != expected:
        import socket

        raise CodeVersionError(socket.gethostname(), fn.__module__, theirs, expected)
    return fn(*args)


def plain_submit(client: Any, spec: TaskSpec, key: str) -> Any:
    """Submit ``spec`` as a plain Dask task."""
    return client.submit(spec.fn, *spec.args, key=key, pure=False)


class Runner:
    """Runs tasks on a Dask client in one bounded, rolling window.

    ``submit`` turns a task into a Dask future: a plain Dask task by default; the Prefect
    flows pass one that submits a Prefect task run through Prefect's Dask client.
    """

    def __init__(
        self,
        client: Any,
        *,
        submit: Callable[[Any, TaskSpec, str], Any] = plain_submit,
        progress: Progress = lambda _msg: None,
    ) -> None:
        self.client = client
        self._submit = submit
        self._progress = progress
        self._window: int | None = None
        self._window_at = 0.0

    def usage(self) -> dict[str, Any]:
        """Peak RSS and CPU seconds of every worker process now (their whole lives)."""
        per_worker = self.client.run(_process_usage)
        return {
            "workers": len(per_worker),
            "peak_rss_bytes": sorted(int(u["peak_rss_bytes"]) for u in per_worker.values()),
            "cpu_seconds": sum(float(u["cpu_seconds"]) for u in per_worker.values()),
        }

    def _check_code(self, tasks: Sequence[TaskSpec]) -> dict[str, str]:
        """The code of each stage ``tasks`` belong to, by module, after refusing any worker
        that runs other code for one of them."""
        modules = sorted({spec.fn.__module__ for spec in tasks})
        mine = stage_codes(modules)
        for worker, theirs in sorted(self.client.run(stage_codes, modules).items()):
            for module in modules:
                if theirs[module] != mine[module]:
                    raise CodeVersionError(worker, module, theirs[module], mine[module])
        return mine

    # Workers join and leave seldom; asking the scheduler is a round trip.
    WINDOW_SECONDS = 5.0

    def window(self) -> int:
        """Tasks in flight: two per worker thread the scheduler has (at least two), so that a
        worker finishing one task finds the next one waiting; asked again every few seconds."""
        now = time.monotonic()
        if self._window is None or now - self._window_at > self.WINDOW_SECONDS:
            workers = self.client.scheduler_info().get("workers", {})
            threads = sum(int(w.get("nthreads", 1)) for w in workers.values())
            self._window, self._window_at = max(2, 2 * threads), now
        return self._window

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        """Run ``tasks``; results in task order. ``on_done(index, result)`` hears of each.

        A worker that dies mid-task loses nothing: the scheduler runs its task again
        elsewhere, and tasks write whole-or-absent files. The first task that fails stops the
        run: the others in flight are cancelled and its error is raised. A scheduler lost
        meanwhile is a :class:`SchedulerLost`; one left without workers for the ``workers``
        deadline, a :class:`~data_catalog.deadlines.DeadlineExceeded`.
        """
        try:
            return self._run(tasks, run_key=run_key, on_done=on_done)
        except Exception as exc:
            if not _scheduler_lost(exc) and self.client.status in ("running", "newly-created"):
                raise
            raise SchedulerLost(
                f"lost the Dask scheduler {_address(self.client)} mid-run "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); check that it is "
                "running, then rerun: finished tasks are kept"
            ) from exc

    def _run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        from distributed import as_completed

        expected = self._check_code(tasks)
        results: list[Result | None] = [None] * len(tasks)
        # Largest first (by planned bytes, then rows): the last tasks to start are the
        # shortest, so that the workers finish together instead of one waiting on a big tail.
        pending = iter(
            sorted(enumerate(tasks), key=lambda item: (-item[1].bytes, -item[1].rows, item[0]))
        )
        # With results: each result is fetched from its worker as its task finishes, in the
        # client's event loop, instead of one round trip per task after this loop hears of it.
        in_flight = as_completed(with_results=True)
        index_of: dict[str, int] = {}
        watch = _WorkerWatch(self.client, self._progress)

        def submit_next() -> bool:
            following = next(pending, None)
            if following is None:
                return False
            index, spec = following
            # Each task checks its worker's code version first (a worker may join later).
            code = expected[spec.fn.__module__]
            checked = replace(spec, fn=functools.partial(run_checked, code, spec.fn))
            future = self._submit(self.client, checked, f"{spec.key}-{run_key}")
            index_of[future.key] = index
            in_flight.add(future)
            return True

        for _ in range(self.window()):
            if not submit_next():
                break
        try:
            while not in_flight.is_empty():
                batch = in_flight.next_batch(block=False)
                if not batch:
                    watch.check()  # a scheduler left without workers says so, in time
                    with in_flight.thread_condition:  # notified as each task finishes
                        in_flight.thread_condition.wait(timeout=self.POLL_SECONDS)
                    continue
                for future, result in batch:
                    index = index_of.pop(future.key)
                    if future.status != "finished":
                        future.result()  # raises as the task ended: cancelled, lost, ...
                    results[index] = result
                    on_done(index, result)
                # Refill to the window as it is now: workers may have joined or left.
                while in_flight.count() < self.window() and submit_next():
                    pass
        except BaseException as exc:
            futures = list(in_flight.futures)
            in_flight.clear()
            if not _scheduler_lost(exc):
                self.client.cancel(futures)
            raise
        return [r for r in results if r is not None]

    # The longest the loop sleeps while no task finishes (as_completed's own iteration: 0.1 s).
    POLL_SECONDS = 0.1


class SchedulerLost(ShardflowError):
    """The Dask scheduler went away while tasks ran."""


def _scheduler_lost(exc: BaseException) -> bool:
    return getattr(exc, "reason", None) == "scheduler-connection-lost"


def _address(client: Any) -> str:
    try:
        return str(client.scheduler.address)
    except AttributeError:
        return "(unknown address)"


class _WorkerWatch:
    """Asks the scheduler, every few seconds while tasks wait, how many workers it has; none
    for longer than the ``workers`` deadline is an error naming the scheduler."""

    EVERY_SECONDS = 2.0

    def __init__(self, client: Any, progress: Progress) -> None:
        self.client = client
        self.progress = progress
        self.asked = time.monotonic()
        self.none_since: float | None = None

    def check(self) -> None:
        from data_catalog import deadlines

        now = time.monotonic()
        if now - self.asked < self.EVERY_SECONDS:
            return
        self.asked = now
        workers = self.client.scheduler_info().get("workers", {})
        if workers:
            self.none_since = None
            return
        if self.none_since is None:
            self.none_since = now
            self.progress(
                f"dask: the scheduler {_address(self.client)} has no worker; waiting up to "
                f"{deadlines.WORKERS.seconds():g} s for one ({deadlines.WORKERS.variable})"
            )
        if now - self.none_since >= deadlines.WORKERS.seconds():
            raise deadlines.exceeded(
                f"no Dask worker: the scheduler {_address(self.client)}",
                deadlines.WORKERS,
                "start workers for it (`dask worker ADDRESS`), or run without --scheduler",
            )


class SerialRunner:
    """Runs tasks one after the other in this process (benchmark baselines, unit tests)."""

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        results = []
        for index, spec in enumerate(tasks):
            result = spec.fn(*spec.args)
            results.append(result)
            on_done(index, result)
        return results


class ThreadRunner:
    """Runs tasks on ``threads`` threads of this process, for tasks that release the GIL
    (:attr:`TaskSpec.threads`): no cluster to start, no worker to import the code again.

    A failed task's error is raised once the tasks already running have ended (each leaves
    its file whole or absent); the tasks not yet started are cancelled."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        results: dict[int, Result] = {}
        pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=run_key[:40])
        try:
            futures = {pool.submit(spec.fn, *spec.args): i for i, spec in enumerate(tasks)}
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                on_done(index, results[index])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return [results[index] for index in range(len(tasks))]


class TaskRunner(Protocol):
    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]: ...


def job_dir(work_root: Path, job: Job) -> Path:
    """The folder of ``job``'s files before the commit (same job, same folder)."""
    return work_root / job.work_key


def input_bytes(spec: TaskSpec, result: Result) -> int:
    """What a task read: its planned bytes, else what it reports (an ingest learns them; an
    SDSS write task reads its piece's segments, whose size the plan does not know)."""
    if spec.bytes:
        return spec.bytes
    reported = (result.get("input") or {}).get("bytes", result.get("bytes"))
    return int(reported) if isinstance(reported, int) else 0


class _PassTally:
    """Counts one pass's finished tasks and reports a :class:`PassProgress` after each; the
    results ``kept`` from earlier versions count as reused tasks, done before the first."""

    def __init__(
        self,
        job: Job,
        pass_name: str,
        tasks: Sequence[TaskSpec],
        on_progress: OnProgress,
        kept: Sequence[Result] = (),
    ) -> None:
        self.job = job.work_key
        self.pass_name = pass_name
        self.tasks = tasks
        self.on_progress = on_progress
        self.started = time.monotonic()
        self.done = self.reused = len(kept)
        self.rows = sum(int(r.get("rows", 0)) for r in kept)
        self.bytes = 0
        self.total = len(tasks) + len(kept)
        self.rows_total = sum(t.rows for t in tasks) + self.rows
        self.bytes_total = sum(t.bytes for t in tasks)
        if kept:
            self._report("", kept[-1])

    def __call__(self, index: int, result: Result) -> None:
        spec = self.tasks[index]
        self.done += 1
        # The rows the task reports (an ingest learns them), else the rows it was planned for.
        self.rows += int(result.get("rows", spec.rows))
        self.bytes += input_bytes(spec, result)
        self.reused += bool(result.get("reused"))
        self._report(spec.key, result)

    def _report(self, task_key: str, result: Result) -> None:
        self.on_progress(
            PassProgress(
                job=self.job,
                pass_name=self.pass_name,
                tasks_done=self.done,
                tasks_total=self.total,
                rows_done=self.rows,
                rows_total=self.rows_total,
                bytes_done=self.bytes,
                bytes_total=self.bytes_total,
                seconds=time.monotonic() - self.started,
                reused=self.reused,
                task_key=task_key,
                result=result,
            )
        )


def run_passes(
    job: Job,
    runner: TaskRunner,
    work: Path,
    *,
    on_progress: OnProgress = lambda _p: None,
) -> dict[str, list[Result]]:
    """Every pass of ``job``, each planned from the results of those before it; a pass's
    results are those an earlier version of the job's output already holds (the job's optional
    ``kept(pass_name, done)``: nothing to run for them) and then its tasks'."""
    work.mkdir(parents=True, exist_ok=True)
    done: dict[str, list[Result]] = {}
    # Task keys unique to this run: two drivers sharing a scheduler never share a task.
    run_key = f"{job.work_key}-{uuid.uuid4().hex[:8]}"
    kept_of: Callable[[str, Results], Sequence[Result]] | None = getattr(job, "kept", None)
    for pass_name in job.passes:
        kept = list(kept_of(pass_name, done)) if kept_of is not None else []
        tasks = job.tasks(pass_name, done, work)
        tally = _PassTally(job, pass_name, tasks, on_progress, kept)
        ran = runner.run(tasks, run_key=f"{pass_name}-{run_key}", on_done=tally)
        done[pass_name] = [*kept, *ran]
    return done


RunnerFactory = Callable[[], AbstractContextManager[TaskRunner]]
"""Starts the way tasks run (a Dask cluster, say) only when there is work to do."""


def run_job(
    catalog: Catalog,
    job: Job,
    *,
    runner: RunnerFactory,
    work_root: Path | None = None,
    progress: Progress = lambda _msg: None,
    on_progress: OnProgress | None = None,
    on_usage: Callable[[dict[str, Any]], None] | None = None,
) -> Manifest:
    """Run ``job``'s passes and commit its version; the existing version, doing no work (and
    starting no cluster), when the catalog already holds it.

    ``on_usage`` hears the workers' peak RSS and CPU seconds (and this process's) once the
    tasks are done. With ``work_root``, the job's files wait in ``work_root/<work key>`` until
    the commit, so that a rerun after a crash keeps what the crashed run finished; without it, in
    a folder beside the staging that goes with it.
    """
    if _existing(catalog, job, progress):
        return catalog.get(job.name, job.version)
    report = on_progress or (lambda p: progress(p.describe()))
    with _one_run_at_a_time(job, work_root, progress):
        # Another run of the same job may have committed while this one waited.
        if _existing(catalog, job, progress):
            return catalog.get(job.name, job.version)
        with runner() as tasks_runner, catalog.stage(job.name, kind=job.kind) as stage:
            # Beside staging, never inside it: staging is what gets committed.
            work = (
                job_dir(work_root, job)
                if work_root is not None
                else stage.path.with_name(stage.path.name + ".work")
            )
            try:
                started = time.monotonic()
                tallies: dict[str, PassProgress] = {}

                def tally(state: PassProgress) -> None:
                    tallies[state.pass_name] = state
                    report(state)

                done = run_passes(job, tasks_runner, work, on_progress=tally)
                stage.note_run(
                    seconds=round(time.monotonic() - started, 3),
                    passes={
                        name: {
                            "tasks": state.tasks_total,
                            "reused": state.reused,
                            "rows": state.rows_done,
                            "input_bytes": state.bytes_done,
                            "seconds": round(state.seconds, 3),
                        }
                        for name, state in tallies.items()
                    },
                )
                usage = getattr(tasks_runner, "usage", None)
                if on_usage is not None and usage is not None:
                    on_usage({**usage(), "driver": _process_usage()})
                manifest = job.commit(stage, done, work)
                # The version the job promised is the one it committed (else the check above
                # could never find it, and every rerun would redo the work).
                assert job.version in (None, manifest.version), (manifest.version, job.version)
            finally:
                if work_root is None:
                    shutil.rmtree(work, ignore_errors=True)
                else:
                    # Kept for a rerun only when it holds work: a run refused before any
                    # task wrote (a worker with other code) leaves nothing behind.
                    _remove_if_empty(work)
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` and its empty subfolders when no file is under it."""
    if not folder.is_dir() or any(p.is_file() for p in folder.rglob("*")):
        return
    shutil.rmtree(folder, ignore_errors=True)


def _existing(catalog: Catalog, job: Job, progress: Progress) -> bool:
    if job.version is None or not catalog.exists(job.name, job.version):
        return False
    progress(f"{job.name}@{job.version} already in the catalog; nothing to do")
    return True


@contextmanager
def _one_run_at_a_time(job: Job, work_root: Path | None, progress: Progress) -> Iterator[None]:
    """Hold the job's lock in ``work_root`` while it runs: a second run of the same job (a
    schedule meeting a manual run) waits for the first instead of sharing its folder."""
    if work_root is None:
        yield
        return
    import fcntl

    locks = work_root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{job.work_key}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another run of {job.work_key} to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_locally(job: Job, work: Path) -> dict[str, list[Result]]:
    """Every pass in this process, one task after the other (the benchmark's baseline)."""
    return run_passes(job, SerialRunner(), work)


def serial_runner() -> AbstractContextManager[TaskRunner]:
    """Tasks one after the other in this process."""
    return nullcontext(SerialRunner())
