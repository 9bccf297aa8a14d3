"""A version read by the ecosystem's own readers through `Catalog.files` and `shardflow catalog
files`: DuckDB, Polars and dask.dataframe count exactly the manifest's rows per split, never a
quarantine row; a Petastorm-format version reads back through petastorm's `make_reader` with its
Unischema, pixels equal to the source IDX files."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import dask
import dask.dataframe as dd
import duckdb
import numpy as np
import polars as pl
import pytest

from data_catalog import Catalog, CatalogError
from data_catalog.layout import ProcessedLayout
from preprocessing.schemas import image_unischema
from preprocessing.sources import idx
from tests.conftest import STEMS, Result


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("readers") / "home"


def _read_counts(files: list[str], label: str) -> tuple[int, ...]:
    """(rows, labelled rows) in DuckDB, then in Polars, then in dask.dataframe."""
    # DuckDB 2 relations keep no result: fetchall() runs the query once (fetchone() is gone).
    relation = duckdb.sql(f"select count(*), count({label}) from read_parquet({files!r})")
    assert relation is not None
    ((rows, labelled),) = relation.fetchall()
    polars_rows, polars_labelled = (
        pl.scan_parquet(files).select(pl.len(), pl.col(label).count()).collect().row(0)
    )
    frame = dd.read_parquet(files)
    # Dask's own threaded scheduler: the files are read by Dask tasks, no cluster needed.
    dask_rows, dask_labelled = dask.compute(frame.shape[0], frame[label].count())
    return rows, labelled, polars_rows, polars_labelled, int(dask_rows), int(dask_labelled)


def _check_every_split(catalog: Catalog, name: str) -> ProcessedLayout:
    layout = ProcessedLayout.of(catalog.get(name))
    assert set(layout.splits) == {"train", "validation", "test"}
    for split, counts in layout.splits.items():
        files = catalog.files(name, split=split)
        assert all(f"/{split}/" in f and f.endswith(".parquet") for f in files)
        assert _read_counts(files, layout.label_column) == (counts.rows,) * 6, split
    whole = catalog.files(name)
    assert _read_counts(whole, layout.label_column) == (layout.rows,) * 6
    return layout


def test_sdss_version_read_whole_without_quarantine(
    shardflow: Callable[..., Result], home: Path
) -> None:
    assert (
        shardflow(
            "synth", "sdss", "--rows", "20000", "--files", "2", "--out", str(home / "ex"), home=home
        ).returncode
        == 0
    )
    assert shardflow("ingest", "sdss", "--source", str(home / "ex"), home=home).returncode == 0
    assert shardflow("preprocess", "sdss", "--workers", "1", home=home).returncode == 0
    catalog = Catalog(home / "catalog")
    layout = _check_every_split(catalog, "sdss-processed")
    assert layout.quarantine is not None and layout.quarantine.rows > 0
    # Every row read came from a split: what the quarantine holds is none of them.
    assert layout.rows + layout.quarantine.rows == layout.rows_in

    listed = shardflow("catalog", "files", "sdss-processed", "--split", "train", home=home)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == catalog.files("sdss-processed", split="train")


def test_petastorm_images_read_whole(
    shardflow: Callable[..., Result], home: Path, fashion_subset: Path
) -> None:
    assert (
        shardflow("ingest", "fashion-mnist", "--source", str(fashion_subset), home=home).returncode
        == 0
    )
    made = shardflow(
        "preprocess", "fashion-mnist", "--format", "petastorm", "--workers", "1", home=home
    )
    assert made.returncode == 0, made.stderr
    catalog = Catalog(home / "catalog")
    _check_every_split(catalog, "fashion-mnist-processed")
    # The Petastorm metadata stays with its split but is not handed to readers as data.
    manifest = catalog.get("fashion-mnist-processed")
    assert any(f.path == "train/_common_metadata" for f in manifest.files)
    assert not any("_common_metadata" in f for f in catalog.files("fashion-mnist-processed"))
    _check_make_reader(catalog, fashion_subset)


def _source(fashion_subset: Path, split: str, what: str) -> np.ndarray:
    return idx.read_records(fashion_subset / (STEMS[split, what] + ".gz"))


def _check_make_reader(catalog: Catalog, fashion_subset: Path) -> None:
    """Each split read by petastorm's own make_reader, through the Unischema the version
    recorded: each kept record once, pixels and labels equal to the IDX files."""
    from petastorm import make_reader

    manifest = catalog.get("fashion-mnist-processed")
    layout = ProcessedLayout.of(manifest)
    # Grey images: the source's (28, 28), one channel in the Petastorm column.
    assert layout.format == "petastorm" and layout.image_shape == (28, 28)
    expected = image_unischema((28, 28, 1))
    assert layout.unischema == str(expected)
    seen: dict[str, set[int]] = {"train": set(), "test": set()}
    source_rows = {"train": 0, "test": 0}
    for split, counts in layout.splits.items():
        # train and validation are drawn from the source's training records, test from t10k.
        raw = "test" if split == "test" else "train"
        pixels, labels = (
            _source(fashion_subset, raw, "images"),
            _source(fashion_subset, raw, "labels"),
        )
        url = (catalog.version_dir(manifest.name, manifest.version) / split).as_uri()
        with warnings.catch_warnings():
            # petastorm 0.13.1 on pyarrow 14's legacy ParquetDataset (docs/STACK.md).
            warnings.simplefilter("ignore", FutureWarning)
            with make_reader(url, num_epochs=1, reader_pool_type="dummy") as reader:
                # The Unischema petastorm unpickles from the split's _common_metadata.
                assert str(reader.schema) == str(expected)
                rows = list(reader)
        assert len(rows) == counts.rows, split
        indexes = [int(row.index) for row in rows]
        # Rows past the last equal row group are dropped ("drop") or repeated ("pad").
        assert len(set(indexes)) == counts.source_rows - counts.dropped_rows, split
        assert len(indexes) == len(set(indexes)) + counts.padded_rows, split
        assert seen[raw].isdisjoint(indexes), split
        seen[raw].update(indexes)
        source_rows[raw] += counts.source_rows
        np.testing.assert_array_equal(
            np.stack([row.image[..., 0] for row in rows]), pixels[indexes]
        )
        assert [int(row.label) for row in rows] == labels[indexes].tolist()
    # Every source record fell in exactly one split.
    assert source_rows == {"train": 2_000, "test": 1_000}
    assert seen["train"] <= set(range(2_000)) and seen["test"] <= set(range(1_000))


def test_files_refuses_what_it_cannot_list(shardflow: Callable[..., Result], home: Path) -> None:
    """Runs after the two above (same module home): a bad split, a split of a raw version, a
    version without Parquet, and a damaged file are each one line and a non-zero exit."""
    for args, said in (
        (("sdss-processed", "--split", "quarantine"), "has no split 'quarantine'"),
        (("sdss", "--split", "train"), "it has no splits"),
        (("fashion-mnist",), "holds no Parquet data file"),
    ):
        result = shardflow("catalog", "files", *args, home=home)
        assert result.returncode != 0 and result.stdout == ""
        assert result.stderr.startswith("shardflow: ") and said in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    catalog = Catalog(home / "catalog")
    victim = Path(catalog.files("sdss-processed", split="test")[0])
    victim.chmod(0o644)
    with victim.open("r+b") as f:
        f.seek(100)
        f.write(b"\0\0\0\0")
    with pytest.raises(CatalogError, match="sha256 mismatch"):
        catalog.files("sdss-processed")
    result = shardflow("catalog", "files", "sdss-processed", home=home)
    assert result.returncode != 0 and "sha256 mismatch" in result.stderr
