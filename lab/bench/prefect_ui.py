"""`bench prefect-ui`: a run of many tasks, watched in both of Prefect's UIs.

a Prefect server (API and both UIs, SQLite; lab.bench.prefect.prefect_server)
  ├─ flows.pipeline.ingest_flow of --files synthetic SDSS exports: a Dask task per file
  ├─ with --preprocess, then flows.pipeline.preprocess_flow of that raw version
  └─ the same of SMALL_FILES exports (the "-small" runs): the pages at no size
what each run left in the server's database (task runs, events, artifact versions, logs)
headless Chromium (lab.bench.browser), a fresh browser per load:
  V1 /runs/flow-run/<id>, V2 /v2/runs/flow-run/<id>, and each UI's page of the run's
  table of its largest pass, every page of every run in each of PAGE_ROUNDS rounds
per page: seconds until it shows the run's name, its state and its first log line (the table
page: its key and its slowest task), and ÷ the small run's; the longest freeze of its main
thread; bytes downloaded; the browser's memory; a screenshot
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
# The same flows of this many exports, beside the large run: what its pages cost at no size.
SMALL = "small"
SMALL_FILES = 20
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


def _pages(
    server: PrefectServer, run: dict[str, Any], artifacts: list[dict[str, Any]], last_pass: str
) -> dict[str, Any]:
    """Each UI's flow-run page of ``run`` and its page of the ``last_pass`` table: the URL and
    what the page shows once usable.

    A flow-run page is usable once it shows the run's name, its state and its first log line:
    the V2 UI draws only the log lines in view, so a pass's closing line further down is not on
    the page until one scrolls (its 26 lines of a 20,000-file preprocess run)."""
    base = server.url.removesuffix("/api")
    opening = f"Beginning flow run '{run['name']}'"
    (table,) = [a for a in artifacts if a["key"].endswith(f"-{last_pass}")]
    return {
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


def _watch(pages: dict[str, dict[str, Any]], screenshots: Path) -> dict[str, dict[str, Any]]:
    """Every page of every run, loaded in PAGE_ROUNDS alternated rounds (a fresh browser each
    load, nothing else of the bench running): per run and page, the figures of the fastest
    load, each load's seconds to usable (None: not within 120 s), a screenshot of the last;
    a large run's page also its fastest load ÷ the small run's (``usable_vs_small``)."""
    loads: dict[str, dict[str, list[Any]]] = {run: {} for run in pages}
    for n in range(PAGE_ROUNDS):
        for run, run_pages in pages.items():
            for page, (url, expect) in run_pages.items():
                shot = screenshots / f"{run}-{page}.png" if n == PAGE_ROUNDS - 1 else None
                loads[run].setdefault(page, []).append(load_page(url, expect, screenshot=shot))
    watched: dict[str, dict[str, Any]] = {}
    for run, run_loads in loads.items():
        watched[run] = {}
        for page, each in run_loads.items():
            best = min(each, key=lambda load: load.usable_seconds or float("inf"))
            watched[run][page] = {
                **as_json(best),
                "screenshot": str(screenshots / f"{run}-{page}.png"),
                "usable_seconds_each": [load.usable_seconds for load in each],
            }
    for run, run_pages in watched.items():
        small = watched.get(f"{run}-{SMALL}", {})
        for page, figures in run_pages.items():
            base = small.get(page, {}).get("usable_seconds")
            if base and figures["usable_seconds"]:
                figures["usable_vs_small"] = figures["usable_seconds"] / base
    return watched


def bench_prefect_ui(
    *,
    files: int,
    rows: int,
    preprocess: bool,
    screenshots: Path,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """The ingest (and preprocess) flows of ``files`` exports and of SMALL_FILES of them, on one
    server; then their pages, watched side by side."""
    from preprocessing.sources.synth import write_sdss_exports

    screenshots.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"files": files, "rows": rows, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-prefect-ui-") as tmp:
        scratch = Path(tmp)
        per_file = max(1, rows // files)
        sizes = {"": (files, rows), f"-{SMALL}": (SMALL_FILES, SMALL_FILES * per_file)}
        sources = {
            suffix: write_sdss_exports(
                scratch / f"exports{suffix}", rows=total, files=count, fmt="csv", seed=0
            )[0].parent
            for suffix, (count, total) in sizes.items()
        }
        progress(f"bench prefect-ui: {rows:,} rows in {files:,} CSV exports, and {SMALL_FILES}")
        with prefect_server(scratch, progress) as server:
            pages = {}
            before = server.rows()
            for suffix, source in sources.items():
                home = scratch / f"home{suffix}"
                env = {
                    **os.environ,
                    "SHARDFLOW_HOME": str(home),
                    "PREFECT_API_URL": server.url,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                }
                flows = [("ingest", [INGEST_FLOW, str(source)], "convert")]
                if preprocess:
                    flows.append(("preprocess", [PREPROCESS_FLOW, str(home)], "write"))
                for stage, (script, *args), last_pass in flows:
                    label = stage + suffix
                    log = scratch / f"{label}.log"
                    seconds = _run([sys.executable, "-c", script, *args], env, log)
                    after = server.settled_rows()
                    run = _latest_flow_run(server)
                    artifacts = _artifacts(server, run)
                    progress(f"bench prefect-ui: {label} flow run {run['name']} in {seconds:.0f} s")
                    results["runs"][label] = {
                        "flow_run": run["name"],
                        "seconds": seconds,
                        "dask_tasks": _pass_tasks(run, artifacts, last_pass),
                        "database": {k: v - before.get(k, 0) for k, v in after.items()},
                    }
                    pages[label] = _pages(server, run, artifacts, last_pass)
                    before = after
            progress(f"bench prefect-ui: {PAGE_ROUNDS} rounds of {len(pages) * 4} pages")
            for label, watched in _watch(pages, screenshots).items():
                results["runs"][label]["pages"] = watched
            results["database_after"] = server.rows()
    results["load_average"] = os.getloadavg()
    return results


def _artifacts(server: PrefectServer, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every artifact of ``run``."""
    found = _api(server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    return list(found)


def _pass_tasks(
    run: dict[str, Any], artifacts: list[dict[str, Any]], last_pass: str
) -> dict[str, int]:
    """The Dask tasks each pass of ``run`` ran, from its pass tables ("all N tasks")."""
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
