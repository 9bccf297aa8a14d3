"""The Prefect server `shardflow run` starts when no PREFECT_API_URL names one: it starts on a
machine whose cores are all busy, serves a flow run, and dies with the command however the
command ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, sys, time
from pathlib import Path
from flows.prefect_server import api_for_this_command
home = Path(sys.argv[1])
with api_for_this_command(home / "logs") as url:
    print(json.dumps({"url": url}), flush=True)
    from flows.pipeline import catalog_verify_flow
    print(json.dumps(catalog_verify_flow(home=str(home))), flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """Two busy processes per core, as long as the test runs."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    return env


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_flow_runs_on_the_command_server_while_every_core_is_busy(
    tmp_path: Path, cpu_hog: None
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "home")],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    url, verified = lines[0]["url"], lines[1]
    assert verified == {"ok": True, "versions": 0}
    assert not _answers(url)  # stopped with the command


def test_the_command_server_dies_with_a_killed_command(tmp_path: Path) -> None:
    command = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "home"), "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(tmp_path),
    )
    assert command.stdout is not None
    url = json.loads(command.stdout.readline())["url"]
    assert _answers(url)
    command.send_signal(signal.SIGKILL)
    command.wait()
    deadline = time.monotonic() + 30
    while _answers(url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _answers(url), "the server outlived the SIGKILLed command"
