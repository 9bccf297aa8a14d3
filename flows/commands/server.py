"""`shardflow server` (a local Prefect server and UI) and `shardflow deploy` (the deployments
and schedules of deploy/prefect.yaml)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError
from flows.console import Context, interrupt_handled
from flows.options import port_number
from flows.prefect_server import QUIET_SERVER_ENV, die_with_parent
from preprocessing import datasets

POOL = "shardflow-process"
PREFECT = str(Path(sys.executable).parent / "prefect")


def _repository() -> Path:
    """The checkout the flows are loaded from (deployments point workers at it)."""
    import flows

    root = Path(flows.__file__).resolve().parent.parent
    if not (root / "deploy" / "prefect.yaml").exists():
        raise ShardflowError(
            f"{root} has no deploy/prefect.yaml: deploy from a checkout (pip install -e .)"
        )
    return root


def _prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [PREFECT, "--no-prompt", *args], capture_output=True, text=True, cwd=_repository()
    )
    if check and proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
        raise ShardflowError(f"`prefect {' '.join(args)}` failed: {' '.join(last)}")
    return proc


def cmd_server(ctx: Context, args: argparse.Namespace) -> int:
    """Run a local Prefect server (API + UI) in the foreground until Ctrl-C or SIGTERM.

    The address is checked first (a port in use, a host that is not this machine's: one line),
    and where the server is is printed only once it answers ``/api/health``; its own output
    goes to ``$SHARDFLOW_HOME/logs/prefect-server-<port>.log``."""
    _check_address(args.host, args.port)
    url = f"http://{_url_host(args.host)}:{args.port}"
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": QUIET_SERVER_ENV["PREFECT_SERVER_ANALYTICS_ENABLED"],
        # The UI asks this URL for its data; Prefect's default assumes port 4200.
        "PREFECT_UI_API_URL": f"{url}/api",
    }
    log_dir = ctx.settings.home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"prefect-server-{args.port}.log"
    # Its own session: a Ctrl-C in the terminal reaches this command only, which stops the
    # server (SIGINT: uvicorn's graceful shutdown); SIGTERM to this command does the same
    # (flows.cli.main); a killed command takes the server with it (die_with_parent).
    with open(log_path, "ab") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", args.host, "--port", str(args.port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    try:
        _wait_until_it_answers(server, f"{_probe_url(args.host)}:{args.port}/api", log_path)
        print(
            f"Prefect UI {url} ; in other shells: export PREFECT_API_URL={url}/api "
            f"(server log: {log_path})",
            file=sys.stderr,
            flush=True,
        )
        return server.wait()
    except BaseException as exc:
        _stop(server)
        if isinstance(exc, KeyboardInterrupt):
            interrupt_handled()
            return 0
        raise


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _check_address(host: str, port: int) -> None:
    """Refuse in one line an address the server could not listen on: a host that is not an
    address of this machine, a port in use (by another server) or reserved."""
    import errno
    import socket

    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ShardflowError(f"--host {host!r} is not a host name or address ({exc})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ShardflowError(
                    f"port {port} on {host} is in use by another process (another server?): "
                    "stop it, or choose another --port"
                ) from None
            if exc.errno == errno.EACCES:
                raise ShardflowError(
                    f"port {port} is reserved for root: choose --port 1024 or above"
                ) from None
            raise ShardflowError(
                f"--host {host} is not an address of this machine ({exc.strerror}): give one "
                "of its addresses, 127.0.0.1, or 0.0.0.0 for all"
            ) from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _probe_url(host: str) -> str:
    """Where this machine reaches the server: a wildcard host is reached on loopback."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{_url_host(local)}"


def _wait_until_it_answers(server: subprocess.Popen[bytes], api: str, log_path: Path) -> None:
    from flows.prefect_server import DEFAULT_STARTUP_SECONDS, _healthy

    limit = float(
        os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        or DEFAULT_STARTUP_SECONDS
    )
    started = time.monotonic()
    while not _healthy(api, timeout=5):
        if server.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            last = lines[-1].strip() if lines else "no output"
            raise ShardflowError(
                f"the Prefect server did not start (exit {server.returncode}: {last}); see "
                f"{log_path}"
            )
        if time.monotonic() - started > limit:
            raise ShardflowError(
                f"the Prefect server did not answer {api}/health within {limit:.0f} s; see "
                f"{log_path}"
            )
        time.sleep(0.5)


# Where the nightly SDSS deployment finds its exports (deploy/prefect.yaml's placeholder).
SDSS_INBOX_ENV = "SHARDFLOW_SDSS_INBOX"


def _check_deployment_datasets(prefect_yaml: Path) -> None:
    """Every deployment's ``dataset`` parameter must be one the registry knows."""
    import yaml

    spec = yaml.safe_load(prefect_yaml.read_text())
    for deployment in spec.get("deployments", []):
        name = (deployment.get("parameters") or {}).get("dataset")
        if name is not None and name not in datasets.DATASETS:
            raise ShardflowError(
                f"{prefect_yaml}: deployment {deployment.get('name')!r} names dataset {name!r}; "
                f"known: {', '.join(datasets.NAMES)}"
            )


def cmd_deploy(ctx: Context, args: argparse.Namespace) -> int:
    """Create the process work pool and register deploy/prefect.yaml's deployments."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ShardflowError(
            "PREFECT_API_URL is not set: start a server (`shardflow server`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api, or point it at a shared server"
        )
    _check_deployment_datasets(_repository() / "deploy" / "prefect.yaml")
    if not os.environ.get(SDSS_INBOX_ENV):
        # The nightly SDSS deployment's source (deploy/prefect.yaml): an inbox in the home.
        inbox = ctx.settings.home / "inbox" / "sdss"
        inbox.mkdir(parents=True, exist_ok=True)
        os.environ[SDSS_INBOX_ENV] = str(inbox)
    ctx.progress(f"nightly-sdss ingests the exports in {os.environ[SDSS_INBOX_ENV]}")
    existing = _prefect("work-pool", "inspect", POOL, check=False)
    if existing.returncode != 0:
        _prefect("work-pool", "create", POOL, "--type", "process")
        ctx.progress(f"created work pool {POOL}")
    _prefect("deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
    _create_skyserver_limit(ctx)
    from prefect.client.orchestration import get_client

    from flows.pipeline import SKYSERVER_LIMIT

    with get_client(sync_client=True) as client:
        flow_names = {f.id: f.name for f in client.read_flows()}
        names = sorted(
            f"{flow_names[d.flow_id]}/{d.name}"
            for d in client.read_deployments()
            if flow_names.get(d.flow_id, "").startswith("shardflow-")
        )
    ctx.emit(
        {"work_pool": POOL, "deployments": names, "global_concurrency_limits": [SKYSERVER_LIMIT]},
        [f"deployed {name}" for name in names]
        + [f"start a worker: prefect worker start --pool {POOL}"],
    )
    return 0


def _create_skyserver_limit(ctx: Context) -> None:
    """The global concurrency limit every flow run's SkyServer ingest holds a slot of
    (:data:`flows.pipeline.SKYSERVER_LIMIT`); one an operator already set is kept as it is."""
    from flows.pipeline import SKYSERVER_LIMIT

    existing = _prefect("global-concurrency-limit", "inspect", SKYSERVER_LIMIT, check=False)
    if existing.returncode != 0:
        _prefect(
            "global-concurrency-limit", "create", SKYSERVER_LIMIT, "--limit", str(SKYSERVER_SLOTS)
        )
        ctx.progress(
            f"created global concurrency limit {SKYSERVER_LIMIT} ({SKYSERVER_SLOTS} SkyServer "
            "ingest at a time)"
        )


# SkyServer is a shared public service: one ingest from it at a time, across every flow run.
SKYSERVER_SLOTS = 1


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    server = commands.add_parser(
        "server",
        parents=[common],
        help="run a local Prefect server and UI (loopback, analytics off)",
    )
    server.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    server.add_argument("--port", type=port_number, default=4200, help="1 to 65535; default: 4200")
    server.set_defaults(handler=cmd_server)

    deploy = commands.add_parser(
        "deploy", parents=[common], help="register the Prefect deployments of deploy/prefect.yaml"
    )
    deploy.set_defaults(handler=cmd_deploy)
