"""A Prefect API server for one command, when no ``PREFECT_API_URL`` names a running one.

Prefect starts a temporary server of its own in that case, but gives it 20 seconds to answer
(``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``): on a busy machine (load 5 on 2 cores)
its imports and database migrations take longer and the run fails before it starts. Its
process also outlives a SIGKILLed command, and it sends telemetry. This one runs the same
application (uvicorn, ``prefect.server.api.server:create_app``, no UI, no services), waits
for ``/api/health`` with a generous limit, never sends telemetry, and dies with the command
however the command ends.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from data_catalog.errors import ShardflowError

# How long a start may take: the API answers in seconds on a quiet machine, in about a minute
# under heavy load; a user's PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is honoured.
DEFAULT_STARTUP_SECONDS = 600
QUIET_SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "0",
    # The ephemeral application: no background services, no UI.
    "PREFECT__SERVER_EPHEMERAL": "1",
}


def die_with_parent() -> None:
    """For ``preexec_fn``: the child gets SIGTERM when the process that started it dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``); elsewhere a no-op."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except (OSError, AttributeError):
        return


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str, timeout: float = 5) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except (httpx.HTTPError, httpx.InvalidURL):
        return False


def _check_configured(url: str) -> None:
    """Refuse, before any work, a ``PREFECT_API_URL`` whose server does not answer /health
    within the ``connect`` deadline (a listener that never answers held `run` for minutes:
    Prefect's client waits 60 s per request, and retries)."""
    from data_catalog import deadlines

    seconds = deadlines.CONNECT.seconds()
    started = time.monotonic()
    if _healthy(url, timeout=seconds):
        return
    if time.monotonic() - started >= seconds:
        raise deadlines.exceeded(
            f"the Prefect API at {url} (PREFECT_API_URL)",
            deadlines.CONNECT,
            "start that server (shardflow server), or unset PREFECT_API_URL to run on a "
            "temporary local one",
        )
    raise ShardflowError(
        f"the Prefect API at {url} (PREFECT_API_URL) does not answer /health: start that "
        "server (shardflow server), or unset PREFECT_API_URL to run on a temporary local one"
    )


def _send_what_prefect_holds() -> None:
    """Send the logs and events Prefect still queues before the server goes (else it tries at
    exit and prints "--- Error logging to API ---")."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)


@contextmanager
def api_for_this_command(
    log_dir: Path, progress: Callable[[str], None] = lambda _m: None
) -> Iterator[str]:
    """Yield the Prefect API URL to use: ``PREFECT_API_URL`` when set, else that of a server
    started here (on a free loopback port, its log in ``log_dir``) and stopped on exit.

    Sets ``PREFECT_API_URL`` in this process's environment for the block, so that Prefect,
    imported after this, and every process started from here (Dask workers) use it.
    """
    configured = os.environ.get("PREFECT_API_URL")
    if configured:
        _check_configured(configured.rstrip("/"))
        yield configured
        return
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        raise ShardflowError("prefect is not installed: run `make setup`")
    app_dir = str(Path(next(iter(spec.submodule_search_locations))).parent)
    limit = float(
        os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        or DEFAULT_STARTUP_SECONDS
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "prefect-server.log"
    process: subprocess.Popen[bytes] | None = None
    url = ""
    with open(log_path, "ab") as log:
        for _attempt in range(3):  # another process may take the free port first
            port = _free_port()
            url = f"http://127.0.0.1:{port}/api"
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory"),
                    "prefect.server.api.server:create_app",
                    *("--host", "127.0.0.1", "--port", str(port)),
                    *("--log-level", "error", "--lifespan", "on"),
                ],
                env={**os.environ, **QUIET_SERVER_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C in the terminal reaches this command, which then
                # stops the server once the flow run has recorded how it ended.
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            progress(f"prefect: starting a server for this command on {url} (log {log_path})")
            started = time.monotonic()
            while process.poll() is None and not _healthy(url):
                if time.monotonic() - started > limit:
                    process.kill()
                    raise ShardflowError(
                        f"the Prefect server for this command did not answer within {limit:.0f} "
                        f"s (see {log_path}); set PREFECT_API_URL to a running server"
                    )
                time.sleep(0.5)
            if process.poll() is None:
                break
        else:
            raise ShardflowError(
                f"the Prefect server for this command did not start: see {log_path}"
            )
    assert process is not None
    os.environ["PREFECT_API_URL"] = url
    try:
        yield url
    finally:
        _send_what_prefect_holds()
        os.environ.pop("PREFECT_API_URL", None)
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
