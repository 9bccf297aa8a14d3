"""A processed SDSS version of a raw version that grew reuses the earlier version's pieces and
equals a from-scratch run, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from data_catalog import Catalog, Manifest
from preprocessing.config import JobOptions
from preprocessing.driver import SerialRunner, run_job, run_passes, serial_runner
from preprocessing.plan import PlanConfig
from preprocessing.sdss import PIECES_FILE, plan_sdss_job
from preprocessing.sources.exports import ingest_exports
from preprocessing.sources.synth import write_sdss_exports

OPTIONS = JobOptions(plan=PlanConfig(target_rows_per_group=100, rank_multiple=4))


def _processed(catalog: Catalog, exports: Path, options: JobOptions = OPTIONS) -> Manifest:
    raw = ingest_exports(catalog, source=str(exports))
    return run_job(catalog, plan_sdss_job(catalog, raw, options), runner=serial_runner)


def _files(manifest: Manifest) -> dict[str, str]:
    return {f.path: f.sha256 for f in manifest.files}


def _objects(root: Path) -> set[str]:
    return {p.name for p in (root / "objects").glob("*/*")}


@pytest.fixture
def exports(tmp_path: Path) -> Path:
    folder = tmp_path / "exports"
    write_sdss_exports(folder, rows=6_000, files=3, fmt="csv", seed=5)
    return folder


def _add_export(folder: Path, tmp_path: Path, name: str, seed: int) -> Path:
    write_sdss_exports(tmp_path / f"more-{seed}", rows=2_000, files=1, fmt="csv", seed=seed)
    target = folder / name
    shutil.copy(next((tmp_path / f"more-{seed}").glob("*.csv")), target)
    return target


def _scratch(tmp_path: Path, exports: Path, options: JobOptions = OPTIONS) -> Manifest:
    copy = tmp_path / "scratch-exports"
    shutil.copytree(exports, copy)
    return _processed(Catalog(tmp_path / "scratch"), exports, options)


def test_a_new_export_is_the_only_piece_scanned_written_and_stored(
    exports: Path, tmp_path: Path
) -> None:
    root = tmp_path / "catalog"
    catalog = Catalog(root)
    first = _processed(catalog, exports)
    before = _objects(root)
    # Sorts before every other export: its piece is number 0, the others move up.
    _add_export(exports, tmp_path, "a-new-export.csv", seed=11)
    raw = ingest_exports(catalog, source=str(exports))
    job = plan_sdss_job(catalog, raw, OPTIONS)
    assert job.earlier is not None and job.earlier.manifest.version == first.version
    assert len(job.kept("scan", {})) == 3 and len(job.tasks("scan", {}, tmp_path)) == 1
    grown = run_job(catalog, job, runner=serial_runner)
    noted = grown.extra["run"]["incremental"]
    assert (noted["pieces_reused"], noted["pieces_new"]) == (3, 1)
    # Lineage names what is new: the new export's file in the raw version, its piece here.
    tree = catalog.lineage(grown.name, grown.version)
    assert tree["new_since"] == {
        "base": str(first.ref),
        "reused": 3,
        "new": ["00001-a-new-export.parquet#0"],
    }
    raw_node = tree["parents"][0]
    assert raw_node["new_since"]["new"] == ["00001-a-new-export.parquet"]
    assert raw_node["new_since"]["reused"] == 3
    # Stored anew: the new export's raw file, the new piece's outputs and the pieces record.
    new = {f.sha256 for f in grown.files} - {f.sha256 for f in first.files}
    assert _objects(root) - before == new | {raw.files[0].sha256}
    assert {f.path for f in grown.files if f.sha256 in new} == {
        PIECES_FILE,
        *(
            p
            for p in _files(grown)
            if p.endswith("part-00000.parquet") or p.endswith("part-00000.arrow")
        ),
    }
    scratch = _scratch(tmp_path, exports)
    assert grown.version == scratch.version
    assert _files(grown) == _files(scratch)
    assert grown.statistics == scratch.statistics
    assert catalog.verify() == []


def test_a_new_export_repeating_rows_of_later_pieces_makes_them_set_them_aside(
    exports: Path, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    first = _processed(catalog, exports)
    # A new export, first in file order, holding 50 rows of the last export: those rows are
    # now duplicates in the last export's piece, which is read and written again.
    lines = sorted(exports.glob("*.csv"))[-1].read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("objid"))
    (exports / "a-repeats.csv").write_text("".join(lines[: header + 51]))
    grown = _processed(catalog, exports)
    reasons = grown.statistics["quarantine"]["reasons"]
    assert reasons.get("duplicate (objid, specobjid)", 0) >= 50
    assert first.statistics["quarantine"]["reasons"].get("duplicate (objid, specobjid)", 0) == 0
    assert grown.extra["run"]["incremental"]["pieces_new"] >= 2  # the new one, the last one
    scratch = _scratch(tmp_path, exports)
    assert _files(grown) == _files(scratch)
    assert grown.statistics == scratch.statistics


def test_a_lost_export_and_other_parameters_still_equal_a_fresh_run(
    exports: Path, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    _processed(catalog, exports)
    sorted(exports.glob("*.csv"))[0].unlink()
    shrunk = _processed(catalog, exports)
    assert shrunk.extra["run"]["incremental"]["pieces_new"] == 0
    assert _files(shrunk) == _files(_scratch(tmp_path / "a", exports))
    other = JobOptions(plan=PlanConfig(target_rows_per_group=70, rank_multiple=4))
    regrouped = _processed(catalog, exports, other)
    assert "incremental" not in regrouped.extra.get("run", {})  # no earlier version to reuse
    assert _files(regrouped) == _files(_scratch(tmp_path / "b", exports, other))


def test_every_training_row_is_written_once_in_row_groups_of_r_rows(
    exports: Path, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    manifest = _processed(catalog, exports)
    train = manifest.statistics["train"]
    assert train["policy"] == "whole" and train["dropped_rows"] == train["padded_rows"] == 0
    assert train["rows_per_group"] == 100
    sizes = [f.rows for f in manifest.files if f.path.startswith("split=train/")]
    assert sum(s or 0 for s in sizes) == train["rows"]
    assert (
        np.sum([f.row_groups or 0 for f in manifest.files if f.path.startswith("split=train/")])
        == (train["num_row_groups"])
    )


def test_row_groups_that_grow_with_a_small_split_rewrite_every_piece(
    exports: Path, tmp_path: Path
) -> None:
    """A split too small for rank_multiple groups of the target gets smaller groups, which
    grow with it: then every earlier piece is read and written again, and the result is still
    a fresh run's."""
    small = JobOptions(plan=PlanConfig(target_rows_per_group=1000, rank_multiple=64))
    catalog = Catalog(tmp_path / "catalog")
    first = _processed(catalog, exports, small)
    _add_export(exports, tmp_path, "z-new-export.csv", seed=13)
    grown = _processed(catalog, exports, small)
    assert grown.statistics["train"]["rows_per_group"] > first.statistics["train"]["rows_per_group"]
    assert grown.extra["run"]["incremental"]["pieces_reused"] == 0
    assert _files(grown) == _files(_scratch(tmp_path, exports, small))


def _rows_of(export: Path, start: int, stop: int) -> str:
    """Rows ``start``..``stop`` of an export (a CSV with comment lines before its header)."""
    lines = export.read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("objid"))
    return "".join(lines[header + 1 + start : header + 1 + stop])


def _with_header(export: Path, body: str) -> str:
    lines = export.read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("objid"))
    return "".join(lines[: header + 1]) + body


def test_the_duplicates_of_a_grown_version_compare_only_the_new_keys(
    exports: Path, tmp_path: Path
) -> None:
    """A base holding duplicates across its pieces grows by exports that repeat its rows (one
    first in file order, one last) and each other's: the duplicates pass compares the new keys
    with the base's matching ones and starts from the base's duplicates, and the version equals
    a from-scratch run."""
    first_export, *_, last_export = sorted(exports.glob("*.csv"))
    (exports / "m-base-repeats.csv").write_text(
        _with_header(first_export, _rows_of(last_export, 0, 40) + _rows_of(first_export, 100, 120))
    )
    catalog = Catalog(tmp_path / "catalog")
    base = _processed(catalog, exports)
    duplicate = "duplicate (objid, specobjid)"
    assert base.statistics["quarantine"]["reasons"][duplicate] == 60

    write_sdss_exports(tmp_path / "news", rows=1_500, files=1, fmt="csv", seed=23)
    news = next((tmp_path / "news").glob("*.csv"))
    # First in file order: rows the base holds twice already, rows of its last export, and
    # rows the export below holds too.
    (exports / "a-first.csv").write_text(
        _with_header(
            first_export,
            _rows_of(last_export, 0, 10) + _rows_of(last_export, 500, 530) + _rows_of(news, 0, 5),
        )
    )
    (exports / "z-last.csv").write_text(
        _with_header(first_export, _rows_of(first_export, 200, 225) + _rows_of(news, 0, 1_500))
    )
    raw = ingest_exports(catalog, source=str(exports))
    job = plan_sdss_job(catalog, raw, OPTIONS)
    assert job.earlier is not None and job.earlier.manifest.version == base.version
    # Compared: the new pieces' keys and the few old ones they match, not every key.
    done = run_passes(job, SerialRunner(), tmp_path / "passes")
    compared = sum(b["keys"] for task in done["duplicates"] for b in task["buckets"])
    assert len(done["matches"]) >= 1
    assert 1_500 + 70 <= compared < 1_500 + 70 + 200
    grown = run_job(catalog, job, runner=serial_runner)
    assert grown.extra["run"]["passes"]["matches"]["tasks"] >= 1
    scratch = _scratch(tmp_path, exports)
    assert _files(grown) == _files(scratch)
    assert grown.statistics == scratch.statistics
    # 60 of the base, 10 + 30 of the last export (now behind a-first), 5 of news in z-last,
    # 25 of the first export in z-last.
    assert grown.statistics["quarantine"]["reasons"][duplicate] == 60 + 40 + 5 + 25
    assert "matches" not in scratch.extra["run"]["passes"]  # no earlier version: every key


def test_every_pass_that_read_says_how_many_bytes(exports: Path, tmp_path: Path) -> None:
    """The run's record of each pass (and the pass tables the flows show) counts what its tasks
    read: the write pass's input, the scans' segments, is known only once they are written."""
    manifest = _processed(Catalog(tmp_path / "catalog"), exports)
    passes = manifest.extra["run"]["passes"]
    assert all(passes[name]["input_bytes"] > 0 for name in ("scan", "write")), passes
