"""`bench prefect-ui`: a run of many tasks, watched in both of Prefect's UIs.

a Prefect server (API and both UIs, SQLite; lab.bench.prefect.prefect_server)
  ├─ flows.pipeline.ingest_flow of --files synthetic SDSS exports: a Dask task per file
  └─ with --preprocess, then flows.pipeline.preprocess_flow of that raw version
what each run left in the server's database (task runs, events, artifact versions, logs)
headless Chromium (lab.bench.browser), a fresh browser per page:
  V1 /runs/flow-run/<id>, V2 /v2/runs/flow-run/<id>, and each UI's page of the run's
  table of its largest pass
per page, loaded PAGE_ROUNDS times (a fresh browser each): seconds until it shows the run's
name, its state and its first log line (the table page: its key and its slowest task); the
longest freeze of its main thread; bytes downloaded; the browser's memory; a screenshot
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError
from lab.bench.browser import as_json, load_page
from lab.bench.prefect import INGEST_FLOW, PrefectServer, prefect_server

Progress = Callable[[str], None]
PAGE_ROUNDS = 3
PREPROCESS_FLOW = (
    "import sys; from flows.pipeline import preprocess_flow; "
    "preprocess_flow('sdss', home=sys.argv[1])"
)


def _api(server: PrefectServer, path: str, body: dict[str, Any]) -> Any:
    import httpx

    response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def _run(argv: list[str], env: dict[str, str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "ab") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise ShardflowError(f"bench prefect-ui: a flow run failed: {' '.join(tail)}")
    return time.perf_counter() - started


def _latest_flow_run(server: PrefectServer) -> dict[str, Any]:
    (run,) = _api(server, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    return dict(run)


def _watch(
    server: PrefectServer,
    run: dict[str, Any],
    last_pass: str,
    screenshots: Path,
    label: str,
) -> dict[str, Any]:
    """Each UI's flow-run page of ``run`` and its page of the ``last_pass`` table.

    A flow-run page is usable once it shows the run's name, its state and its first log line:
    the V2 UI draws only the log lines in view, so a pass's closing line further down is not on
    the page until one scrolls (its 26 lines of a 20,000-file preprocess run)."""
    base = server.url.removesuffix("/api")
    opening = f"Beginning flow run '{run['name']}'"
    artifacts = _api(
        server,
        "/artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}},
    )
    (table,) = [a for a in artifacts if a["key"].endswith(f"-{last_pass}")]
    pages = {
        "v1_flow_run": (f"{base}/runs/flow-run/{run['id']}", [run["name"], "Completed", opening]),
        "v2_flow_run": (
            f"{base}/v2/runs/flow-run/{run['id']}",
            [run["name"], "Completed", opening],
        ),
        "v1_pass_table": (f"{base}/artifacts/artifact/{table['id']}", [table["key"], "slowest"]),
        "v2_pass_table": (
            f"{base}/v2/artifacts/artifact/{table['id']}",
            [table["key"], "slowest"],
        ),
    }
    return {
        name: _rounds(url, expect, screenshots / f"{label}-{name}.png")
        for name, (url, expect) in pages.items()
    }


def _rounds(url: str, expect: list[str], screenshot: Path) -> dict[str, Any]:
    """The page loaded PAGE_ROUNDS times, in turn with nothing else of the bench running: the
    figures of the fastest load, each load's seconds to usable (None: not within 120 s), the
    screenshot of the last."""
    loads = [
        load_page(url, expect, screenshot=screenshot if n == PAGE_ROUNDS - 1 else None)
        for n in range(PAGE_ROUNDS)
    ]
    usable = [load.usable_seconds for load in loads]
    best = min(loads, key=lambda load: load.usable_seconds or float("inf"))
    return {**as_json(best), "screenshot": str(screenshot), "usable_seconds_each": usable}


def bench_prefect_ui(
    *,
    files: int,
    rows: int,
    preprocess: bool,
    screenshots: Path,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    from preprocessing.sources.synth import write_sdss_exports

    screenshots.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"files": files, "rows": rows, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-prefect-ui-") as tmp:
        scratch = Path(tmp)
        paths = write_sdss_exports(scratch / "exports", rows=rows, files=files, fmt="csv", seed=0)
        progress(f"bench prefect-ui: {rows:,} rows in {len(paths):,} CSV exports")
        with prefect_server(scratch, progress) as server:
            env = {
                **os.environ,
                "SHARDFLOW_HOME": str(scratch / "home"),
                "PREFECT_API_URL": server.url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            }
            flows = [("ingest", [INGEST_FLOW, str(paths[0].parent)], "convert")]
            if preprocess:
                flows.append(("preprocess", [PREPROCESS_FLOW, str(scratch / "home")], "write"))
            before = server.rows()
            for label, (script, *args), last_pass in flows:
                seconds = _run([sys.executable, "-c", script, *args], env, scratch / f"{label}.log")
                after = server.settled_rows()
                run = _latest_flow_run(server)
                tasks = _pass_tasks(server, run, last_pass)
                progress(f"bench prefect-ui: {label} flow run {run['name']} in {seconds:.0f} s")
                results["runs"][label] = {
                    "flow_run": run["name"],
                    "seconds": seconds,
                    "dask_tasks": tasks,
                    "database": {k: v - before.get(k, 0) for k, v in after.items()},
                    "pages": _watch(server, run, last_pass, screenshots, label),
                }
                before = after
            results["database_after"] = server.rows()
    results["load_average"] = os.getloadavg()
    return results


def _pass_tasks(server: PrefectServer, run: dict[str, Any], last_pass: str) -> dict[str, int]:
    """The Dask tasks each pass of ``run`` ran, from its pass tables ("all N tasks")."""
    artifacts = _api(
        server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
    )
    counts: dict[str, int] = {}
    for artifact in artifacts:
        if artifact["type"] != "table":
            continue
        data = artifact["data"]
        table = json.loads(data) if isinstance(data, str) else data
        if table and str(table[0].get("task", "")).startswith("all "):
            name = artifact["key"].rsplit("-", 1)[-1]
            counts[name] = int(str(table[0]["task"]).split()[1].replace(",", ""))
    if last_pass not in counts:
        raise ShardflowError(f"bench prefect-ui: no table of pass {last_pass} in {run['name']}")
    return counts
