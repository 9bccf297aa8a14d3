"""The nightly SDSS deployment (deploy/prefect.yaml) run by a real worker against a real Prefect
server, night after night: the first night commits, a night with nothing new commits nothing,
and a night with one new export does that export's work only."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Result
from tests.flows.test_prefect_server import BIN, prefect_server, stop_worker

pytestmark = pytest.mark.e2e
__all__ = ["prefect_server"]  # the fixture, for this module

# Small enough for a test: one rank, one epoch.
PARAMETERS = {
    "options": {"plan": {"rank_multiple": 4, "target_rows_per_group": 100}},
    "train": {"num_ranks": 1, "epochs": 1, "batch_size": 64},
}


def _night(server: str, home: Path) -> dict[str, Any]:
    """One run of the nightly deployment, under a worker; the flow run when it ends."""
    started = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", "deployment", "run",
         "shardflow-pipeline/nightly-sdss", "--params", json.dumps(PARAMETERS)],
        check=True, capture_output=True, text=True, env={**os.environ}, timeout=120,
    )  # fmt: skip
    found = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout)
    assert found, started.stdout
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "shardflow-process"],
        env={**os.environ, "SHARDFLOW_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            # One GET a poll: polled every 3 s, a night was seen ended 1.5 s late on average.
            time.sleep(0.5)
            run: dict[str, Any] = httpx.get(
                f"{server}/api/flow_runs/{found.group(1)}", timeout=30
            ).json()
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
        assert run["state_type"] == "COMPLETED", run["state"]
        return run
    finally:
        stop_worker(worker)


def _artifacts(server: str) -> int:
    """The table and markdown artifacts the server holds (progress bars apart: one a stage)."""
    kinds = {"artifacts": {"type": {"any_": ["table", "markdown"]}}}
    return int(httpx.post(f"{server}/api/artifacts/count", json=kinds, timeout=30).json())


def _versions(shardflow: Callable[..., Result]) -> dict[str, tuple[int, str]]:
    """(versions, the latest) of every dataset and model in the catalog."""
    listed = shardflow("catalog", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return {d["name"]: (d["versions"], d["latest"]) for d in listed.json["datasets"]}


def test_the_nightly_deployment_does_only_what_is_new(
    prefect_server: str,
    shardflow: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
    shardflow_home: Path,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", f"{prefect_server}/api")
    inbox = tmp_path / "inbox"
    made = shardflow("synth", "sdss", "--rows", "6000", "--files", "2", "--out", str(inbox))
    assert made.returncode == 0, made.stderr
    monkeypatch.setenv("SHARDFLOW_SDSS_INBOX", str(inbox))
    deployed = shardflow("deploy", "--json")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert "shardflow-pipeline/nightly-sdss" in deployed.json["deployments"]

    first = _night(prefect_server, shardflow_home)
    committed = _versions(shardflow)
    assert {k: v[0] for k, v in committed.items()} == {
        "sdss": 1,
        "sdss-processed": 1,
        "sdss-dnn": 1,
    }

    published = _artifacts(prefect_server)
    assert published > 0
    second = _night(prefect_server, shardflow_home)
    assert _versions(shardflow) == committed  # nothing new: nothing committed
    assert _artifacts(prefect_server) == published  # nor published again
    took = (first["total_run_time"], second["total_run_time"])
    print(f"nightly: first night {took[0]:.1f} s, then nothing new {took[1]:.1f} s")

    more = tmp_path / "more"
    made = shardflow("synth", "sdss", "--rows", "3000", "--out", str(more), "--seed", "9")
    assert made.returncode == 0, made.stderr
    shutil.copy(next(more.glob("*.csv")), inbox / "sdss-synthetic-0002.csv")
    _night(prefect_server, shardflow_home)
    grown = _versions(shardflow)
    assert {k: v[0] for k, v in grown.items()} == {"sdss": 2, "sdss-processed": 2, "sdss-dnn": 2}
    raw = shardflow("catalog", "show", "sdss", "--json").json
    assert [n["reused"] for n in raw["extra"]["inputs"]] == [True, True, False]
    processed = shardflow("catalog", "show", "sdss-processed", "--json").json
    assert processed["extra"]["run"].get("incremental", {}).get("pieces_new") == 1, (
        processed["extra"],
        processed["code_version"],
        processed["parameters"],
    )
