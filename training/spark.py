"""The ranks as Spark tasks: ``python -m training.spark --parent PID --master URL --np N
WORKER_JSON`` runs Horovod's Spark runner (``horovod.spark.run``, Gloo) on a Spark session of
``URL``; each of the N tasks starts one rank of the same rank program as horovodrun does
(``training.worker`` on the run folder's worker.json).

launcher (shardflow train --launcher spark)
    │  python -m training.spark ... (its own session; dies with the launcher)
    ▼
SparkSession(master URL) ── JVM ── N Spark tasks (Horovod's task services)
    │  horovod.spark.run(rank, worker.json): Gloo rendezvous here, one rank per task
    ▼
python -m horovod.spark.task.gloo_exec_fn ─► training.worker.main([worker.json])

What Horovod 0.28.1's Spark runner needs here that it does not do itself:

- **The workers' Python.** Spark starts its Python workers with ``python3`` from PATH
  (``PYSPARK_PYTHON`` unset), which has no Horovod ("No module named 'horovod'" in the task);
  here they run this interpreter, as horovodrun's ranks do, and import this code
  (``PYTHONPATH``, also set for executors of a standalone cluster).
- **Dying with the launcher.** Nothing of Spark's stops when the program that started it is
  killed: the JVM ends only when its stdin closes, the task services and the ranks (in
  sessions of their own, ``safe_shell_exec``) run on. Here every descendant of this process
  is stopped when it is asked to stop (SIGTERM, also sent by Linux when the launcher dies) or
  when a watching thread finds the launcher gone.
- **A start that cannot happen.** With fewer task slots than ranks the runner waits
  ``start_timeout`` (600 s by default) for the missing tasks; here it is
  :data:`START_SECONDS`, and a master that cannot be reached fails as one line.
- **Which rank failed.** The runner blames the rank whose exit code it learned first, and it
  learns each one by polling that rank's task service once a second: a rank that exited because
  its peer was killed may be learned first. Here every rank's exit code is printed
  (:data:`RANK_EXIT_PREFIX`), for the launcher to name the rank that died first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

USAGE = "usage: python -m training.spark --parent PID --master URL --np N WORKER_JSON"
# How long the Spark tasks may take to start and register with Horovod's driver service.
START_SECONDS = 120
# How long a standalone master may take to accept a connection.
MASTER_SECONDS = 10.0
# After SIGTERM, how long the descendants get before SIGKILL (a rank saves nothing on SIGTERM
# unless it checkpoints; 5 s as horovodrun's middlemen give theirs).
STOP_GRACE_SECONDS = 5.0
WATCH_SECONDS = 1.0
# Printed before the one line that says why the Spark run failed, for the launcher to find.
FAILURE_PREFIX = "spark launcher failed: "
# Printed once a rank has ended, with its rank and exit code ("spark launcher: rank 1 exit code
# 137"), in the order the runner learned them, for the launcher to find.
RANK_EXIT_PREFIX = "spark launcher: rank "
# The environment the ranks get from here (beside the Spark task's own): what shardflow, TF
# and Horovod read. Secrets stay in the credentials file (training.credentials).
FORWARDED = ("PYTHONPATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL")
FORWARDED_PREFIXES = ("SHARDFLOW_", "HOROVOD_")


def find_java() -> str:
    """The ``java`` Spark will start: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if found is None or not Path(found).exists():
        where = f"no {found}" if found else "no java on PATH"
        raise ShardflowError(
            f"--launcher spark needs a Java runtime (JDK 17) and found none ({where}): install "
            "it with `make spark-jdk` (Debian's openjdk-17-jre-headless) or set JAVA_HOME"
        )
    return found


def check_master(master: str) -> None:
    """Refuse, in one line and before a JVM starts, a standalone master (``spark://``) that
    does not accept connections: Spark would retry it for a minute, then fail in a traceback."""
    if not master.startswith("spark://"):
        return
    for address in master.removeprefix("spark://").split(","):
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=MASTER_SECONDS):
                return
        except (OSError, ValueError):
            continue
    raise ShardflowError(
        f"cannot reach the Spark master {master} (nothing accepts connections there): start it "
        "($SPARK_HOME/sbin/start-master.sh) or check --spark-master (nothing was started)"
    )


def _address_towards(master: str) -> str:
    """This host's address on the route to ``master``: where its executors can reach the
    driver. Spark's default is this host's name, which a worker host may resolve to another
    address (to itself, in the lab's namespaced hosts: Connection refused to "vm/10.77.x.2")."""
    host, _, port = master.removeprefix("spark://").split(",")[0].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=MASTER_SECONDS) as connection:
        return str(connection.getsockname()[0])


def spark_command(master: str, num_ranks: int, worker_json: Path, parent: int) -> list[str]:
    """The command line of this module that runs ``num_ranks`` ranks on ``master``."""
    return [
        *(sys.executable, "-m", "training.spark", "--parent", str(parent)),
        *("--master", master, "--np", str(num_ranks), str(worker_json)),
    ]


def rank(worker_json: str) -> int:
    """One rank, in the process Horovod's Spark task starts for it."""
    from training import worker

    worker.main([worker_json])
    return 0


def _code_root() -> str:
    """The folder this code is imported from, for the workers' ``PYTHONPATH``."""
    return str(Path(__file__).resolve().parent.parent)


def _rank_environment() -> dict[str, str]:
    environ = dict(os.environ)
    python_path = [_code_root(), *filter(None, environ.get("PYTHONPATH", "").split(":"))]
    environ["PYTHONPATH"] = ":".join(dict.fromkeys(python_path))
    return {k: v for k, v in environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}


def _session(master: str, num_ranks: int) -> object:
    """A Spark session of ``master`` whose Python workers run this interpreter and code."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("shardflow-train")
        # No web UI: it would listen on every interface for the run's length.
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # Horovod's runner starts one task per rank and keeps it for the whole run.
        .config("spark.task.maxFailures", "1")
        .config("spark.executorEnv.PYTHONPATH", _rank_environment()["PYTHONPATH"])
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
    )
    if master.startswith("local"):
        # Everything on this host: the driver and its block manager on loopback only.
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    else:  # spark://: a standalone master (LaunchConfig takes no other)
        builder = builder.config("spark.cores.max", str(num_ranks)).config(
            "spark.driver.host", _address_towards(master)
        )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def rank_exit_line(rank: int, exit_code: int) -> str:
    """The line that says rank ``rank`` ended with ``exit_code``."""
    return f"{RANK_EXIT_PREFIX}{rank} exit code {exit_code}"


def _report_rank_exits() -> None:
    """Make Horovod's Spark runner print each rank's exit code (:func:`rank_exit_line`) as it
    learns it.

    The runner names only the rank whose exit code came back first, a race it can lose (module
    docstring). Its ``rsh`` logs each exit code, but by host hash and slot on that host: which
    rank that is depends on the order the runner gave the hosts, known only inside it. The
    function that runs one rank (``horovod.spark.gloo_run._exec_command_fn``'s) is given the
    rank, so it is wrapped here, in this process only (Horovod 0.28.1 is its last release).
    """
    from horovod.spark import gloo_run

    make_exec_command = gloo_run._exec_command_fn

    def reporting_exec_command_fn(*args: Any, **kwargs: Any) -> Callable[..., tuple[int, float]]:
        exec_command = make_exec_command(*args, **kwargs)

        def exec_and_report(command: Any, slot_info: Any, events: Any) -> tuple[int, float]:
            exit_code, stamp = exec_command(command, slot_info, events)
            # One write: on a local master the ranks write to the same pipe.
            sys.stdout.write(rank_exit_line(slot_info.rank, exit_code) + "\n")
            sys.stdout.flush()
            return exit_code, stamp

        return exec_and_report

    gloo_run._exec_command_fn = reporting_exec_command_fn


def run(master: str, num_ranks: int, worker_json: str) -> None:
    """Run ``num_ranks`` ranks on ``worker_json`` as tasks of a Spark session of ``master``."""
    session = _session(master, num_ranks)
    import horovod.spark

    _report_rank_exits()

    try:
        horovod.spark.run(
            rank,
            args=(worker_json,),
            num_proc=num_ranks,
            start_timeout=START_SECONDS,
            use_gloo=True,
            env=_rank_environment(),
            verbose=1,
        )
    finally:
        session.stop()  # type: ignore[attr-defined]  # pyspark has no type hints for it


def stop_descendants() -> None:
    """SIGTERM to every process below this one (JVM, Python workers, task services, ranks),
    SIGKILL to those left after ``STOP_GRACE_SECONDS``."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for _ in range(2):  # once more: a process may have started one while we looked
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                found.setdefault(child.pid, child)
        for child in found.values():
            with contextlib.suppress(psutil.Error):
                child.terminate()
    _gone, alive = psutil.wait_procs(list(found.values()), timeout=STOP_GRACE_SECONDS)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _stop_on_signal(signum: int, _frame: object) -> None:
    stop_descendants()
    os._exit(128 + signum)


def _watch_parent(parent_pid: int) -> None:
    """Stop everything below this process, then this process, once the parent is gone (its
    death signal may have been lost)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_SECONDS)
        stop_descendants()
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="stop-when-parent-dies", daemon=True).start()


def _parse(args: list[str]) -> tuple[int, str, int, str] | None:
    if len(args) != 7 or args[0::2][:3] != ["--parent", "--master", "--np"]:
        return None
    if not (args[1].isdigit() and args[5].isdigit()):
        return None
    return int(args[1]), args[3], int(args[5]), args[6]


def _describe(exc: BaseException) -> str:
    """``str(exc)``, which py4j's errors raise from once the JVM is gone."""
    try:
        return str(exc)
    except Exception:  # py4j: "<exception str() failed>"; its type still says what happened
        return type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parsed = _parse(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    parent, master, num_ranks, worker_json = parsed
    from training.horovodrun import die_with_parent

    # First, before the slow imports: the parent may be killed while they run.
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    _watch_parent(parent)
    try:
        run(master, num_ranks, worker_json)
    except Exception as exc:  # every failure is one line for the launcher
        stop_descendants()
        reason = " ".join(_describe(exc).split()) or type(exc).__name__
        print(f"{FAILURE_PREFIX}{type(exc).__name__}: {reason}"[:2000], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
