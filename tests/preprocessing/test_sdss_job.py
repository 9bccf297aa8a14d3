"""SDSS preprocessing without Dask: quarantine, hash splits, features, statistics."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, Manifest
from preprocessing import schemas, splits
from preprocessing.config import JobOptions
from preprocessing.driver import run_locally
from preprocessing.plan import PlanConfig
from preprocessing.sdss import plan_sdss_job
from preprocessing.sources import sdss
from preprocessing.sources.exports import ingest_exports
from preprocessing.sources.synth import write_sdss_exports

ROWS = 6_000


def _spoil(path: Path) -> int:
    """Put a -9999 and a -1000 sentinel and an unknown class into three rows of an export
    (ingest itself refuses NaN in CSV; FITS exports can carry it, see the test below)."""
    lines = path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("objid"))
    names = lines[header].split(",")
    rows = [r for r in csv.reader(lines[header + 1 :])]
    rows[10][names.index("g")] = "-9999"
    rows[20][names.index("class")] = "UNKNOWN"
    rows[30][names.index("petroRad_r")] = "-1000"
    path.write_text("\n".join([*lines[: header + 1], *(",".join(r) for r in rows)]) + "\n")
    return 3


def _processed(root: Path, options: JobOptions, rows: int = ROWS) -> tuple[Manifest, Path, int]:
    exports = root / "exports"
    write_sdss_exports(exports, rows=rows, files=2, fmt="csv", seed=1)
    spoiled = _spoil(sorted(exports.glob("*.csv"))[0])
    catalog = Catalog(root / "catalog")
    raw = ingest_exports(catalog, source=str(exports))
    job = plan_sdss_job(catalog, raw, options)
    done = run_locally(job, root / "work")
    with catalog.stage(job.name, kind="processed") as stage:
        manifest = job.commit(stage, done, root / "work")
    return manifest, catalog.version_dir(manifest.name, manifest.version), spoiled


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, Path, int]:
    options = JobOptions(plan=PlanConfig(target_rows_per_group=50))
    return _processed(tmp_path_factory.mktemp("sdss"), options)


def test_rows_in_are_rows_out_plus_quarantined(padded: tuple[Manifest, Path, int]) -> None:
    manifest, directory, spoiled = padded
    stats = manifest.statistics
    out = {s: pq.read_table(directory / f"split={s}") for s in ("train", "validation", "test")}
    quarantine = pq.read_table(directory / "_quarantine")
    ids = {
        (o, s)
        for table in out.values()
        for o, s in zip(
            table.column("objid").to_pylist(), table.column("specobjid").to_pylist(), strict=True
        )
    }
    assert stats["train"]["padded_rows"] == stats["train"]["dropped_rows"] == 0
    assert stats["rows_in"] == ROWS
    assert sum(t.num_rows for t in out.values()) == len(ids)  # every row out once
    assert len(ids) + quarantine.num_rows == ROWS
    assert stats["quarantine"]["rows"] == quarantine.num_rows >= spoiled
    reasons = quarantine.column("reason").to_pylist()
    assert {"sentinel:g", "unknown class", "sentinel:petroRad_r"} <= set(reasons)
    assert sum(stats["quarantine"]["reasons"].values()) == quarantine.num_rows
    # One training file per raw piece, its row groups of rows_per_group rows but its last, and
    # at least rank_multiple (64) of them.
    per_group = stats["train"]["rows_per_group"]
    for path in sorted((directory / "split=train").glob("*.parquet")):
        metadata = pq.read_metadata(path)
        sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        assert set(sizes[:-1]) <= {per_group} and 0 < sizes[-1] <= per_group
    assert stats["train"]["num_row_groups"] >= 64 and stats["train"]["policy"] == "whole"


def test_features_labels_and_statistics(padded: tuple[Manifest, Path, int]) -> None:
    manifest, directory, _ = padded
    train = pq.read_table(directory / "split=train")
    assert train.schema.equals(schemas.SDSS_SCHEMA, check_metadata=False)
    np.testing.assert_allclose(
        train.column("u_g").to_numpy(),
        train.column("u").to_numpy() - train.column("g").to_numpy(),
        atol=1e-5,
    )
    assert set(train.column("label").to_pylist()) == {0, 1, 2}
    assert manifest.schema["class_names"] == ["STAR", "GALAXY", "QSO"]
    norm = manifest.statistics["normalization"]  # over the written training rows
    full = np.stack(
        [train.column(n).to_numpy().astype(np.float64) for n in schemas.SDSS_FEATURES], 1
    )
    np.testing.assert_allclose(norm["mean"], full.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(norm["std"], full.std(axis=0), rtol=1e-7)


def test_a_row_keeps_its_split_when_the_input_changes(tmp_path: Path) -> None:
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    objid = np.arange(1, 5_001, dtype=np.uint64) * np.uint64(7919)
    specobjid = objid ^ np.uint64(2**63 + 12345)
    table = pa.table({"objid": objid, "specobjid": specobjid})
    from preprocessing.sdss import split_codes

    whole = split_codes(table, fractions)
    order = np.random.default_rng(0).permutation(5_000)[:1_000]
    np.testing.assert_array_equal(split_codes(table.take(order), fractions), whole[order])
    assert np.bincount(whole, minlength=3)[splits.SPLITS.index("test")] == pytest.approx(
        500, abs=80
    )


def test_nan_and_infinite_values_are_quarantined_with_their_column() -> None:
    from preprocessing.sdss import quarantine_reasons

    n = 4
    columns = {name: np.full(n, 17.0) for name in sdss.SCHEMA if sdss.SCHEMA[name] == "float64"}
    columns["petroMag_i"] = np.array([17.0, np.nan, 17.0, 17.0])
    columns["redshift"] = np.array([0.1, 0.1, np.inf, 0.1])
    ids = {"objid": np.arange(n, dtype=np.uint64), "specobjid": np.full(n, 2**63, np.uint64)}
    table = pa.table({**columns, **ids, "class": ["STAR", "QSO", "GALAXY", "GALAXY"]})
    assert quarantine_reasons(table).tolist() == ["", "nan:petroMag_i", "nan:redshift", ""]


def test_a_repeated_row_is_quarantined_as_a_duplicate() -> None:
    from preprocessing.sdss import quarantine_reasons

    n = 5
    columns = {name: np.full(n, 17.0) for name in sdss.SCHEMA if sdss.SCHEMA[name] == "float64"}
    objid = np.array([7, 8, 7, 9, 7], dtype=np.uint64)
    specobjid = np.array([1, 1, 1, 1, 2**64 - 1], dtype=np.uint64)
    table = pa.table({**columns, "objid": objid, "specobjid": specobjid, "class": ["STAR"] * n})
    # The second (7, 1) is the repeat; (7, 2^64 - 1) is another spectrum of the same object.
    assert quarantine_reasons(table).tolist() == [
        "",
        "",
        "duplicate (objid, specobjid)",
        "",
        "",
    ]


def test_keys_of_one_hash_are_told_apart() -> None:
    """Repeats are found among rows sorted by key hash; two keys that share a hash (here made
    to) are compared in full, wherever their rows fall in the run of that hash."""
    from preprocessing.sdss import _repeats

    hashes = np.array([5, 5, 5, 5, 3, 5], dtype=np.uint64)
    objid = np.array([1, 2, 1, 2, 1, 1], dtype=np.uint64)
    specobjid = np.array([1, 1, 1, 1, 1, 9], dtype=np.uint64)
    order = np.argsort(hashes, kind="stable")
    # Rows 2 and 3 repeat rows 0 and 1; row 4 (another hash) and row 5 (another spectrum) not.
    assert _repeats(hashes, objid, specobjid, order).tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
    ]


def test_the_key_order_is_the_stable_sort() -> None:
    from preprocessing.sdss import stable_order

    rng = np.random.default_rng(7)
    for repeats in (0, 10, 5_000):
        hashes = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
        hashes[rng.integers(0, hashes.size, repeats)] = hashes[rng.integers(0, 50, repeats)]
        np.testing.assert_array_equal(stable_order(hashes), np.argsort(hashes, kind="stable"))
