"""Commit one small version from a separate process, for the crash and concurrency tests.

    python commit_helper.py ROOT NAME SEED [SEED ...] [--start-at UNIX_TIME] [--cache-dir DIR]

ROOT is a local path or a catalog URL (s3://bucket/prefix, with the endpoint and credentials in
the AWS_* environment variables); --cache-dir is the URL catalog's local cache.

For each SEED, writes a text file, a binary file in a subdirectory and a two-row-group Parquet
file, commits them with parameters {"seed": SEED}; then prints {"versions": [...]} as JSON. Set
SHARDFLOW_CATALOG_CRASH_AT to make it die at a failpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, ParentRef

# Fixed so that a version id depends only on the arguments, not on the checkout's git state.
CODE_VERSION = "test-code"


def write_files(directory: Path, seed: int) -> None:
    (directory / "notes.txt").write_text(f"seed {seed}\n")
    (directory / "blobs").mkdir()
    (directory / "blobs" / "data.bin").write_bytes(bytes(range(256)) * 1024)
    table = pa.table({"x": list(range(10)), "y": [str(i * seed) for i in range(10)]})
    pq.write_table(table, directory / "part.parquet", row_group_size=5)


def commit(
    root: str | Path,
    name: str,
    seed: int,
    parents: tuple[ParentRef, ...] = (),
    cache_dir: Path | None = None,
) -> str:
    catalog = Catalog(root) if cache_dir is None else Catalog(root, cache_dir=cache_dir)
    with catalog.stage(name, kind="processed") as stage:
        write_files(stage.path, seed)
        manifest = stage.commit(
            parents=parents,
            parameters={"seed": seed},
            rows=10,
            file_rows={"notes.txt": 1},
            code_version=CODE_VERSION,
        )
    return manifest.version


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("name")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    # Both processes of a concurrency test wait for the same instant, so their commits overlap.
    time.sleep(max(0.0, args.start_at - time.time()))
    versions = [commit(args.root, args.name, seed, cache_dir=args.cache_dir) for seed in args.seeds]
    print(json.dumps({"versions": versions}), flush=True)


if __name__ == "__main__":
    main()
