"""`bench preprocess` and `bench ingest`: rows/s of the Dask path ÷ rows/s of a baseline, side
by side in one run.

preprocess: both sides run the same job's tasks on the same raw version and must write
byte-identical files: the baseline calls them one after the other in this process, the Dask
path submits them to a LocalCluster of ``workers`` single-threaded processes.

ingest: the whole ingest of synthetic CasJobs CSV exports (convert tasks on the LocalCluster,
then the commit) against pyarrow's own multithreaded ``read_csv`` + ``write_table`` over the
same files.

The cluster is started, and every worker has imported what the tasks use, before timing:
start-up is paid once per cluster, not per row. The machines are shared and noisy, so the
sides alternate for ``rounds`` rounds, each side's best round gives the ratio, and every
round's wall and CPU seconds (this process plus every worker) and the load average are
reported beside it.
"""

from __future__ import annotations

import hashlib
import os
import resource
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_catalog import Catalog
from data_catalog.errors import ShardflowError
from preprocessing.cluster import dask_client
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import Dataset
from preprocessing.driver import Runner, run_job, run_locally, run_passes

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Round:
    side: str
    seconds: float
    cpu_seconds: float
    """This process and, for the Dask side, every worker."""


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*.parquet"))
    }


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up(*modules: str) -> None:
    """Import what the tasks use, in the baseline process and in every worker alike (pyarrow
    imports pandas on its first Parquet write: 0.4 s that is start-up, not work)."""
    import importlib

    for name in (*modules, "pandas", "pyarrow.parquet", "pyarrow.csv"):
        importlib.import_module(name)


def _timed(side: str, work: Callable[[], None], client: Any = None) -> Round:
    """Run ``work``; its wall seconds and the CPU seconds of this process and the workers."""
    workers_before = client.run(time.process_time) if client is not None else {}
    cpu_before = time.process_time()
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    if client is not None:
        after = client.run(time.process_time)
        cpu += sum(after[w] - workers_before.get(w, 0.0) for w in after)
    return Round(side=side, seconds=seconds, cpu_seconds=cpu)


def _summary(
    benchmark: str, rows: int, rounds: list[Round], baseline: str, measured: str
) -> dict[str, Any]:
    best = {
        side: min((r for r in rounds if r.side == side), key=lambda r: r.seconds)
        for side in (baseline, measured)
    }
    million = rows / 1e6
    return {
        "benchmark": benchmark,
        "rows": rows,
        "ratio": best[baseline].seconds / best[measured].seconds,
        "rows_per_second": {side: rows / best[side].seconds for side in best},
        "seconds": {side: best[side].seconds for side in best},
        "cpu_seconds_per_million_rows": {side: best[side].cpu_seconds / million for side in best},
        "rounds": [asdict(r) for r in rounds],
    }


def bench_preprocess(
    catalog: Catalog,
    dataset: Dataset,
    *,
    workers: int = 2,
    rounds: int = 3,
    options: JobOptions | None = None,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    job = dataset.plan_preprocessing(catalog, options or JobOptions())
    module = type(job).__module__
    _warm_up(module)
    load_before = os.getloadavg()
    measured: list[Round] = []
    rows = 0
    with (
        tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch,
        dask_client(ClusterConfig(workers=workers), progress) as client,
    ):
        client.run(_warm_up, module)
        for number in range(rounds):
            baseline_dir = Path(scratch) / f"baseline-{number}"
            dask_dir = Path(scratch) / f"dask-{number}"
            written: list[Any] = []

            def baseline(out: Path = baseline_dir, into: list[Any] = written) -> None:
                into.extend(run_locally(job, out)[job.passes[-1]])

            measured.append(_timed("baseline", baseline))
            rows = sum(int(r["rows"]) for r in written)

            def on_dask(out: Path = dask_dir) -> None:
                run_passes(job, Runner(client), out)

            measured.append(_timed("dask", on_dask, client))
            progress(
                f"bench preprocess: round {number + 1}: baseline {measured[-2].seconds:.2f} s, "
                f"dask {measured[-1].seconds:.2f} s"
            )
            if _digests(baseline_dir) != _digests(dask_dir):
                raise ShardflowError("bench preprocess: the two paths wrote different files")
        peak_rss = client.run(_peak_rss_bytes)
    return {
        **_summary("preprocess", rows, measured, "baseline", "dask"),
        "dataset": dataset.name,
        "raw_version": job.raw.version if hasattr(job, "raw") else None,
        "shards": len(written),
        "workers": workers,
        "peak_rss_bytes_per_worker": sorted(peak_rss.values()),
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def _pyarrow_baseline(files: list[Path], out: Path) -> None:
    """pyarrow alone: multithreaded read_csv, then write_table, file by file."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for path in files:
        pq.write_table(pcsv.read_csv(path), out / f"{path.stem}.parquet")


def bench_ingest(
    dataset: str,
    *,
    rows: int,
    files: int = 8,
    workers: int | None = None,
    rounds: int = 3,
    progress: Progress = lambda _msg: None,
) -> dict[str, Any]:
    """Ingest of ``rows`` synthetic SDSS rows in ``files`` CSV exports on the default
    LocalCluster ÷ pyarrow's read_csv (threads) + write_table of the same files."""
    if dataset != "sdss":
        raise ShardflowError("bench ingest measures CasJobs CSV exports: use sdss")
    from preprocessing.sources import exports
    from preprocessing.sources.synth import write_sdss_exports

    config = ClusterConfig() if workers is None else ClusterConfig(workers=workers)
    _warm_up(exports.__name__)
    load_before = os.getloadavg()
    measured: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-ingest-") as scratch:
        source = Path(scratch) / "exports"
        paths = write_sdss_exports(source, rows=rows, files=files, fmt="csv", seed=0)
        size = sum(p.stat().st_size for p in paths)
        progress(f"bench ingest: {rows:,} rows in {len(paths)} CSV files, {size / 1e6:,.0f} MB")
        for path in paths:  # both sides read from the page cache
            path.read_bytes()
        with dask_client(config, progress) as client:
            client.run(_warm_up, exports.__name__)
            for number in range(rounds):

                def pyarrow_alone(n: int = number) -> None:
                    _pyarrow_baseline(paths, Path(scratch) / f"pa-{n}")

                measured.append(_timed("pyarrow", pyarrow_alone))
                catalog = Catalog(Path(scratch) / f"catalog-{number}")

                def ingest(catalog: Catalog = catalog, n: int = number) -> None:
                    run_job(
                        catalog,
                        exports.plan_ingest(str(source)),
                        runner=lambda: nullcontext(Runner(client)),
                        work_root=Path(scratch) / f"work-{n}",
                    )

                measured.append(_timed("ingest", ingest, client))
                progress(
                    f"bench ingest: round {number + 1}: pyarrow {measured[-2].seconds:.2f} s, "
                    f"shardflow ingest {measured[-1].seconds:.2f} s"
                )
            peak_rss = client.run(_peak_rss_bytes)
    return {
        **_summary("ingest", rows, measured, "pyarrow", "ingest"),
        "dataset": dataset,
        "files": len(paths),
        "csv_bytes": size,
        "workers": config.workers if config.scheduler is None else None,
        "peak_rss_bytes_per_worker": sorted(peak_rss.values()),
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
