"""`bench prefect`: the Prefect flow path ÷ the plain path, side by side in one run.

    a Prefect server (API + UI; SQLite under a scratch PREFECT_HOME), started once
      sdss           plain ─ `shardflow ingest sdss --source DIR`
                     flow  ─ flows.pipeline.ingest_flow("sdss", source=DIR), on the server
      fashion-mnist  plain ─ `shardflow ingest`, `preprocess`, `train` one after the other
                     flow  ─ `shardflow run` (the pipeline flow), on the server
      sdss --split   import ─ the plain side's command in a process that first imported
                              flows.pipeline (Prefect, as a flow process has it), no server
    rounds alternate the sides (plain, flow, flow, plain, ...; with --split each round another
    order of the three), each in a fresh SHARDFLOW_HOME

With --split, the flow's extra cost at the medians is split in two: import minus plain is what
importing Prefect costs a process; flow minus import is what the flow run costs on top of it (the
engine, its API calls, the server's share).

Each side is measured as a user runs it, from outside: a fresh process, its wall seconds, the
CPU seconds of it and of every process it waited for (``os.wait4``: its Dask workers,
horovodrun's ranks), and for the flow side the Prefect server's CPU seconds while it ran, plus
what the server spent above its idle rate (measured first) until it had written everything the
run sent (events are written in batches, seconds after they arrive). After each flow round the
rows and bytes of the server's SQLite database are counted: what one run leaves behind. The
machines are shared: each side's best round gives the ratios, the medians of each side's rounds
give them again (one lucky round moves the first, not the second), and so do the ratios within
each turn (its sides' rounds one after the other: the machine's pace drifts less within a turn
than across a run), their median, least and most; every round's figures and the load average
are reported.

The bench runs the product's commands (``shardflow``, ``python -c 'from flows.pipeline ...'``)
as subprocesses; it imports nothing of the flows.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

Progress = Callable[[str], None]
BIN = Path(sys.executable).parent

# The tables that grow with what a run sends the Prefect server.
PREFECT_TABLES = (
    "flow_run",
    "flow_run_state",
    "task_run",
    "task_run_state",
    "log",
    "artifact",
    "artifact_collection",
    "events",
    "event_resources",
)
INGEST_FLOW = (
    "import sys; from flows.pipeline import ingest_flow; ingest_flow('sdss', source=sys.argv[1])"
)
SIDES = ("plain", "import", "flow")
# `shardflow ingest sdss --source DIR` in a process that has imported what a flow process does.
INGEST_AFTER_PREFECT = (
    "import sys, flows.pipeline; from flows.cli import main; "
    "sys.exit(main(['ingest', 'sdss', '--source', sys.argv[1]]))"
)


@dataclass(frozen=True, kw_only=True)
class Round:
    side: str
    seconds: float
    cpu_seconds: float
    """The side's process and every process it waited for."""
    server_cpu_seconds: float = 0.0
    """The Prefect server's while the side ran, and what it spent above its idle rate until
    it had written everything the run sent."""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """When the round ended."""
    database: dict[str, int] = field(default_factory=dict)
    """Rows of each table of the Prefect database and its bytes, after the round."""

    @property
    def all_cpu_seconds(self) -> float:
        return self.cpu_seconds + self.server_cpu_seconds


@dataclass(frozen=True, kw_only=True)
class Side:
    """How one side runs: one command after another, in the same fresh home."""

    name: str
    commands: Sequence[Sequence[str]]
    needs_server: bool


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _process_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children, living and reaped."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@dataclass
class PrefectServer:
    url: str
    home: Path
    process: subprocess.Popen[bytes]

    @property
    def database(self) -> Path:
        return self.home / "prefect.db"

    def cpu_seconds(self) -> float:
        return _process_tree_cpu(self.process.pid)

    def idle_cpu_rate(self, seconds: float = 30.0) -> float:
        """CPU seconds per second the server spends on its own (its services' loops)."""
        before, started = self.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        return (self.cpu_seconds() - before) / (time.monotonic() - started)

    def rows(self) -> dict[str, int]:
        """Rows of each of :data:`PREFECT_TABLES`; the bytes of the database's pages in use
        (its WAL's latest included: the files' sizes are high-water marks), and on disk."""
        counts: dict[str, int] = {}
        with sqlite3.connect(f"file:{self.database}?mode=ro", uri=True, timeout=60) as db:
            for table in PREFECT_TABLES:
                counts[table] = int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            pages, free, size = (
                int(db.execute(f"PRAGMA {pragma}").fetchone()[0])
                for pragma in ("page_count", "freelist_count", "page_size")
            )
        counts["bytes"] = (pages - free) * size
        wal = self.database.with_name(self.database.name + "-wal")
        counts["bytes_on_disk"] = self.database.stat().st_size + (
            wal.stat().st_size if wal.exists() else 0
        )
        return counts

    def settled_rows(self, timeout: float = 120.0) -> dict[str, int]:
        """:meth:`rows` once two counts 6 s apart agree (the server writes a run's events in
        batches, seconds after they arrive)."""
        deadline = time.monotonic() + timeout
        last = self.rows()
        while time.monotonic() < deadline:
            time.sleep(6)
            now = self.rows()
            if {k: now[k] for k in PREFECT_TABLES} == {k: last[k] for k in PREFECT_TABLES}:
                return now
            last = now
        return last


@contextmanager
def prefect_server(scratch: Path, progress: Progress) -> Iterator[PrefectServer]:
    """`prefect server start` (API and UI) on a free loopback port, its state in ``scratch``."""
    import httpx

    home = scratch / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": url,
    }
    env.pop("PREFECT_API_URL", None)
    with open(scratch / "prefect-server.log", "wb") as log:
        process = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise ShardflowError(
                        f"bench prefect: the Prefect server did not start (see {log.name})"
                    )
                time.sleep(1)
            progress(f"bench prefect: Prefect server on {url}")
            yield PrefectServer(url=url, home=home, process=process)
        finally:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _run(argv: Sequence[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run ``argv``; its wall seconds and the CPU seconds of it and every process it waited
    for. A failure raises, naming the log."""
    with open(log, "ab") as out:
        started = time.perf_counter()
        process = subprocess.Popen(
            list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        _pid, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise ShardflowError(f"bench prefect: `{' '.join(argv[:3])} ...` failed: {' '.join(tail)}")
    return seconds, usage.ru_utime + usage.ru_stime


def _round(
    side: Side, scratch: Path, number: int, server: PrefectServer, idle_rate: float
) -> Round:
    home = scratch / f"home-{side.name}-{number}"
    env = {
        **os.environ,
        "SHARDFLOW_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    if side.needs_server:
        env["PREFECT_API_URL"] = server.url
    # Prefect makes its home without parents: a missing one is a warning in every flow round.
    (home / "prefect").mkdir(parents=True)
    server_before = server.cpu_seconds()
    seconds = cpu = 0.0
    for argv in side.commands:
        took, used = _run(argv, env, scratch / f"{side.name}-{number}.log")
        seconds += took
        cpu += used
    server_cpu = database_cpu = 0.0
    database: dict[str, int] = {}
    if side.needs_server:
        ended, ended_at = server.cpu_seconds(), time.monotonic()
        server_cpu = ended - server_before
        database = server.settled_rows()
        # After the run: what writing its events cost, not the server's idle loops.
        settling = server.cpu_seconds() - ended
        database_cpu = max(0.0, settling - idle_rate * (time.monotonic() - ended_at))
    shutil.rmtree(home, ignore_errors=True)
    return Round(
        side=side.name,
        seconds=seconds,
        cpu_seconds=cpu,
        server_cpu_seconds=server_cpu + database_cpu,
        load_average=os.getloadavg(),
        database=database,
    )


def _sides(dataset: str, source: Path, *, epochs: int, split: bool) -> list[Side]:
    shardflow = str(BIN / "shardflow")
    if dataset == "sdss":
        imported = Side(
            name="import",
            commands=[[sys.executable, "-c", INGEST_AFTER_PREFECT, str(source)]],
            needs_server=False,
        )
        return [
            Side(
                name="plain",
                commands=[[shardflow, "ingest", "sdss", "--source", str(source)]],
                needs_server=False,
            ),
            *([imported] if split else []),
            Side(
                name="flow",
                commands=[[sys.executable, "-c", INGEST_FLOW, str(source)]],
                needs_server=True,
            ),
        ]
    train = ["--np", "2", "--epochs", str(epochs)]
    return [
        Side(
            name="plain",
            commands=[
                [shardflow, "ingest", dataset, "--source", str(source)],
                [shardflow, "preprocess", dataset],
                [shardflow, "train", dataset, *train],
            ],
            needs_server=False,
        ),
        Side(
            name="flow",
            commands=[[shardflow, "run", dataset, "--source", str(source), *train]],
            needs_server=True,
        ),
    ]


def _order(rounds: int, sides: Sequence[str] = ("plain", "flow")) -> list[str]:
    """Each round the next rotation of ``sides``: plain, flow, flow, plain, ...; with three,
    a b c, b c a, c a b, ... Each side in each place as often as the others."""
    turns = [[*sides[n % len(sides) :], *sides[: n % len(sides)]] for n in range(rounds)]
    return [side for turn in turns for side in turn]


def _per_run(rounds: list[Round], empty: dict[str, int]) -> dict[str, int]:
    """What one flow run left in the Prefect database: the last flow round's growth."""
    flows = [r for r in rounds if r.side == "flow" and r.database]
    if not flows:
        return {}
    before = flows[-2].database if len(flows) > 1 else empty
    return {k: v - before.get(k, 0) for k, v in flows[-1].database.items()}


def bench_prefect(
    dataset: str,
    *,
    rows: int = 2_000_000,
    files: int = 2_000,
    source: str | None = None,
    epochs: int = 1,
    rounds: int = 2,
    split: bool = False,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """The flow path ÷ the plain path (see the module docstring): sdss ingests ``rows``
    synthetic rows in ``files`` exports; fashion-mnist runs the whole pipeline on ``source``
    (default: the dataset's own) with ``epochs`` epochs on 2 ranks. ``split`` (sdss) adds the
    import side, which splits the flow's extra cost into Prefect's import and the flow run."""
    if dataset not in ("sdss", "fashion-mnist"):
        raise ShardflowError("bench prefect measures sdss (ingest) or fashion-mnist (pipeline)")
    if split and dataset != "sdss":
        raise ShardflowError("bench prefect --split measures the sdss ingest only")
    load_before = os.getloadavg()
    measured: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-prefect-") as tmp:
        scratch = Path(tmp)
        if dataset == "sdss":
            from preprocessing.sources.synth import write_sdss_exports

            paths = write_sdss_exports(
                scratch / "exports", rows=rows, files=files, fmt="csv", seed=0
            )
            input_path = paths[0].parent
            progress(f"bench prefect: {rows:,} rows in {len(paths):,} CSV exports")
        else:
            from preprocessing.datasets import DEBIAN_FASHION_MNIST

            input_path = Path(source or DEBIAN_FASHION_MNIST)
        sides = {
            side.name: side for side in _sides(dataset, input_path, epochs=epochs, split=split)
        }
        with prefect_server(scratch, progress) as server:
            empty = server.rows()
            idle_rate = server.idle_cpu_rate()
            progress(f"bench prefect: the idle server uses {idle_rate:.3f} CPU-s per second")
            for number, name in enumerate(_order(rounds, tuple(sides))):
                measured.append(_round(sides[name], scratch, number, server, idle_rate))
                r = measured[-1]
                progress(
                    f"bench prefect: round {number + 1}, {r.side}: {r.seconds:.1f} s, "
                    f"{r.all_cpu_seconds:.1f} CPU-s (server {r.server_cpu_seconds:.1f}), "
                    f"load {r.load_average[0]:.2f}"
                )
    return _summary(dataset, measured, empty, load_before) | {
        "server_idle_cpu_per_second": idle_rate,
        "rows": rows if dataset == "sdss" else None,
        "files": files if dataset == "sdss" else None,
        "epochs": epochs if dataset != "sdss" else None,
    }


def _per_side(
    measured: list[Round],
    figure: Callable[[Round], float],
    pick: Callable[[list[float]], float],
) -> dict[str, float]:
    """Each side's ``pick`` (min, statistics.median) of ``figure`` over its rounds."""
    sides = [side for side in SIDES if any(r.side == side for r in measured)]
    return {side: pick([figure(r) for r in measured if r.side == side]) for side in sides}


def _paired(measured: list[Round]) -> dict[str, dict[str, float]]:
    """flow ÷ plain within each turn (the sides' rounds run one after the other, in one
    order: the machine's pace changes less within a turn than across the run): the median,
    least and most of the turns' ratios."""
    sides = len({r.side for r in measured})
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    for start in range(0, len(measured) - sides + 1, sides):
        turn = {r.side: r for r in measured[start : start + sides]}
        if {"plain", "flow"} <= set(turn):
            ratios["wall"].append(turn["flow"].seconds / turn["plain"].seconds)
            ratios["cpu"].append(turn["flow"].all_cpu_seconds / turn["plain"].all_cpu_seconds)
    return {
        figure: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for figure, v in ratios.items()
        if v
    }


def _split(median_wall: dict[str, float], median_cpu: dict[str, float]) -> dict[str, Any]:
    """The flow's extra cost at the medians, in two: ``prefect_import`` (import minus plain) and
    ``flow_run`` (flow minus import, the server's share included); and import ÷ plain."""
    if "import" not in median_wall:
        return {}

    def part(upper: str, lower: str) -> dict[str, float]:
        return {
            "wall": median_wall[upper] - median_wall[lower],
            "cpu": median_cpu[upper] - median_cpu[lower],
        }

    return {
        "split": {"prefect_import": part("import", "plain"), "flow_run": part("flow", "import")},
        "ratio_median_import": _ratio(median_wall, median_cpu, "import"),
    }


def _ratio(wall: dict[str, float], cpu: dict[str, float], upper: str = "flow") -> dict[str, float]:
    """``upper`` ÷ plain, in wall and in CPU seconds."""
    return {"wall": wall[upper] / wall["plain"], "cpu": cpu[upper] / cpu["plain"]}


def _summary(
    dataset: str, measured: list[Round], empty: dict[str, int], load_before: Any
) -> dict[str, Any]:
    def wall(r: Round) -> float:
        return r.seconds

    def cpu(r: Round) -> float:
        return r.all_cpu_seconds

    best_wall, best_cpu = _per_side(measured, wall, min), _per_side(measured, cpu, min)
    median_wall = _per_side(measured, wall, statistics.median)
    median_cpu = _per_side(measured, cpu, statistics.median)
    return {
        "benchmark": "prefect",
        "dataset": dataset,
        "ratio": _ratio(best_wall, best_cpu),
        "ratio_median": _ratio(median_wall, median_cpu),
        "seconds": best_wall,
        "cpu_seconds": best_cpu,
        "prefect_database": {
            "empty": empty,
            "after": next((r.database for r in reversed(measured) if r.database), {}),
            "per_flow_run": _per_run(measured, empty),
        },
        "rounds": [asdict(r) for r in measured],
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "ratio_paired": _paired(measured),
    } | _split(median_wall, median_cpu)
