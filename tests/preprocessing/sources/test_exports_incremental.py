"""Ingest of a source that changes between runs converts only what is new."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from data_catalog import Catalog
from preprocessing.driver import run_job, serial_runner
from preprocessing.sources.exports import plan_ingest
from preprocessing.sources.synth import write_sdss_exports


@pytest.fixture
def exports(tmp_path: Path) -> Path:
    folder = tmp_path / "exports"
    write_sdss_exports(folder, rows=900, files=3, fmt="csv", seed=4)
    return folder


def _ingest(catalog: Catalog, folder: Path) -> tuple[str, int, int]:
    """(version, inputs converted, inputs reused)."""
    job = plan_ingest(str(folder), catalog)
    converted, reused = len(job.tasks("convert", {}, Path())), len(job.kept("convert", {}))
    manifest = run_job(catalog, job, runner=serial_runner)
    return manifest.version, converted, reused


def test_only_new_files_are_converted_and_an_unchanged_source_is_the_same_version(
    exports: Path, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    first, converted, reused = _ingest(catalog, exports)
    assert (converted, reused) == (3, 0)
    assert _ingest(catalog, exports) == (first, 0, 3)  # nothing new: the same version

    write_sdss_exports(tmp_path / "more", rows=300, files=1, fmt="csv", seed=9)
    shutil.copy(next((tmp_path / "more").glob("*.csv")), exports / "a-new-export.csv")
    second, converted, reused = _ingest(catalog, exports)
    assert (converted, reused) == (1, 3)
    grown = catalog.get("sdss", second)
    assert grown.rows == 1200 and len(grown.files) == 4
    # The three old files are the first version's objects, not copies.
    old = {f.sha256 for f in catalog.get("sdss", first).files}
    assert old < {f.sha256 for f in grown.files}
    inode = {f.sha256: catalog.file_path(grown, f).stat().st_ino for f in grown.files}
    first_manifest = catalog.get("sdss", first)
    assert all(
        catalog.file_path(first_manifest, f).stat().st_ino == inode[f.sha256]
        for f in first_manifest.files
    )
    assert catalog.verify() == []


def test_a_source_that_lost_a_file_makes_a_version_without_it(
    exports: Path, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    first, _, _ = _ingest(catalog, exports)
    sorted(exports.glob("*.csv"))[1].unlink()
    second, converted, reused = _ingest(catalog, exports)
    assert (converted, reused) == (0, 2)
    assert second != first
    assert catalog.get("sdss", second).rows == 600
    assert catalog.get("sdss", first).rows == 900  # the old version is untouched
    assert catalog.verify() == []


def test_a_file_changed_in_place_is_converted_again(exports: Path, tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    _ingest(catalog, exports)
    target = sorted(exports.glob("*.csv"))[0]
    lines = target.read_text().splitlines(keepends=True)
    target.write_text("".join(lines[:-1]))  # one row less
    second, converted, reused = _ingest(catalog, exports)
    assert (converted, reused) == (1, 2)
    assert catalog.get("sdss", second).rows == 899
    # Touched but the same bytes: converted again (its state changed), the same version.
    os.utime(target, ns=(1, 1))
    assert _ingest(catalog, exports)[0] == second
