"""A raw version's files wherever the catalog keeps them: a local (or mounted) path, or an
object-store URL (``s3://``, ``gs://``, ...) that tasks read through fsspec.

Parquet is read in place either way (footers, then the row groups a task needs). Files that
are read by seeking (uncompressed IDX, memory-mapped) or whole (gzip streams, CIFAR-10
batches) are copied into the task's work folder first when they are remote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def parquet_file(location: str) -> pq.ParquetFile:
    """A Parquet file to read footers and row groups from, local or remote."""
    if not is_url(location):
        return pq.ParquetFile(location)
    import fsspec

    opened: Any = fsspec.open(location, "rb").open()
    return pq.ParquetFile(opened)


def local_copy(location: str, work: str) -> str:
    """``location`` itself when it is local; else a copy of it in ``work/inputs/`` (fetched
    once, whole or absent, with retries: :func:`preprocessing.sources.fetch.fetch`)."""
    if not is_url(location):
        return location
    from preprocessing.sources.fetch import fetch

    name = location.rstrip("/").rsplit("/", 1)[-1]
    dest = Path(work) / "inputs" / name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        fetch(location, dest)
    return str(dest)
