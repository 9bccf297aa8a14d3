"""SDSS rows whose (objid, specobjid) repeats a row of another export file (another piece):
quarantined as duplicates, the copy in the lowest piece kept, on one process and on a real
Dask LocalCluster alike."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, Manifest
from preprocessing import sdss
from preprocessing.cluster import dask_runner
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import DATASETS
from preprocessing.driver import PassProgress, RunnerFactory, serial_runner
from preprocessing.plan import PlanConfig
from preprocessing.sources.exports import ingest_exports
from preprocessing.sources.synth import write_sdss_exports

ROWS = 6_000
# Every good row is written (no rows dropped to fill equal row groups, no padding).
OPTIONS = JobOptions(plan=PlanConfig(rank_multiple=1, target_rows_per_group=100))


def _exports_sharing_keys(directory: Path) -> tuple[int, set[tuple[int, int]]]:
    """Two synthetic exports, then a third repeating 120 good rows of each (the pieces are in
    file order: the third file's copies are the ones to drop); (copies, their keys)."""
    first, second = write_sdss_exports(directory, rows=ROWS, files=2, fmt="csv", seed=3)
    header = first.read_text().splitlines()[0]
    columns = header.split(",")
    copies: list[str] = []
    for path in (first, second):
        lines = path.read_text().splitlines()[1:]
        # Rows without SDSS's -9999 sentinel: a copy of a quarantined row is not a duplicate.
        copies += [line for line in lines[::7] if "-9999" not in line][:120]
    (directory / "sdss-synthetic-0002.csv").write_text("\n".join([header, *copies]) + "\n")
    keys = set()
    for line in copies:
        cells = line.split(",")
        keys.add((int(cells[columns.index("objid")]), int(cells[columns.index("specobjid")])))
    return len(copies), keys


Exports = tuple[Path, int, set[tuple[int, int]]]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """One folder of exports for every run: the same raw version, so the same processed one."""
    directory = tmp_path_factory.mktemp("exports")
    copied, keys = _exports_sharing_keys(directory)
    return directory, copied, keys


def _processed(
    root: Path, exports: Exports, runner: RunnerFactory
) -> tuple[Manifest, Path, dict[str, int]]:
    """The processed version, its folder, and how many tasks each pass had."""
    catalog = Catalog(root / "catalog")
    ingest_exports(catalog, source=str(exports[0]))
    tasks: dict[str, int] = {}

    def count(state: PassProgress) -> None:
        tasks[state.pass_name] = state.tasks_total

    manifest = DATASETS["sdss"].preprocess(
        catalog,
        options=OPTIONS,
        runner=runner,
        work_root=root / "work",
        on_progress=count,
    )
    return manifest, catalog.version_dir(manifest.name, manifest.version), tasks


def _check(manifest: Manifest, directory: Path, exports: Exports) -> None:
    _directory, copied, keys = exports
    stats = manifest.statistics
    assert stats["rows_in"] == ROWS + copied
    assert stats["quarantine"]["reasons"].get("duplicate (objid, specobjid)") == copied
    assert stats["quarantine"]["rows"] == sum(stats["quarantine"]["reasons"].values())
    ids: list[tuple[int, int]] = []
    for split in ("train", "validation", "test"):
        table = pq.read_table(directory / f"split={split}", columns=["objid", "specobjid"])
        ids += zip(
            table.column("objid").to_pylist(), table.column("specobjid").to_pylist(), strict=True
        )
    assert len(ids) == len(set(ids))  # every key once
    assert keys <= set(ids)  # the first copy kept
    assert len(ids) + stats["quarantine"]["rows"] == ROWS + copied
    assert manifest.rows == len(ids)
    quarantine = pq.read_table(directory / "_quarantine")
    duplicates = quarantine.filter(
        quarantine.column("reason").to_numpy(zero_copy_only=False) == sdss.DUPLICATE
    )
    assert duplicates.num_rows == copied
    assert (
        set(
            zip(
                duplicates.column("objid").to_pylist(),
                duplicates.column("specobjid").to_pylist(),
                strict=True,
            )
        )
        == keys
    )


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory: pytest.TempPathFactory, exports: Exports) -> Manifest:
    """Processed in this process, the keys in 8 buckets."""
    root = tmp_path_factory.mktemp("serial")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sdss, "KEY_BUCKET_ROWS", 1_000, raising=False)
        manifest, directory, tasks = _processed(root, exports, serial_runner)
    _check(manifest, directory, exports)
    # 6,240 raw rows in buckets of 1,000, a power of two of them; only the third file's piece
    # scanned again.
    assert (tasks["duplicates"], tasks["rescan"]) == (8, 1)
    return manifest


def test_repeats_across_export_files_are_quarantined(in_one_process: Manifest) -> None:
    assert in_one_process.statistics["quarantine"]["files"] >= 1


@pytest.mark.e2e
def test_on_a_local_cluster_the_same_version_and_files(
    in_one_process: Manifest, exports: Exports, tmp_path: Path
) -> None:
    """Two workers and the default key buckets (fewer): the same version, the same files byte
    for byte as with 7 buckets."""
    manifest, directory, tasks = _processed(
        tmp_path, exports, lambda: dask_runner(ClusterConfig(workers=2))
    )
    _check(manifest, directory, exports)
    assert (tasks["duplicates"], tasks["rescan"]) == (min(tasks["scan"], sdss.MIN_KEY_BUCKETS), 1)
    assert tasks["duplicates"] < 7
    assert manifest.version == in_one_process.version
    assert manifest.content_digest() == in_one_process.content_digest()


def test_buckets_grouped_per_task_find_the_same_duplicates_as_one_bucket_per_task(
    in_one_process: Manifest, exports: Exports, tmp_path: Path
) -> None:
    """64 key buckets in 16 tasks of 4 (each task maps every keys file once) and in 64 tasks
    of one: the same version and files byte for byte; a task whose run stopped after some of
    its buckets redoes only the others, to the same bytes."""
    runs = {}
    for tasks_at_most in (sdss.MAX_DUPLICATE_TASKS, 64):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sdss, "KEY_BUCKET_ROWS", 100)
            patch.setattr(sdss, "MAX_DUPLICATE_TASKS", tasks_at_most)
            root = tmp_path / str(tasks_at_most)
            manifest, directory, tasks = _processed(root, exports, serial_runner)
        _check(manifest, directory, exports)
        runs[tasks["duplicates"]] = manifest
    grouped, single = runs[16], runs[64]
    assert grouped.version == single.version == in_one_process.version
    assert grouped.content_digest() == single.content_digest() == in_one_process.content_digest()

    # One task of 4 buckets, stopped after its first two: the rerun maps the files again for
    # the last two only.
    catalog = Catalog(tmp_path / "16" / "catalog")
    job = sdss.plan_sdss_job(catalog, catalog.get("sdss"), OPTIONS)
    work = tmp_path / "resume"
    scans = [sdss.scan_piece(p, job.fractions, str(work), job.stored) for p in job.pieces]
    keys = tuple((int(r["piece"]), str(r["keys"])) for r in scans)
    first = sdss.find_duplicates((0, 4), 8, keys, str(work))
    written = {b: sdss.duplicates_path(str(work), b).read_bytes() for b in range(4)}
    for bucket in (2, 3):
        sdss.duplicates_path(str(work), bucket).unlink()
    again = sdss.find_duplicates((0, 4), 8, keys, str(work))
    assert [r.get("reused", False) for r in again["buckets"]] == [True, True, False, False]
    assert not again["reused"] and not first["reused"]
    assert [{**r, "reused": False} for r in again["buckets"]] == [
        {**r, "reused": False} for r in first["buckets"]
    ]
    assert {b: sdss.duplicates_path(str(work), b).read_bytes() for b in range(4)} == written
    assert sum(count for r in first["buckets"] for _piece, count in r["pieces"]) > 0
    assert sdss.find_duplicates((0, 4), 8, keys, str(work))["reused"]
