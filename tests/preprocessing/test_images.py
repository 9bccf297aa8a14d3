"""Image shards: hash splits, equal row groups, whole-or-absent files, Parquet and Petastorm."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog
from preprocessing import splits
from preprocessing.config import JobOptions
from preprocessing.driver import run_locally
from preprocessing.images import plan_job, split_records
from preprocessing.plan import PlanConfig
from preprocessing.shard_files import recorded_result
from preprocessing.sources import idx, mnist

TRAIN, TEST = 1_300, 200


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Catalog, Path]:
    """A real raw IDX version (random pixels, gzipped like the real files)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(3)
    source = root / "source"
    source.mkdir()
    for prefix, n in (("train", TRAIN), ("t10k", TEST)):
        pixels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        idx.write(source / f"{prefix}-images-idx3-ubyte.gz", pixels, compress=True)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        idx.write(source / f"{prefix}-labels-idx1-ubyte.gz", labels, compress=True)
    catalog = Catalog(root / "catalog")
    mnist.ingest(catalog, "mnist", source=str(source), download_cache=root / "downloads")
    return catalog, source


def _run(catalog: Catalog, options: JobOptions, work: Path) -> tuple[object, Path]:
    job = plan_job(catalog, catalog.get("mnist"), options)
    done = run_locally(job, work)
    with catalog.stage(job.name, kind="processed") as stage:
        manifest = job.commit(stage, done, work)
    return manifest, catalog.version_dir(manifest.name, manifest.version)


def test_splits_hold_every_record_once_with_its_pixels(
    raw: tuple[Catalog, Path], tmp_path: Path
) -> None:
    catalog, source = raw
    options = JobOptions(plan=PlanConfig(rank_multiple=8, target_rows_per_shard=400))
    manifest, directory = _run(catalog, options, tmp_path / "work")
    stats = manifest.statistics  # type: ignore[attr-defined]
    tables = {s: pq.read_table(directory / f"split={s}") for s in ("train", "validation", "test")}
    train_ids = tables["train"].column("index").to_pylist()
    validation_ids = tables["validation"].column("index").to_pylist()
    # The training source is split by hash into train and validation, with no overlap; only
    # the drop policy's few rows are missing, and counted.
    assert not set(train_ids) & set(validation_ids)
    assert len(train_ids) + len(validation_ids) + stats["train"]["dropped_rows"] == TRAIN
    assert 0.02 < len(validation_ids) / TRAIN < 0.09
    assert tables["test"].column("index").to_pylist() == list(range(TEST))
    # Row groups: equal in train, a multiple of the rank multiple.
    for part in sorted((directory / "split=train").glob("*.parquet")):
        metadata = pq.read_metadata(part)
        sizes = {metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)}
        assert sizes == {stats["train"]["rows_per_group"]}
        # Images plain (each is its own value: a dictionary only copies it again) and not
        # compressed (snappy cost more CPU than it saved bytes), labels in a dictionary,
        # snappy (images writers 3 and 4, docs/preprocessing.md "Parquet encodings").
        names = metadata.schema.names
        for i in range(metadata.num_row_groups):
            group = metadata.row_group(i)
            image, label = group.column(names.index("image")), group.column(names.index("label"))
            assert not image.has_dictionary_page and image.compression == "UNCOMPRESSED"
            assert label.has_dictionary_page and label.compression == "SNAPPY"
    assert stats["train"]["num_row_groups"] % 8 == 0
    # Pixels and labels are the source's.
    pixels = idx.read_records(source / "train-images-idx3-ubyte.gz")
    labels = idx.read_records(source / "train-labels-idx1-ubyte.gz")
    got = np.frombuffer(b"".join(tables["train"].column("image").to_pylist()), np.uint8)
    np.testing.assert_array_equal(got.reshape(-1, 28, 28), pixels[train_ids])
    assert tables["train"].column("label").to_pylist() == labels[train_ids].tolist()
    # Normalisation statistics are the training split's.
    values = pixels[train_ids].astype(np.float64) / 255
    assert stats["normalization"]["mean"] == pytest.approx([values.mean()], rel=1e-9)
    assert stats["normalization"]["std"] == pytest.approx([values.std()], rel=1e-9)
    assert not list(directory.rglob("*.partial"))


def test_a_sample_always_lands_in_the_same_split() -> None:
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    ids = np.arange(10_000, dtype=np.uint64)
    whole = splits.assign(splits.sample_hash(ids), fractions)
    # Order and company do not matter: a shuffled subset gets the same splits.
    order = np.random.default_rng(0).permutation(10_000)[:3_000]
    part = splits.assign(splits.sample_hash(ids[order]), fractions)
    np.testing.assert_array_equal(part, whole[order])
    shares = np.bincount(whole, minlength=3) / len(ids)
    assert shares == pytest.approx([0.8, 0.1, 0.1], abs=0.02)
    # Growing the source never moves a record between train and validation.
    small = split_records(1_000, {"train": 0.95, "validation": 0.05}, "validation")
    large = split_records(5_000, {"train": 0.95, "validation": 0.05}, "validation")
    assert set(small) == set(large[large < 1_000])


def test_petastorm_format_reads_with_make_reader(raw: tuple[Catalog, Path], tmp_path: Path) -> None:
    from petastorm import make_reader

    catalog, source = raw
    options = JobOptions(format="petastorm", plan=PlanConfig(rank_multiple=8))
    manifest, directory = _run(catalog, options, tmp_path / "work")
    assert manifest.schema["format"] == "petastorm"  # type: ignore[attr-defined]
    pixels = idx.read_records(source / "t10k-images-idx3-ubyte.gz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with make_reader(
            f"file://{directory / 'split=test'}", num_epochs=1, reader_pool_type="dummy"
        ) as reader:
            rows = list(reader)
    assert sorted(int(r.index) for r in rows) == list(range(TEST))
    for row in rows[:20]:
        assert row.image.shape == (28, 28, 1) and row.image.dtype == np.uint8
        np.testing.assert_array_equal(row.image[..., 0], pixels[row.index])


def test_finished_shard_is_reused_and_a_damaged_one_rewritten(
    raw: tuple[Catalog, Path], tmp_path: Path
) -> None:
    catalog, _ = raw
    job = plan_job(catalog, catalog.get("mnist"), JobOptions(plan=PlanConfig(rank_multiple=8)))
    work = tmp_path / "work"
    first = run_locally(job, work)["write"]
    shard = job.shards[0]
    path = work / "out" / shard.path
    written = path.read_bytes()
    assert recorded_result(path)
    again = run_locally(job, work)["write"]
    assert all(r.get("reused") for r in again)
    assert [r["sums"] for r in again if "sums" in r] == [r["sums"] for r in first if "sums" in r]
    path.write_bytes(written[: len(written) // 2])  # as a crash mid-write could leave it
    assert recorded_result(path) is None
    rewritten = run_locally(job, work)["write"]
    assert "reused" not in rewritten[0]
    assert path.read_bytes() == written
