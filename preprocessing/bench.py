"""bench preprocess: rows/s of the Dask path ÷ rows/s of a single-process baseline.

Both run the same transform (:func:`preprocessing.images.write_shard`) on the same raw
version, one after the other in one run, and their shards must be byte-identical. The Dask
cluster is started before timing: its start-up is paid once per run, not per row.
"""

from __future__ import annotations

import hashlib
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_catalog import Catalog
from data_catalog.errors import ShardflowError
from preprocessing.images import ClusterConfig, ImageJob, dask_client, plan_job, run_shards
from preprocessing.plan import PlanConfig

Progress = Callable[[str], None]


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*.parquet"))
    }


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up() -> None:
    import preprocessing.images  # noqa: F401


def _baseline(job: ImageJob, out_dir: Path) -> float:
    started = time.perf_counter()
    for shard in job.shards:
        job.write(shard, str(out_dir))
    return time.perf_counter() - started


def bench_preprocess(
    catalog: Catalog,
    dataset: str,
    *,
    workers: int = 2,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    job = plan_job(catalog, dataset, PlanConfig())
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        baseline_dir, dask_dir = Path(scratch) / "baseline", Path(scratch) / "dask"
        baseline_seconds = _baseline(job, baseline_dir)
        progress(f"bench preprocess: baseline {job.rows / baseline_seconds:,.0f} rows/s")
        with dask_client(ClusterConfig(workers=workers), progress) as client:
            # Import the writer's modules in every worker first, as the baseline process has.
            client.run(_warm_up)
            started = time.perf_counter()
            run_shards(client, job, dask_dir, progress)
            dask_seconds = time.perf_counter() - started
            peak_rss = client.run(_peak_rss_bytes)
        progress(f"bench preprocess: dask {job.rows / dask_seconds:,.0f} rows/s")
        if _digests(baseline_dir) != _digests(dask_dir):
            raise ShardflowError("bench preprocess: the two paths wrote different shards")
    return {
        "benchmark": "preprocess",
        "dataset": dataset,
        "raw_version": job.raw.version,
        "rows": job.rows,
        "shards": len(job.shards),
        "workers": workers,
        "ratio": baseline_seconds / dask_seconds,
        "rows_per_second": {
            "dask": job.rows / dask_seconds,
            "baseline": job.rows / baseline_seconds,
        },
        "peak_rss_bytes_per_worker": sorted(peak_rss.values()),
    }
