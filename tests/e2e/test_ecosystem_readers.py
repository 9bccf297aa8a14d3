"""A version read by the ecosystem's own readers through `Catalog.files` and `shardflow catalog
files`, and its folder read whole (folder layout 2: `split=<name>/` hive folders, everything else
under `_` names): DuckDB, Polars, pyarrow.dataset and dask.dataframe count exactly the
manifest's rows per split, never a quarantine row; a Petastorm-format version reads back through
petastorm's `make_reader` with its Unischema, pixels equal to the source IDX files. A version
committed in the old layout (`<split>/`, `quarantine/`, `manifest.json`) stays readable,
verifiable, trainable and gc-safe."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import dask
import dask.dataframe as dd
import duckdb
import numpy as np
import polars as pl
import pyarrow.dataset as pads
import pytest

from data_catalog import Catalog, CatalogError, Manifest
from data_catalog.layout import ProcessedLayout
from data_catalog.storage import object_key
from preprocessing.schemas import image_unischema
from preprocessing.sources import idx
from tests.conftest import STEMS, Result
from training.input import as_url


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
        assert all(f"/split={split}/" in f and f.endswith(".parquet") for f in files)
        assert _read_counts(files, layout.label_column) == (counts.rows,) * 6, split
    whole = catalog.files(name)
    assert _read_counts(whole, layout.label_column) == (layout.rows,) * 6
    _check_folder_whole(catalog, name, layout)
    return layout


def _check_folder_whole(catalog: Catalog, name: str, layout: ProcessedLayout) -> None:
    """The version's folder read whole, each tool's one line of docs/catalog-storage.md: per
    split, (rows, labelled rows) equal the manifest's, and no column of the quarantine."""
    manifest = catalog.get(name)
    folder = catalog.version_dir(manifest.name, manifest.version)
    label = layout.label_column
    expected = {split: (counts.rows, counts.rows) for split, counts in layout.splits.items()}
    # DuckDB and Polars read names starting with "_" (DuckDB's read_parquet of the folder
    # counts the quarantine's rows; Polars refuses _manifest.json): the split=* glob.
    glob = f"{folder}/split=*/*.parquet"
    relation = duckdb.sql(
        f"select split, count(*), count({label}) "
        f"from read_parquet('{glob}', hive_partitioning=true) group by split"
    )
    assert relation is not None
    assert {split: (rows, n) for split, rows, n in relation.fetchall()} == expected
    polars = pl.scan_parquet(glob, hive_partitioning=True)
    assert "reason" not in polars.collect_schema().names()
    counted = polars.group_by("split").agg(pl.len(), pl.col(label).count()).collect().rows()
    assert {split: (rows, n) for split, rows, n in counted} == expected
    # pyarrow skips "_"- and "."-prefixed names itself (ignore_prefixes): the folder as it is.
    table = pads.dataset(folder, format="parquet", partitioning="hive").to_table()
    assert table.column_names == [*layout.columns, "split"]
    grouped = table.group_by("split").aggregate([("split", "count"), (label, "count")])
    assert {
        row["split"]: (row["split_count"], row[f"{label}_count"]) for row in grouped.to_pylist()
    } == expected
    # dask lists every *.parquet under a folder, _quarantine/ too: the glob again.
    frame = dd.read_parquet(glob)
    assert "reason" not in frame.columns
    sizes = frame.groupby("split", observed=True)[label].agg(["size", "count"]).compute()
    assert {str(k): (int(r["size"]), int(r["count"])) for k, r in sizes.iterrows()} == expected


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


def _legacy_path(path: str) -> str:
    """Where folder layout 1 kept the file folder layout 2 keeps at ``path``."""
    first, _, rest = path.partition("/")
    if first.startswith("split="):
        return f"{first[len('split=') :]}/{rest}"
    return f"quarantine/{rest}" if first == "_quarantine" else path


def _commit_as_before(catalog: Catalog, manifest: Manifest, root: Path) -> Manifest:
    """``manifest``'s version committed into the catalog at ``root`` as shardflow wrote it
    before folder layout 2: each file in ``<split>/`` or ``quarantine/`` (a hard link to its
    object), ``schema.splits`` naming those folders, and the manifest as ``manifest.json``."""
    folder = root / "datasets" / manifest.name / manifest.version
    for entry in manifest.files:
        stored = root / object_key(entry.sha256)
        stored.parent.mkdir(parents=True, exist_ok=True)
        if not stored.exists():
            os.link(catalog.file_path(manifest, entry), stored)
        target = folder / _legacy_path(entry.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(stored, target)
    files = [replace(e, path=_legacy_path(e.path)) for e in manifest.files]
    schema = {**manifest.schema, "splits": {s: s for s in manifest.schema["splits"]}}
    schema["quarantine"] = "quarantine/ (all raw columns + reason)"
    old = replace(manifest, files=tuple(sorted(files, key=lambda e: e.path)), schema=schema)
    (folder / "manifest.json").write_text(old.sealed().to_json())
    return old


def test_a_version_in_the_old_layout_stays_readable_verifiable_and_trainable(
    shardflow: Callable[..., Result], home: Path, tmp_path: Path
) -> None:
    """Runs after the SDSS test (same module home), before the test that damages a file: its
    version, committed into another catalog as the code before folder layout 2 did, is read
    through its manifest.json."""
    catalog = Catalog(home / "catalog")
    new = catalog.get("sdss-processed")
    old_home = tmp_path / "old"
    old = _commit_as_before(catalog, new, old_home / "catalog")
    assert not any(p.startswith(("split=", "_quarantine/")) for p in (f.path for f in old.files))
    before = Catalog(old_home / "catalog")
    assert before.get("sdss-processed") == old.sealed()
    assert before.manifest_location(old.name, old.version).endswith("/manifest.json")
    layout = ProcessedLayout.of(before.get("sdss-processed"))
    assert layout.folder_layout == 1 and layout.folder("train") == "train"
    assert before.verify() == []
    verified = shardflow("catalog", "verify", home=old_home)
    assert verified.returncode == 0, verified.stderr

    listed = shardflow("catalog", "files", "sdss-processed", "--split", "train", home=old_home)
    assert listed.returncode == 0, listed.stderr
    files = listed.stdout.split()
    assert files and all("/train/part-" in f for f in files)
    relation = duckdb.sql(f"select count(*) from read_parquet({files!r})")
    assert relation is not None and relation.fetchall() == [(layout.train.rows,)]
    assert before.split_dir(old, "test") == before.version_dir(old.name, old.version) / "test"

    # gc keeps every file of a version whose manifest has the old name.
    assert before.gc(min_age=timedelta(0)) == []
    assert before.verify() == []
    trained = shardflow(
        "train", "sdss", "--np", "1", "--epochs", "1", "--batch-size", "256", home=old_home
    )
    assert trained.returncode == 0, trained.stderr
    model = before.get("sdss-dnn")
    assert model.parents[0].version == old.version


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
    assert any(f.path == "split=train/_common_metadata" for f in manifest.files)
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
        url = str(as_url(catalog.split_dir(manifest, split)))
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
