"""`shardflow server` (a local Prefect server and UI) and `shardflow deploy` (the deployments
and schedules of deploy/prefect.yaml)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError
from flows.console import Context, interrupt_handled
from flows.options import whole_number
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
    """Run a local Prefect server (API + UI) in the foreground until Ctrl-C or SIGTERM."""
    url = f"http://{args.host}:{args.port}"
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": QUIET_SERVER_ENV["PREFECT_SERVER_ANALYTICS_ENABLED"],
        # The UI asks this URL for its data; Prefect's default assumes port 4200.
        "PREFECT_UI_API_URL": f"{url}/api",
    }
    print(
        f"Prefect UI {url} ; in other shells: export PREFECT_API_URL={url}/api",
        file=sys.stderr,
        flush=True,
    )
    # Its own session: a Ctrl-C in the terminal reaches this command only, which stops the
    # server (SIGINT: uvicorn's graceful shutdown); SIGTERM to this command does the same
    # (flows.cli.main); a killed command takes the server with it (die_with_parent).
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", args.host, "--port", str(args.port)],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        return server.wait()
    except KeyboardInterrupt:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        interrupt_handled()
        return 0


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
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_names = {f.id: f.name for f in client.read_flows()}
        names = sorted(
            f"{flow_names[d.flow_id]}/{d.name}"
            for d in client.read_deployments()
            if flow_names.get(d.flow_id, "").startswith("shardflow-")
        )
    ctx.emit(
        {"work_pool": POOL, "deployments": names},
        [f"deployed {name}" for name in names]
        + [f"start a worker: prefect worker start --pool {POOL}"],
    )
    return 0


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    server = commands.add_parser(
        "server",
        parents=[common],
        help="run a local Prefect server and UI (loopback, analytics off)",
    )
    server.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    server.add_argument("--port", type=whole_number, default=4200, help="default: 4200")
    server.set_defaults(handler=cmd_server)

    deploy = commands.add_parser(
        "deploy", parents=[common], help="register the Prefect deployments of deploy/prefect.yaml"
    )
    deploy.set_defaults(handler=cmd_deploy)
