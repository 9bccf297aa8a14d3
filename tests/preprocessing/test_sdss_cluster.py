"""SDSS preprocessing on a real Dask LocalCluster: a worker killed mid-run, memory at 10x input."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, Manifest
from preprocessing.cluster import dask_client, dask_runner
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import DATASETS
from preprocessing.driver import Runner, run_passes
from preprocessing.plan import PlanConfig
from preprocessing.sources.exports import ingest_exports
from preprocessing.sources.synth import write_sdss_exports

pytestmark = pytest.mark.e2e

OPTIONS = JobOptions(plan=PlanConfig(target_rows_per_group=100, target_rows_per_shard=2_000))


def _raw(root: Path, rows: int, files: int, exports: Path | None = None) -> Catalog:
    if exports is None:
        exports = root / "exports"
        write_sdss_exports(exports, rows=rows, files=files, fmt="fits", seed=2)
    catalog = Catalog(root / "catalog")
    ingest_exports(catalog, source=str(exports))
    return catalog


def _preprocess(catalog: Catalog, work: Path) -> Manifest:
    return DATASETS["sdss"].preprocess(
        catalog,
        options=OPTIONS,
        runner=lambda: dask_runner(ClusterConfig(workers=2)),
        work_root=work,
    )


def test_a_killed_worker_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exports = tmp_path / "exports"
    write_sdss_exports(exports, rows=30_000, files=2, fmt="fits", seed=2)
    clean_catalog = _raw(tmp_path / "clean", 0, 0, exports)
    clean = _preprocess(clean_catalog, tmp_path / "clean" / "work")

    crashed_catalog = _raw(tmp_path / "crashed", 0, 0, exports)
    job = DATASETS["sdss"].plan_preprocessing(crashed_catalog, OPTIONS)
    assert len(job.pieces) == 2  # type: ignore[attr-defined]
    # The worker process that writes the job's 4th file dies by SIGKILL right after; the
    # nanny starts a new worker and the scheduler reruns the lost task (it finds the file whole).
    monkeypatch.setenv("SHARDFLOW_CRASH_AT", "after-shard:4")
    with caplog.at_level(logging.INFO, logger="distributed.nanny"):
        crashed = _preprocess(crashed_catalog, tmp_path / "crashed" / "work")
    assert "was killed by signal 9" in caplog.text  # the nanny saw its worker die

    assert crashed.content_digest() == clean.content_digest()
    assert crashed.version == clean.version
    stats = crashed.statistics
    directory = crashed_catalog.version_dir(crashed.name, crashed.version)
    unique = set()
    for split in ("train", "validation", "test"):
        table = pq.read_table(directory / f"split={split}", columns=["objid", "specobjid"])
        unique |= set(
            zip(
                table.column("objid").to_pylist(),
                table.column("specobjid").to_pylist(),
                strict=True,
            )
        )
    quarantined = pq.read_metadata(next((directory / "_quarantine").glob("*.parquet"))).num_rows
    assert stats["rows_in"] == 30_000
    assert len(unique) + stats["quarantine"]["rows"] == 30_000  # rows in = out + quarantined
    assert quarantined >= 1
    assert crashed_catalog.verify() == []


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker_peak(catalog: Catalog, work: Path) -> int:
    job = DATASETS["sdss"].plan_preprocessing(catalog, JobOptions())
    with dask_client(ClusterConfig(workers=2), lambda _m: None) as client:
        run_passes(job, Runner(client), work)
        return max(client.run(_peak_rss).values())


def test_peak_memory_per_worker_does_not_grow_with_the_input(tmp_path: Path) -> None:
    small = _worker_peak(_raw(tmp_path / "small", rows=100_000, files=1), tmp_path / "w1")
    large = _worker_peak(_raw(tmp_path / "large", rows=1_000_000, files=10), tmp_path / "w2")
    mib = 2**20
    print(f"peak RSS per worker: {small / mib:.0f} MiB for 100k rows, {large / mib:.0f} for 1M")
    # Holding the whole 1M-row input (about 270 MB as float64 columns) would show here.
    assert large < small * 1.25
