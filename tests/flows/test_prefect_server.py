"""The flows against a real Prefect server: runs, task runs, artifacts, schedules, the UI."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Result
from tests.prefect_server import BIN, shardflow_server

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "prefect-flow-run.png"


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`shardflow server` on a free loopback port; yields its base URL."""
    home = tmp_path_factory.mktemp("prefect-server")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        # Schedule runs every few seconds so that a test need not wait a minute.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    }
    with shardflow_server(env, home / "server.log", start_seconds=120) as url:
        yield url


def chromium_command(tmp_path: Path) -> list[str]:
    """Headless Chromium with nothing reaching outside this machine."""
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1440,1000",
        "--virtual-time-budget=30000",
    ]


def call(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request to the Prefect server, tried again on 503 as Prefect's own client does: the
    server answers 503 when its SQLite database is locked by another writer (in the full suite,
    under load, a PATCH of a concurrency limit got one)."""
    for attempt in range(6):
        response = httpx.request(method, url, timeout=30, **kwargs)
        if response.status_code != 503:
            break
        time.sleep(0.5 * 2**attempt)
    response.raise_for_status()
    return response


def api(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    return call("POST", f"{url}/api{path}", json=body or {}).json()


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """Stop a `prefect worker start` and everything it started. Its first SIGTERM means "finish
    the flow runs in flight, take no new ones" (prefect.utilities.processutils'
    setup_signal_handlers_worker), which outlasted 30 s when a scheduled run had just started;
    a second SIGTERM is its way to kill it, then the rest of its process group goes."""
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def test_pipeline_run_is_recorded_with_task_runs_and_artifacts(
    prefect_server: str,
    shardflow: Callable[..., Result],
    fashion_subset: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", f"{prefect_server}/api")
    run = shardflow(
        "run",
        "fashion-mnist",
        "--source",
        str(fashion_subset),
        "--np",
        "2",
        "--epochs",
        "2",
        "--json",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    flow_run_id = run.json["flow_run_id"]

    flows = {f["id"]: f["name"] for f in api(prefect_server, "/flows/filter")}
    runs = api(prefect_server, "/flow_runs/filter")
    by_flow = {flows[r["flow_id"]]: r for r in runs}
    assert set(by_flow) == {
        "shardflow-pipeline",
        "shardflow-ingest",
        "shardflow-preprocess",
        "shardflow-train",
    }
    assert {r["state_type"] for r in runs} == {"COMPLETED"}
    assert by_flow["shardflow-pipeline"]["id"] == flow_run_id

    task_runs = api(prefect_server, "/task_runs/filter")
    names = sorted(t["name"] for t in task_runs)
    # One task run per pass of each job (ingest: fetch; preprocess: verify, its raw files
    # against the manifest, then write, straight from the IDX files), however many Dask tasks
    # each ran; horovodrun; and the task run Prefect puts in the pipeline's flow run for each
    # subflow.
    assert [n for n in names if not n.startswith(("horovodrun-", "shardflow-"))] == [
        "fetch",
        "verify",
        "write",
    ], names
    assert len([n for n in names if n.startswith("horovodrun-")]) == 1, names
    assert [n for n in names if n.startswith("shardflow-")] == [
        "shardflow-ingest-0",
        "shardflow-preprocess-0",
        "shardflow-train-0",
    ]
    assert {t["state_type"] for t in task_runs} == {"COMPLETED"}

    artifacts = api(prefect_server, "/artifacts/filter")
    kinds = {a["type"] for a in artifacts}
    assert {"progress", "table", "markdown"} <= kinds
    curves = [a for a in artifacts if a["key"] == "fashion-mnist-cnn-curves"]
    assert curves and "data:image/png;base64," in curves[0]["data"]
    progress = [a for a in artifacts if a["key"] == "fashion-mnist-preprocess-progress"]
    assert progress and progress[0]["data"] == 100.0
    # Each rank's input, published while training ran: one version of the table per epoch.
    by_epoch = [a for a in artifacts if a["key"] == "fashion-mnist-cnn-input-by-epoch"]
    assert len(by_epoch) == 2, [a["key"] for a in artifacts]
    assert all(a["type"] == "table" for a in by_epoch)

    # The UI's page of this flow run, rendered by headless Chromium: the rendered DOM names
    # the run and its flow, and the screenshot is a picture of it.
    chromium = chromium_command(tmp_path)
    page = f"{prefect_server}/runs/flow-run/{flow_run_id}"
    dom = subprocess.run(
        [*chromium, "--dump-dom", page],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert by_flow["shardflow-pipeline"]["name"] in dom
    assert "shardflow-pipeline" in dom
    assert "Can't connect to Server API" not in dom
    screenshot = tmp_path / "flow-run.png"
    subprocess.run(
        [*chromium, f"--screenshot={screenshot}", page],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table artifact of the preprocess run: one row per Parquet shard.
    shards_table = next(a for a in artifacts if a["key"] == "fashion-mnist-shards")
    artifacts_page = f"{prefect_server}/artifacts/artifact/{shards_table['id']}"
    dom = subprocess.run(
        [*chromium, "--dump-dom", artifacts_page],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "fashion-mnist-shards" in dom
    assert "split=train/part-00000.parquet" in dom
    artifacts_shot = tmp_path / "artifacts.png"
    subprocess.run(
        [*chromium, f"--screenshot={artifacts_shot}", artifacts_page],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert artifacts_shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SHARDFLOW_UPDATE_DOCS"):
        shutil.copy(screenshot, DOCS_SCREENSHOT)
        shutil.copy(artifacts_shot, DOCS_SCREENSHOT.with_name("prefect-artifacts.png"))


def test_deploy_limits_scheduled_runs_to_one_and_skyserver_to_one_ingest(
    prefect_server: str,
    shardflow: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the server reports them: each scheduled deployment runs one flow run at a time (a
    night waits for the last one), the on-demand ones are unlimited; the global limit
    `skyserver` has 1 slot, and a second deploy keeps a limit an operator changed."""
    monkeypatch.setenv("PREFECT_API_URL", f"{prefect_server}/api")
    deployed = shardflow("deploy", "--json")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert deployed.json["global_concurrency_limits"] == ["skyserver"]
    flows = {f["id"]: f["name"] for f in api(prefect_server, "/flows/filter")}
    limits = {
        f"{flows[d['flow_id']]}/{d['name']}": (d["global_concurrency_limit"] or {}).get("limit")
        for d in api(prefect_server, "/deployments/filter")
        if flows[d["flow_id"]].startswith("shardflow-")
    }
    assert limits == {
        "shardflow-pipeline/nightly-sdss": 1,
        "shardflow-ingest/nightly": 1,
        "shardflow-catalog-verify/nightly": 1,
        "shardflow-pipeline/weekly": 1,
        "shardflow-preprocess/on-demand": None,
        "shardflow-train/on-demand": None,
    }
    url = f"{prefect_server}/api/v2/concurrency_limits/skyserver"
    skyserver = call("GET", url).json()
    assert (skyserver["limit"], skyserver["active"]) == (1, True)
    call("PATCH", url, json={"limit": 3})
    assert shardflow("deploy", "--json").returncode == 0
    assert call("GET", url).json()["limit"] == 3


def test_deployment_runs_on_its_schedule_under_a_worker(
    prefect_server: str,
    shardflow: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
    shardflow_home: Path,
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", f"{prefect_server}/api")
    deployed = shardflow("deploy", "--json")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert "shardflow-catalog-verify/nightly" in deployed.json["deployments"]
    subprocess.run(
        [
            str(BIN / "prefect"),
            "--no-prompt",
            "deployment",
            "schedule",
            "create",
            "shardflow-catalog-verify/nightly",
            "--interval",
            "10",
        ],
        check=True,
        capture_output=True,
        env={**os.environ},
        timeout=60,
    )
    deployment = next(
        d
        for d in api(prefect_server, "/deployments/filter")
        if d["name"] == "nightly" and d["entrypoint"].endswith(":catalog_verify_flow")
    )
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "shardflow-process"],
        env={**os.environ, "SHARDFLOW_HOME": str(shardflow_home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        completed: list[dict[str, Any]] = []
        while not completed and time.monotonic() < deadline:
            # One request a poll (5 s apart, a run was seen ended 2.5 s late on average).
            time.sleep(1)
            runs = api(
                prefect_server,
                "/flow_runs/filter",
                {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}},
            )
            failed = [r for r in runs if r["state_type"] in ("FAILED", "CRASHED")]
            assert not failed, failed[0]["state"]
            completed = [r for r in runs if r["state_type"] == "COMPLETED"]
        assert completed, "no scheduled run of the deployment completed within 180 s"
        assert completed[0]["auto_scheduled"] is True
    finally:
        # The server lives for the module: its scheduler must not hand the next test's worker
        # a run of this deployment every 10 s.
        url = f"{prefect_server}/api/deployments/{deployment['id']}"
        for schedule in call("GET", url).json()["schedules"]:
            if schedule["schedule"].get("interval") == 10:
                httpx.delete(f"{url}/schedules/{schedule['id']}", timeout=30).raise_for_status()
        stop_worker(worker)


def test_the_pipeline_deployment_trains_sdss_with_its_own_model(
    prefect_server: str,
    shardflow: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
    shardflow_home: Path,
    tmp_path: Path,
) -> None:
    """The weekly pipeline deployment run for sdss, its exports given as a parameter, under a
    real worker: the registry's default model for sdss (dnn), not the images' cnn."""
    monkeypatch.setenv("PREFECT_API_URL", f"{prefect_server}/api")
    exports = tmp_path / "exports"
    made = shardflow("synth", "sdss", "--rows", "6000", "--files", "2", "--out", str(exports))
    assert made.returncode == 0, made.stderr
    deployed = shardflow("deploy", "--json")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    parameters = {
        "dataset": "sdss",
        "source": str(exports),
        "options": {"plan": {"rank_multiple": 8, "target_rows_per_group": 200}},
        "train": {"num_ranks": 1, "epochs": 1, "batch_size": 64},
    }
    started = subprocess.run(
        [
            str(BIN / "prefect"),
            "--no-prompt",
            "deployment",
            "run",
            "shardflow-pipeline/weekly",
            "--params",
            json.dumps(parameters),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=120,
    )
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout)
    assert flow_run_id, started.stdout
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "shardflow-process"],
        env={**os.environ, "SHARDFLOW_HOME": str(shardflow_home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900
        state = ""
        while time.monotonic() < deadline:
            # One GET a poll (5 s apart, the run was seen ended 2.5 s late on average).
            time.sleep(0.5)
            run = call("GET", f"{prefect_server}/api/flow_runs/{flow_run_id.group(1)}").json()
            state = run["state_type"]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
        assert state == "COMPLETED", run["state"]
    finally:
        stop_worker(worker)
    models = shardflow("catalog", "show", "sdss-dnn", "--json")
    assert models.returncode == 0, models.stderr
    assert models.json["schema"]["model"] == "dnn"
    assert models.json["parents"][0]["name"] == "sdss-processed"


class _Throttled(http.server.SimpleHTTPRequestHandler):
    """Serves files at about 300 KB/s each while ``slow`` is set: an ingest slow enough to
    watch; at full speed once cleared (the rest of the ingest is only waited for)."""

    slow: threading.Event

    def copyfile(self, source: Any, outputfile: Any) -> None:
        while chunk := source.read(16_384):
            outputfile.write(chunk)
            if self.slow.is_set():
                time.sleep(0.05)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_running_ingest_shows_its_progress(
    prefect_server: str, shardflow: Callable[..., Result], shardflow_home: Path, tmp_path: Path
) -> None:
    """The ingest flow's progress artifact while the ingest runs (not only at 100 %), on its
    page in the UI, rendered by headless Chromium."""
    exports = tmp_path / "exports"
    made = shardflow("synth", "sdss", "--rows", "40000", "--files", "8", "--out", str(exports))
    assert made.returncode == 0, made.stderr
    slow = threading.Event()
    slow.set()
    handler = type("Handler", (_Throttled,), {"slow": slow})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(exports))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    source = f"http://127.0.0.1:{server.server_address[1]}/"
    script = (
        "import sys; from flows.pipeline import ingest_flow; "
        "ingest_flow(dataset='sdss', home=sys.argv[1], source=sys.argv[2])"
    )
    flow = subprocess.Popen(
        [sys.executable, "-c", script, str(shardflow_home), source],
        env={**os.environ, "PREFECT_API_URL": f"{prefect_server}/api"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        part_way = None
        while part_way is None and time.monotonic() < deadline and flow.poll() is None:
            time.sleep(0.5)
            found = api(
                prefect_server,
                "/artifacts/filter",
                {"artifacts": {"key": {"any_": ["sdss-ingest-progress"]}}},
            )
            part_way = next((a for a in found if 0 < float(a["data"] or 0) < 100), None)
        assert part_way is not None, "no progress between 0 and 100 % was seen"
        page = f"{prefect_server}/artifacts/artifact/{part_way['id']}"
        chromium = chromium_command(tmp_path)
        dom = subprocess.run(
            [*chromium, "--dump-dom", page],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert "sdss-ingest-progress" in dom
        assert "convert:" in dom  # the description: tasks, rows, MB/s, ETA
        shot = tmp_path / "ingest-progress.png"
        subprocess.run(
            [*chromium, f"--screenshot={shot}", page],
            check=True,
            capture_output=True,
            timeout=120,
        )
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # Seen part way and on its page: the rest of the 16 MB need not take 40 s more.
        slow.clear()
        assert flow.wait(timeout=600) == 0, flow.stderr.read() if flow.stderr else ""
    finally:
        if flow.poll() is None:
            flow.kill()
        server.shutdown()
        server.server_close()
    finished = api(
        prefect_server,
        "/artifacts/filter",
        {
            "artifacts": {
                "key": {"any_": ["sdss-ingest-convert"]},
                # This run's: the weekly pipeline deployment's run ingested sdss too.
                "flow_run_id": {"any_": [part_way["flow_run_id"]]},
            }
        },
    )
    # The pass's table, once: its totals and its slowest tasks.
    assert len(finished) == 1
    data = finished[0]["data"]
    assert (json.loads(data) if isinstance(data, str) else data)[0]["task"] == "all 8 tasks"
    if os.environ.get("SHARDFLOW_UPDATE_DOCS"):
        shutil.copy(shot, DOCS_SCREENSHOT.with_name("prefect-ingest-progress.png"))
