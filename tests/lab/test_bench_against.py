"""`shardflow bench ingest|preprocess sdss --against duckdb,polars`: the peers' scripts compute
what shardflow's stages compute (the same splits, quarantine reasons, statistics and ingested
values), on a set seeded with every kind of bad row; the bench's small form reports its ratios
and that the outputs agree. No timing is asserted."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from data_catalog import Catalog
from lab.bench.against import _close, _column_sums, _preprocess_agrees
from preprocessing.sources.synth import write_sdss_exports
from tests.conftest import Result

pytestmark = pytest.mark.e2e
PEERS = ("duckdb", "polars")


def _seeded(directory: Path) -> None:
    """Two CSV exports of 250,000 rows (three pieces each) with every kind of bad row: an
    empty cell (NaN), inf, a -9999 sentinel, an unknown class, an empty redshift, a repeat of
    a key in the same piece, in another piece of the same file and in another file, and
    repeats of a key whose first row is bad, in its piece and in another file."""
    write_sdss_exports(directory, rows=500_000, files=2, fmt="csv", seed=3)
    first, second = sorted(directory.glob("*.csv"))
    rows = {}
    for path in (first, second):
        with open(path, newline="") as f:
            rows[path] = list(csv.reader(f))
    names = rows[first][0]
    a, b = rows[first], rows[second]

    def put(table: list[list[str]], row: int, column: str, value: str) -> None:
        table[row][names.index(column)] = value

    put(a, 11, "g", "")
    put(a, 12, "petroMag_r", "inf")
    put(a, 13, "petroRad_i", "-9999")
    put(a, 14, "class", "UNKNOWN")
    put(a, 15, "redshift", "")
    a[21] = list(a[20])  # a repeat in the same piece
    a[150_001] = list(a[30])  # in another piece of the same file
    b[40] = list(a[31])  # in another file
    for table, row in ((b, 41), (a, 50)):  # the key of a bad row, its other values good
        for column in ("objid", "specobjid"):
            put(table, row, column, a[13][names.index(column)])
    # b[41]: in another file, kept (only good rows' keys are compared across pieces);
    # a[50]: in the bad row's piece, a duplicate.
    for path, table in rows.items():
        with open(path, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(table)


def _peer(engine: str, stage: str, out: Path, inputs: list[str]) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, "-m", f"lab.bench.peers.{engine}", stage, str(out), *inputs],
        capture_output=True,
        text=True,
        env=os.environ,
        check=True,
    )
    found: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return found


def test_peers_compute_what_shardflow_computes(
    shardflow: Callable[..., Result], shardflow_home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "exports"
    _seeded(source)
    exports = [str(p) for p in sorted(source.glob("*.csv"))]
    assert shardflow("ingest", "sdss", "--source", str(source)).returncode == 0
    processed = shardflow("preprocess", "sdss", "--json")
    assert processed.returncode == 0, processed.stderr[-2000:]
    ours = processed.json
    reasons = ours["quarantine"]["reasons"]
    assert reasons["duplicate (objid, specobjid)"] == 4
    assert {"nan:g", "infinite:petroMag_r", "sentinel:petroRad_i", "unknown class"} <= set(reasons)
    assert "nan:redshift" in reasons
    catalog = Catalog(shardflow_home / "catalog")
    raw = catalog.get("sdss")
    raw_files = [str(catalog.file_path(raw, e)) for e in raw.files]
    expected = _column_sums([catalog.file_path(raw, e) for e in raw.files])
    for engine in PEERS:
        peer = _peer(engine, "preprocess", tmp_path / f"{engine}-pre", raw_files)
        assert _preprocess_agrees(ours, peer), (engine, peer["quarantine"], reasons)
        # Nothing left of the spilling or partitioned writes: the four files only.
        written = sorted(p.name for p in (tmp_path / f"{engine}-pre").iterdir())
        assert written == [f"{n}.parquet" for n in ("quarantine", "test", "train", "validation")]
        _peer(engine, "ingest", tmp_path / f"{engine}-ingest", exports)
        found = _column_sums(sorted((tmp_path / f"{engine}-ingest").glob("*.parquet")))
        assert len(found) == len(expected), engine
        assert all(_close(a, b, 1e-12) for a, b in zip(expected, found, strict=True)), engine


def test_bench_against_quick(shardflow: Callable[..., Result]) -> None:
    for stage in ("preprocess", "ingest"):
        run = shardflow("bench", stage, "sdss", "--quick", "--against", "duckdb,polars", "--json")
        assert run.returncode == 0, run.stderr[-3000:]
        result = run.json
        assert result["outputs_agree"] is True
        assert set(result["peers"]) == set(PEERS)
        assert result["peer_ratio_wall"] > 0 and result["peer_ratio_cpu"] > 0
        sides = [r["side"] for r in result["runs"]]
        assert sorted(sides) == ["duckdb", "polars", "shardflow"]
        assert len(result["peak_rss_bytes_per_worker"]) >= 1
        assert len(result["load_average"]["before"]) == 3


def test_against_an_unknown_peer_is_one_line(shardflow: Callable[..., Result]) -> None:
    run = shardflow("bench", "preprocess", "sdss", "--against", "spark")
    assert run.returncode != 0
    assert run.stderr.strip().startswith("shardflow: ") and "duckdb, polars" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
