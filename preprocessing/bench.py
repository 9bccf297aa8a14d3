"""bench preprocess: rows/s of the Dask path ÷ rows/s of a single-process baseline.

Both run the same job (its scan and write tasks, see :mod:`preprocessing.engine`) on the same
raw version, one after the other in one run, and must write byte-identical files: the
baseline calls the tasks one after the other in this process (pyarrow with its defaults), the
Dask path submits them to a LocalCluster of ``workers`` single-threaded processes. The cluster
is started, and every worker has imported the job's modules, before timing: start-up is paid
once per cluster, not per row.
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
from preprocessing.engine import ClusterConfig, JobOptions, dask_client, run_job, run_locally
from preprocessing.jobs import plan

Progress = Callable[[str], None]


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*.parquet"))
    }


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up(module: str) -> None:
    """Import what the tasks use, in the baseline process and in every worker alike (pyarrow
    imports pandas on its first Parquet write: 0.4 s that is start-up, not work)."""
    import importlib

    for name in (module, "pandas", "pyarrow.parquet"):
        importlib.import_module(name)


def bench_preprocess(
    catalog: Catalog,
    dataset: str,
    *,
    workers: int = 2,
    options: JobOptions | None = None,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    job = plan(catalog, dataset, options or JobOptions())
    _warm_up(type(job).__module__)
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        baseline_dir, dask_dir = Path(scratch) / "baseline", Path(scratch) / "dask"
        started = time.perf_counter()
        _scans, written = run_locally(job, baseline_dir)
        baseline_seconds = time.perf_counter() - started
        rows = sum(int(r["rows"]) for r in written)
        progress(f"bench preprocess: baseline {rows / baseline_seconds:,.0f} rows/s")
        with dask_client(ClusterConfig(workers=workers), progress) as client:
            client.run(_warm_up, type(job).__module__)
            started = time.perf_counter()
            run_job(client, job, dask_dir, progress)
            dask_seconds = time.perf_counter() - started
            peak_rss = client.run(_peak_rss_bytes)
        progress(f"bench preprocess: dask {rows / dask_seconds:,.0f} rows/s")
        if _digests(baseline_dir) != _digests(dask_dir):
            raise ShardflowError("bench preprocess: the two paths wrote different files")
    return {
        "benchmark": "preprocess",
        "dataset": dataset,
        "raw_version": job.raw.version if hasattr(job, "raw") else None,
        "rows": rows,
        "shards": len(written),
        "workers": workers,
        "ratio": baseline_seconds / dask_seconds,
        "rows_per_second": {"dask": rows / dask_seconds, "baseline": rows / baseline_seconds},
        "seconds": {"dask": dask_seconds, "baseline": baseline_seconds},
        "peak_rss_bytes_per_worker": sorted(peak_rss.values()),
    }
