"""Where a job's tasks run: a Dask cluster started (or reached) for as long as a stage runs.

    ClusterConfig ─▶ dask_client ─┬─ scheduler given: a client on that cluster
                                  ├─ cluster "slurm": dask-jobqueue's SLURMCluster, one worker
                                  │  per job (sbatch --test-only first), scancel at the end
                                  └─ else: a LocalCluster of ``workers`` processes, started deaf
                                     to Ctrl-C, with glibc's own malloc thresholds
                  ─▶ dask_runner ─▶ preprocessing.driver.Runner on that client

The driver (:mod:`preprocessing.driver`) takes a runner and knows nothing of how the cluster
was provisioned; the workers' and the client's log filters that keep a stopped run to one line
live here with the cluster. Nothing here imports Prefect (the flows hand in Prefect's Dask
client class and a ``submit`` that makes every task a task run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from data_catalog.errors import ShardflowError
from preprocessing.config import ClusterConfig
from preprocessing.driver import (
    Progress,
    Result,
    Runner,
    SerialRunner,
    TaskSpec,
    ThreadRunner,
    plain_submit,
)


@contextmanager
def dask_client(
    config: ClusterConfig,
    progress: Progress = lambda _msg: None,
    *,
    client_class: Any = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """A Dask client on an existing scheduler, on a fresh LocalCluster, or on workers in SLURM
    jobs (``config.cluster == "slurm"``: :func:`_slurm_cluster`).

    ``client_class`` replaces ``distributed.Client`` (the flows pass Prefect's); ``env`` is
    set in the LocalCluster's (or the SLURM jobs') worker processes. LocalCluster workers log
    at WARNING and above: their start and stop lines are not the stage's progress.
    """
    from distributed import Client, LocalCluster

    client_class = client_class or Client
    logging.getLogger("tornado.application").addFilter(_not_a_cancel_race)
    if config.scheduler is not None:
        from data_catalog.deadlines import CONNECT

        seconds = CONNECT.seconds()
        progress(f"dask: connecting to scheduler {config.scheduler} (up to {seconds:g} s)")
        with _quiet_when_lost(), _reached(config.scheduler, client_class) as client:
            _relay_task_progress(client, progress)
            progress(f"dask: using scheduler {config.scheduler}, dashboard {client.dashboard_link}")
            yield client
        return
    if config.cluster == "slurm":
        with _slurm_client(config, progress, client_class=client_class, env=env) as client:
            yield client
        return
    # Stopped early (Ctrl-C, a task's failure), the cluster's complaints while it closes
    # (workers stopped mid-task, heartbeats of workers gone) are not the command's error.
    distributed_log = logging.getLogger("distributed")
    level = distributed_log.level
    try:
        with ExitStack() as stack:
            try:
                with _workers_deaf_to_ctrl_c(), _glibc_malloc_defaults():
                    cluster = stack.enter_context(
                        LocalCluster(
                            n_workers=config.workers,
                            threads_per_worker=1,
                            processes=True,
                            memory_limit=config.memory_limit,
                            dashboard_address="127.0.0.1:0",
                            host="127.0.0.1",
                            silence_logs=logging.WARNING,
                            env=dict(env or {}),
                        )
                    )
                client = stack.enter_context(client_class(cluster))
                # The workers print to this command's stderr: a task's failure is raised
                # here, in one line, not also logged there with its traceback.
                client.register_plugin(_quiet_task_failures_plugin()())
                _relay_task_progress(client, progress)
                progress(
                    f"dask: LocalCluster with {config.workers} workers, dashboard "
                    f"{client.dashboard_link}"
                )
                yield client
            except BaseException:
                distributed_log.setLevel(logging.CRITICAL)
                raise
    finally:
        distributed_log.setLevel(level)


@contextmanager
def _reached(address: str, client_class: Any) -> Iterator[Any]:
    """A client of the scheduler at ``address``, connected within the ``connect`` deadline.

    Dask's own ``timeout`` bounds the TCP connection, not the handshake after it: a listener
    that accepts and never answers (or answers HTTP) held the command for minutes, silent."""
    from data_catalog import deadlines

    seconds = deadlines.CONNECT.seconds()

    def connect() -> Any:
        return client_class(address, timeout=f"{seconds}s")

    try:
        client = deadlines.call_within(
            connect,
            deadlines.CONNECT,
            f"the Dask scheduler at {address}",
            "check that a Dask scheduler (not another server) listens there",
        )
    except OSError as exc:
        raise ShardflowError(f"cannot reach Dask scheduler {address}: {exc}") from exc
    except (MemoryError, ValueError, TypeError, KeyError, AssertionError) as exc:
        # Another protocol's reply read as Dask's frames: an HTTP server's bytes as a length.
        raise ShardflowError(
            f"{address} did not answer as a Dask scheduler ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:120]}): check --scheduler (tcp://HOST:8786)"
        ) from exc
    with client:
        yield client


@contextmanager
def _quiet_when_lost() -> Iterator[None]:
    """On a scheduler of its own, a lost connection is the command's error, said in one line
    (:class:`preprocessing.driver.SchedulerLost`): the client's reconnect attempts, logged with
    their tracebacks as they happen, stay off the terminal (36 lines before)."""
    # distributed.batched logs its closed comm (CommClosedError, an OSError) with a traceback
    # too, at INFO, when the scheduler goes while a message to it is under way.
    logs = [logging.getLogger(name) for name in ("distributed.client", "distributed.batched")]
    for log in logs:
        log.addFilter(_not_a_reconnect)
    try:
        yield
    finally:
        for log in logs:
            log.removeFilter(_not_a_reconnect)


def _not_a_reconnect(record: logging.LogRecord) -> bool:
    if "reconnect" in record.getMessage().lower():
        return False
    # distributed.utils.log_errors around Client._reconnect logs what ended it, message-less.
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or not isinstance(exc, OSError | asyncio.CancelledError)


@contextmanager
def _glibc_malloc_defaults() -> Iterator[None]:
    """LocalCluster workers spawned with glibc's own malloc thresholds.

    Dask's nannies set ``MALLOC_TRIM_THRESHOLD_=65536`` before spawning a worker
    (``distributed.nanny.pre-spawn-environ``) so that freed memory goes back to the OS at
    once. Setting it also turns off glibc's dynamic mmap threshold: every array above 128 KiB
    is then a fresh mmap, page-faulted in and zeroed on each use. The tasks here allocate and
    free shard-sized arrays (MBs) over and over: with Dask's setting a write task of
    Fashion-MNIST used 30 % more CPU in a worker than the same call in this process (0.50 vs
    0.38 CPU-s for the 8 shards, 21,000 vs 2,500 page faults; docs/STACK.md). Peak worker
    memory is bounded by the tasks, not by what the allocator keeps. A value the user set in
    the environment is still inherited.
    """
    import dask

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}))
    environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}):
        yield


# Each SLURM job's own scratch folder, on the node's local disk (never shared: two workers in
# one folder clobber each other's spill files); the job script's shell expands it.
SLURM_LOCAL_DIRECTORY = "${TMPDIR:-/tmp}/shardflow-dask-$SLURM_JOB_ID"
SLURM_JOB_NAME = "shardflow-dask"


def _slurm_scheduler_host() -> str:
    """The address this host's name resolves to: the one SLURM's nodes know it by."""
    import socket

    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ShardflowError(
            f"--cluster slurm: this host's name {name!r} does not resolve ({exc}): give "
            "--slurm-interface, the interface the compute nodes reach this host on"
        ) from exc


def _slurm_cluster(config: ClusterConfig, env: Mapping[str, str], progress: Progress) -> Any:
    """dask-jobqueue's SLURMCluster: one worker per job (one core, one thread,
    ``config.memory_limit``), run by this interpreter (the same code as this command, which
    every task checks), its scheduler in this process on an address the jobs reach."""
    import shlex
    import sys

    from dask_jobqueue.slurm import SLURMCluster

    if config.slurm_interface is not None:
        scheduler_options: dict[str, Any] = {
            "interface": config.slurm_interface,
            "dashboard_address": ":0",
        }
    else:
        host = _slurm_scheduler_host()
        scheduler_options = {"host": host, "dashboard_address": f"{host}:0"}
        if host.startswith("127."):
            progress(
                f"dask: this host's name resolves to {host}: only SLURM jobs on this host "
                "reach the scheduler (give --slurm-interface for other nodes)"
            )
    cluster = SLURMCluster(
        cores=1,
        processes=1,
        memory=config.memory_limit,
        python=sys.executable,
        queue=config.slurm_partition,
        account=config.slurm_account,
        walltime=config.slurm_walltime,
        job_name=SLURM_JOB_NAME,
        interface=config.slurm_interface,
        scheduler_options=scheduler_options,
        local_directory=SLURM_LOCAL_DIRECTORY,
        job_script_prologue=[
            # The scratch folder goes with the job (scancel: SIGTERM, then the shell's trap).
            f"trap 'rm -rf \"{SLURM_LOCAL_DIRECTORY}\"' EXIT",
            # sbatch hands the jobs this command's environment; ``env`` comes on top of it.
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        ],
    )
    try:
        _check_worker_job(cluster.job_script())
    except BaseException:
        cluster.close()
        raise
    return cluster


def _check_worker_job(script: str) -> None:
    """Refuse in one line a worker job that sbatch would refuse (a partition or account that
    does not exist, a walltime above the partition's limit), before any job is queued."""
    import subprocess

    try:
        done = subprocess.run(
            ["sbatch", "--test-only"],
            input=script,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except FileNotFoundError:
        raise ShardflowError("--cluster slurm needs sbatch (SLURM's client) on PATH") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ShardflowError(f"sbatch refuses the Dask worker job: {last}")


@contextmanager
def _slurm_client(
    config: ClusterConfig,
    progress: Progress,
    *,
    client_class: Any,
    env: Mapping[str, str] | None,
) -> Iterator[Any]:
    """A client on ``config.workers`` worker jobs, once the first has joined; every job is
    cancelled (scancel) when the block ends, however it ends. A job whose client was killed
    outright stops by itself once its worker has lost the scheduler for 60 s
    (dask-jobqueue's ``--death-timeout``)."""
    distributed_log = logging.getLogger("distributed")
    level = distributed_log.level
    try:
        with ExitStack() as stack:
            try:
                cluster = stack.enter_context(_slurm_cluster(config, env or {}, progress))
                client = stack.enter_context(client_class(cluster))
                client.register_plugin(_quiet_task_failures_plugin()())
                _relay_task_progress(client, progress)
                cluster.scale(config.workers)
                progress(
                    f"dask: SLURMCluster, {config.workers} jobs {SLURM_JOB_NAME!r} of 1 core and "
                    f"{config.memory_limit}, scheduler {cluster.scheduler_address}, dashboard "
                    f"{client.dashboard_link}; waiting for the first to start"
                )
                _wait_for_slurm_worker(client, cluster, config.slurm_start_timeout)
                progress(
                    f"dask: {len(client.scheduler_info()['workers'])} of {config.workers} "
                    "SLURM workers joined (the others join as their jobs start)"
                )
                yield client
            except BaseException:
                distributed_log.setLevel(logging.CRITICAL)
                raise
    finally:
        distributed_log.setLevel(level)


def _wait_for_slurm_worker(client: Any, cluster: Any, timeout: float) -> None:
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError:
        jobs = sorted(str(job.job_id) for job in cluster.workers.values() if job.job_id)
        where = f"squeue -j {','.join(jobs)}" if jobs else "squeue --me"
        raise ShardflowError(
            f"no SLURM job started a worker within {timeout:g} s: check `{where}`"
        ) from None


def _relay_task_progress(client: Any, progress: Progress) -> None:
    """Show what tasks report as they run (a slow server retried) as this command's progress."""
    from preprocessing.sources.task_progress import TOPIC

    client.subscribe_topic(TOPIC, lambda event: progress(str(event[1])))


@contextmanager
def _workers_deaf_to_ctrl_c() -> Iterator[None]:
    """Start the LocalCluster's worker processes deaf to Ctrl-C, and hold this process's own
    Ctrl-C (or SIGTERM) until the cluster is up, to be raised then (and the cluster closed).

    Ctrl-C at a terminal signals the whole process group: each worker then died mid-task with
    its tracebacks (about 60 lines) while this process was closing the cluster anyway. SIGINT
    is blocked in this thread while the cluster starts, so its threads, and the processes they
    spawn, inherit the block (a signal mask survives fork and exec); a half-started cluster
    would be closed by Dask's atexit hook, with an assertion's traceback."""
    import signal
    import threading
    from multiprocessing import resource_tracker

    # Started before the block: starting it unblocks SIGINT in the calling thread (CPython
    # bpo-33613), which would also unblock it for the workers.
    resource_tracker.ensure_running()
    held: list[int] = []
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if callable(signal.getsignal(signum)):
                handlers[signum] = signal.signal(signum, lambda num, _frame: held.append(num))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if held:
            handlers[held[0]](held[0], None)


def _not_a_task_failure(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Compute Failed")


def _not_a_cancelled_task(record: logging.LogRecord) -> bool:
    # A run stopped early (Ctrl-C, another task's failure) cancels the tasks in flight.
    return "ended with CancelledError" not in record.getMessage()


def _not_a_lost_scheduler(record: logging.LogRecord) -> bool:
    # A worker outliving its scheduler by a heartbeat (the command closing the cluster, or
    # stopped by Ctrl-C) logs the failed heartbeat with a traceback; the command itself
    # reports a scheduler lost mid-run.
    return "Failed to communicate with scheduler during heartbeat" not in record.getMessage()


def _not_a_cancel_race(record: logging.LogRecord) -> bool:
    # distributed's `utils.sync` (2026.1.1, the same in 2026.8): a Ctrl-C that arrives before
    # the coroutine it waits on has started schedules `cancel()`, which reads the unassigned
    # `future` and raises NameError in the event loop's thread; tornado logs it with a
    # traceback. The interrupt itself is handled (the command stops and says so in one line).
    if record.exc_info is None or not isinstance(record.exc_info[1], NameError):
        return True
    return "sync.<locals>.cancel" not in record.getMessage()


def _quiet_task_failures_plugin() -> Any:
    from distributed.diagnostics.plugin import WorkerPlugin

    class Plugin(WorkerPlugin):
        name = "shardflow-quiet-task-failures"

        def setup(self, worker: Any) -> None:
            logging.getLogger("distributed.worker").addFilter(_not_a_task_failure)
            logging.getLogger("distributed.worker").addFilter(_not_a_lost_scheduler)
            logging.getLogger("distributed.worker.state_machine").addFilter(_not_a_cancelled_task)

    return Plugin


@contextmanager
def dask_runner(
    config: ClusterConfig,
    progress: Progress = lambda _msg: None,
    *,
    client_class: Any = None,
    submit: Callable[[Any, TaskSpec, str], Any] = plain_submit,
    env: Mapping[str, str] | None = None,
) -> Iterator[Runner]:
    """A :class:`Runner` on the cluster ``config`` describes, for as long as the block runs."""
    with dask_client(config, progress, client_class=client_class, env=env) as client:
        yield Runner(client, submit=submit, progress=progress)


class PlannedRunner:
    """Starts nothing until the job's first pass is planned: a first pass whose tasks all
    release the GIL (:attr:`TaskSpec.threads`: the ingest of CSV exports, the verification,
    scan and write of SDSS pieces) runs on ``config.workers`` threads of this process (a
    LocalCluster only), and so do the passes after it while theirs do too; a first pass that
    reads at most ``config.in_process_bytes`` runs the whole job in this process (the same
    files: the tasks are the same functions), on those threads where a pass's tasks release the
    GIL, else one task after the other; any other pass starts the cluster ``config``
    describes, which then runs every pass left. ``in_process_bytes`` 0 always starts the
    cluster."""

    def __init__(self, config: ClusterConfig, progress: Progress, stack: ExitStack) -> None:
        self._config = config
        self._progress = progress
        self._stack = stack
        self._runner: Runner | SerialRunner | ThreadRunner | None = None
        self._small = False
        """The first pass read at most ``in_process_bytes``: the job never starts a cluster."""
        self._in_process_cpu = 0.0

    def _choose(self, tasks: Sequence[TaskSpec]) -> Runner | SerialRunner | ThreadRunner:
        planned = sum(spec.bytes for spec in tasks)
        local = self._config.scheduler is None and self._config.cluster == "local"
        self._small = local and planned <= self._config.in_process_bytes
        threads = min(self._config.workers, len(tasks))
        threaded = local and self._config.in_process_bytes and all(s.threads for s in tasks)
        if self._small and not (threaded and threads > 1):
            self._progress(
                f"{len(tasks)} tasks reading {planned / 2**20:,.0f} MiB: in this process, "
                "no cluster started"
            )
            return SerialRunner()
        if threaded:
            # Worker processes would only add their start and imports (about 1.5 CPU-s for
            # two): these tasks run in parallel on threads (docs/preprocessing.md, "Ingest"),
            # a small job's too (a 200,000-row SDSS preprocess: 0.33 s of tasks one after the
            # other).
            self._progress(
                f"{len(tasks)} tasks reading {planned / 2**20:,.0f} MiB: on {threads} threads "
                "of this process, no cluster started"
            )
            return ThreadRunner(threads)
        return self._stack.enter_context(dask_runner(self._config, self._progress))

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        if self._runner is None:
            if not tasks:
                return []
            self._runner = self._choose(tasks)
        elif isinstance(self._runner, ThreadRunner) and not all(s.threads for s in tasks):
            # A pass that holds the GIL (an image set's decoding after the verification of
            # its files): one after the other in this process for a small job, else worker
            # processes from here on.
            if self._small:
                self._runner = SerialRunner()
            else:
                self._runner = self._stack.enter_context(dask_runner(self._config, self._progress))
        if isinstance(self._runner, Runner):
            return self._runner.run(tasks, run_key=run_key, on_done=on_done)
        from preprocessing.sources import task_progress

        started = time.process_time()
        try:
            with task_progress.to(self._progress):
                return self._runner.run(tasks, run_key=run_key, on_done=on_done)
        finally:
            self._in_process_cpu += time.process_time() - started

    @property
    def dashboard(self) -> str | None:
        """The Dask dashboard of the cluster it started or reached; None if none was."""
        if isinstance(self._runner, Runner):
            return str(self._runner.client.dashboard_link)
        return None

    def usage(self) -> dict[str, Any]:
        """The workers' peak RSS and CPU seconds; when the tasks ran in this process, no
        workers and the CPU seconds this process spent running them (its peak RSS is the
        driver's)."""
        if isinstance(self._runner, Runner):
            usage = self._runner.usage()
            # The passes that ran on threads of this process before the cluster started.
            usage["cpu_seconds"] = round(usage["cpu_seconds"] + self._in_process_cpu, 3)
            return usage
        # Threads or one after the other: the CPU of this process while its tasks ran.
        return {"workers": 0, "peak_rss_bytes": [], "cpu_seconds": round(self._in_process_cpu, 3)}


@contextmanager
def planned_runner(
    config: ClusterConfig, progress: Progress = lambda _msg: None
) -> Iterator[PlannedRunner]:
    """A :class:`PlannedRunner` for as long as the block runs (its cluster, if it started one,
    stopped after)."""
    with ExitStack() as stack:
        yield PlannedRunner(config, progress, stack)
