"""`bench ingest|preprocess sdss --against duckdb,polars`: shardflow's whole command against
the script a user would write instead in DuckDB or Polars (:mod:`lab.bench.peers`), on the same
synthetic CasJobs exports and the same cores, each side a whole process (imports, a cluster's
start and stop, the commit: what a user waits for).

The sides take turns within every round, the first side moving by one each round; each side's
median wall and CPU seconds over the rounds give the ratios, shardflow's speed ÷ the faster
peer's (≥ 1: shardflow is faster). CPU seconds are the process's and every process it waited
for (``wait4``); the load average is read before and after. Every round's outputs are
compared: preprocess, the rows of each split, the quarantine's reasons and the training
statistics; ingest, each file's rows and column sums.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from data_catalog import Catalog
from data_catalog.errors import ConfigError, ShardflowError

PEERS = ("duckdb", "polars")
SHARDFLOW = "shardflow"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Run:
    side: str
    round: int
    seconds: float
    cpu_seconds: float
    peak_rss_bytes: int
    """The side's largest process's."""


def parse_peers(text: str) -> tuple[str, ...]:
    """``--against`` as a tuple of peers, refusing an unknown one or a peer not installed."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise ConfigError("against", f"{text!r}: choose from {', '.join(PEERS)}")
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise ConfigError(
            "against",
            f"{', '.join(missing)} not installed: pip install -c requirements/lock.txt '.[bench]'",
        )
    return names


def _shardflow() -> list[str]:
    script = Path(sys.executable).with_name("shardflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]


def _run(side: str, number: int, command: Sequence[str], env: dict[str, str]) -> tuple[Run, str]:
    """Run ``command`` to its end: its wall and CPU seconds, peak RSS and stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _pid, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise ShardflowError(f"bench: {side} failed (exit {process.returncode}): {tail[0]}")
        stdout = out.read().decode()
    run = Run(
        side=side,
        round=number,
        seconds=seconds,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        peak_rss_bytes=usage.ru_maxrss * 1024,  # KiB on Linux
    )
    return run, stdout


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            found: dict[str, Any] = json.loads(line)
            return found
    raise ShardflowError("bench: a side printed no JSON result")


def _linked_copy(source: Path, dest: Path) -> None:
    """A catalog home for one round: its data files hard-linked (never written again), the
    rest (the index, locks) copied."""

    def link_or_copy(src: str, dst: str) -> None:
        if src.endswith(".parquet") or "/objects/" in src:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, copy_function=link_or_copy)


def _close(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    return len(a) == len(b) and all(
        x == y or abs(x - y) <= tolerance * max(1.0, abs(x)) for x, y in zip(a, b, strict=True)
    )


def _preprocess_agrees(ours: dict[str, Any], peer: dict[str, Any]) -> bool:
    splits = {name: int(split["rows"]) for name, split in ours["splits"].items()}
    normalization = ours["normalization"]
    return (
        splits == peer["splits"]
        and ours["quarantine"]["reasons"] == peer["quarantine"]
        and _close(normalization["mean"], peer["mean"], 1e-12)
        # shardflow's deviation comes from sums of squares, the peers' from two passes.
        and _close(normalization["std"], peer["std"], 1e-8)
    )


def _column_sums(files: Sequence[Path]) -> list[list[float]]:
    """Per file: its rows, then each numeric column's sum (NaN as 0), for the comparison (text
    columns: by the rows' count only)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    sums = []
    for path in files:
        table = pq.read_table(path)
        row = [float(table.num_rows)]
        for column in table.columns:
            if pa.types.is_floating(column.type):
                column = pc.if_else(pc.is_nan(column), 0.0, column)
            if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
                row.append(float(pc.sum(column).as_py() or 0))
        sums.append(row)
    return sums


def _rss_per_worker(result: dict[str, Any]) -> list[int]:
    """Each Dask worker's peak RSS, or the command's own when its tasks ran in it."""
    resources = result.get("resources", {})
    workers = [int(b) for b in resources.get("peak_rss_bytes", [])]
    return workers or [int(resources["driver"]["peak_rss_bytes"])]


def _peak_rss(side: str, result: dict[str, Any]) -> int:
    """The side's largest process's peak RSS, as it measured it (the ``wait4`` figure starts at
    this process's own size: preprocessing.driver.peak_rss_bytes)."""
    if side != SHARDFLOW:
        return int(result["peak_rss_bytes"])
    resources = result.get("resources", {})
    return max([*_rss_per_worker(result), int(resources["driver"]["peak_rss_bytes"])])


def _rotated(sides: Sequence[str], number: int) -> list[str]:
    shift = number % len(sides)
    return [*sides[shift:], *sides[:shift]]


def _summary(runs: list[Run], peers: Sequence[str]) -> dict[str, Any]:
    medians = {
        side: {
            "seconds": statistics.median(r.seconds for r in runs if r.side == side),
            "cpu_seconds": statistics.median(r.cpu_seconds for r in runs if r.side == side),
            "peak_rss_bytes": max(r.peak_rss_bytes for r in runs if r.side == side),
        }
        for side in (SHARDFLOW, *peers)
    }
    faster = min(peers, key=lambda p: medians[p]["seconds"])
    ours = medians[SHARDFLOW]
    return {
        "peer_ratio_wall": medians[faster]["seconds"] / ours["seconds"],
        "peer_ratio_cpu": medians[faster]["cpu_seconds"] / ours["cpu_seconds"],
        "faster_peer": faster,
        "shardflow": ours,
        "peers": {p: medians[p] for p in peers},
        "runs": [asdict(r) for r in runs],
    }


def bench_against(
    stage: str,
    *,
    rows: int,
    files: int,
    rounds: int,
    peers: Sequence[str],
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """``stage`` (ingest or preprocess) of ``rows`` synthetic SDSS rows in ``files`` CSV
    exports: shardflow against ``peers``, ``rounds`` alternated rounds."""
    from preprocessing.sources.synth import write_sdss_exports

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with tempfile.TemporaryDirectory(prefix=f"shardflow-bench-{stage}-against-") as scratch:
        root = Path(scratch)
        exports = write_sdss_exports(root / "exports", rows=rows, files=files, fmt="csv", seed=0)
        progress(f"bench {stage}: {rows:,} rows in {len(exports)} CSV files")
        base = root / "base"
        inputs = [str(p) for p in exports]
        if stage == "preprocess":
            ingest = [*_shardflow(), "ingest", "sdss", "--source", str(root / "exports")]
            _run("ingest", 0, ingest, {**env, "SHARDFLOW_HOME": str(base)})
            catalog = Catalog(base / "catalog")
            raw = catalog.get("sdss")
            inputs = [str(catalog.file_path(raw, entry)) for entry in raw.files]
        load_before = os.getloadavg()
        runs: list[Run] = []
        agree = True
        rss_per_worker: list[int] = []
        for number in range(rounds):
            results: dict[str, Any] = {}
            for side in _rotated((SHARDFLOW, *peers), number):
                home = root / f"{side}-{number}"
                if side == SHARDFLOW:
                    if stage == "preprocess":
                        _linked_copy(base, home)
                    command = [*_shardflow(), stage, "sdss", "--json"]
                    if stage == "ingest":
                        command += ["--source", str(root / "exports")]
                    side_env = {**env, "SHARDFLOW_HOME": str(home)}
                else:
                    command = [sys.executable, "-m", f"lab.bench.peers.{side}", stage, str(home)]
                    command += inputs
                    side_env = env
                run, stdout = _run(side, number, command, side_env)
                results[side] = _last_json(stdout)
                runs.append(replace(run, peak_rss_bytes=_peak_rss(side, results[side])))
            ours = results[SHARDFLOW]
            rss_per_worker = _rss_per_worker(ours)
            agree &= _agree(stage, root, number, ours, results, peers)
            for side in (SHARDFLOW, *peers):
                shutil.rmtree(root / f"{side}-{number}", ignore_errors=True)
            progress(
                f"bench {stage}: round {number + 1}: "
                + ", ".join(f"{r.side} {r.seconds:.2f} s" for r in runs[-1 - len(peers) :])
            )
    return {
        "benchmark": f"{stage} --against",
        "dataset": "sdss",
        "rows": rows,
        "files": files,
        "rounds": rounds,
        **_summary(runs, peers),
        "outputs_agree": agree,
        "peak_rss_bytes_per_worker": rss_per_worker,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def _agree(
    stage: str,
    root: Path,
    number: int,
    ours: dict[str, Any],
    results: dict[str, Any],
    peers: Sequence[str],
) -> bool:
    if stage == "preprocess":
        return all(_preprocess_agrees(ours, results[p]) for p in peers)
    catalog = Catalog(root / f"{SHARDFLOW}-{number}" / "catalog")
    raw = catalog.get("sdss")
    expected = _column_sums([catalog.file_path(raw, e) for e in raw.files])
    for peer in peers:
        found = _column_sums(sorted((root / f"{peer}-{number}").glob("*.parquet")))
        if len(found) != len(expected) or not all(
            _close(a, b, 1e-12) for a, b in zip(expected, found, strict=True)
        ):
            return False
    return True
