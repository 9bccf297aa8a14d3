"""Preprocessing reads no raw byte its manifest does not vouch for (issue #29 item 1): a raw
file changed after its commit is refused by name, nothing is committed, whatever the stage
would have read it for (an IDX file read in place, an SDSS Parquet piece, its footer, a piece
an earlier version holds that new rows make it read again)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from data_catalog import Catalog, Manifest
from preprocessing.config import JobOptions
from preprocessing.datasets import dataset
from preprocessing.driver import serial_runner
from preprocessing.input_check import RawInputDamaged
from preprocessing.plan import PlanConfig
from preprocessing.sources import idx, mnist
from preprocessing.sources.exports import ingest_exports
from preprocessing.sources.synth import write_sdss_exports

IMAGES = JobOptions(plan=PlanConfig(rank_multiple=4, target_rows_per_group=50))
SDSS = JobOptions(plan=PlanConfig(rank_multiple=4, target_rows_per_group=100))


def _flip(path: Path, offset: int) -> None:
    """One byte of a committed file changed in place (its object, shared by the version)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _file(catalog: Catalog, raw: Manifest, suffix: str) -> Path:
    entry = next(e for e in raw.files if e.path.endswith(suffix))
    return catalog.file_path(raw, entry)


def _preprocess(catalog: Catalog, name: str, options: JobOptions) -> Manifest:
    return dataset(name).preprocess(catalog, options=options, runner=serial_runner)


@pytest.fixture
def images(tmp_path: Path) -> Catalog:
    rng = np.random.default_rng(3)
    source = tmp_path / "idx"
    source.mkdir()
    for prefix, rows in (("train", 600), ("t10k", 100)):
        pixels = rng.integers(0, 256, size=(rows, 28, 28), dtype=np.uint8)
        idx.write(source / f"{prefix}-images-idx3-ubyte.gz", pixels, compress=True)
        labels = rng.integers(0, 10, size=rows, dtype=np.uint8)
        idx.write(source / f"{prefix}-labels-idx1-ubyte.gz", labels, compress=True)
    catalog = Catalog(tmp_path / "catalog")
    mnist.ingest(catalog, "fashion-mnist", source=str(source))
    return catalog


@pytest.mark.parametrize("suffix", ["train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"])
def test_a_flipped_byte_of_an_idx_file_is_refused(images: Catalog, suffix: str) -> None:
    raw = images.get("fashion-mnist")
    damaged = _file(images, raw, suffix)
    _flip(damaged, damaged.stat().st_size - 7)  # a label, a pixel: past the header
    with pytest.raises(RawInputDamaged) as refused:
        _preprocess(images, "fashion-mnist", IMAGES)
    message = str(refused.value)
    assert f"fashion-mnist@{raw.version} is not what its manifest says" in message
    assert f"{damaged}: sha256 mismatch" in message
    assert "nothing was preprocessed" in message
    assert images.names() == ["fashion-mnist"]


def test_a_clean_raw_version_still_makes_the_same_version(images: Catalog) -> None:
    from preprocessing.images import plan_job

    expected = plan_job(images, images.get("fashion-mnist"), IMAGES).version
    assert _preprocess(images, "fashion-mnist", IMAGES).version == expected


@pytest.fixture
def sdss(tmp_path: Path) -> tuple[Catalog, Path]:
    exports = tmp_path / "exports"
    write_sdss_exports(exports, rows=3_000, files=3, fmt="csv", seed=5)
    catalog = Catalog(tmp_path / "catalog")
    ingest_exports(catalog, source=str(exports))
    return catalog, exports


@pytest.mark.parametrize("where", ["data", "footer"])
def test_a_flipped_byte_of_an_sdss_piece_is_refused(sdss: tuple[Catalog, Path], where: str) -> None:
    catalog, _exports = sdss
    raw = catalog.get("sdss")
    damaged = _file(catalog, raw, "0002-sdss-synthetic-0001.parquet")
    _flip(damaged, damaged.stat().st_size // 2 if where == "data" else damaged.stat().st_size - 40)
    with pytest.raises(RawInputDamaged, match=f"{damaged}: sha256 mismatch"):
        _preprocess(catalog, "sdss", SDSS)
    assert catalog.names() == ["sdss"]


def test_an_earlier_piece_read_again_is_verified_first(
    sdss: tuple[Catalog, Path], tmp_path: Path
) -> None:
    """A new export repeating rows of the last one makes the last piece (held by the earlier
    processed version) be read again: damaged since, it is refused before it is read."""
    catalog, exports = sdss
    _preprocess(catalog, "sdss", SDSS)
    last = sorted(exports.glob("*.csv"))[-1]
    lines = last.read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("objid"))
    (exports / "a-repeats.csv").write_text("".join(lines[: header + 51]))
    grown = ingest_exports(catalog, source=str(exports))
    damaged = _file(catalog, grown, "sdss-synthetic-0002.parquet")
    _flip(damaged, damaged.stat().st_size // 2)
    with pytest.raises(RawInputDamaged, match=f"{damaged}: sha256 mismatch"):
        _preprocess(catalog, "sdss", SDSS)
    assert len(catalog.versions("sdss-processed")) == 1


def test_a_missing_raw_file_is_refused(sdss: tuple[Catalog, Path], tmp_path: Path) -> None:
    catalog, _exports = sdss
    raw = catalog.get("sdss")
    gone = _file(catalog, raw, "0001-sdss-synthetic-0000.parquet")
    shutil.move(gone, tmp_path / "moved.parquet")
    with pytest.raises(RawInputDamaged, match=f"{gone}: missing"):
        _preprocess(catalog, "sdss", SDSS)
