"""Output files that are whole or absent: a task that dies mid-write leaves nothing under the
final name, and a rerun of the same job finds the files an interrupted run finished."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import IO, Any

Result = dict[str, Any]


def partial_path(path: Path) -> Path:
    """A name to write ``path`` under until it is whole: unique to this writer, so that two
    runs of the same job (a schedule meeting a manual run) never write into one file."""
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")


class HashingSink:
    """A write-only stream into ``target`` that hashes and counts every byte written, so that
    a task returns its output's digest without reading the file again."""

    def __init__(self, target: IO[bytes]) -> None:
        self._target = target
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.bytes += len(data)
        self._target.write(data)
        return len(data)

    def flush(self) -> None:
        self._target.flush()

    def digest(self) -> str:
        return self._hash.hexdigest()

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.bytes

    def close(self) -> None:
        # Only marks this wrapper closed: the file stays open for the fsync after the writer.
        self.closed = True


def encodings(schema: Any) -> dict[str, Any]:
    """``pq.write_table``'s encoding options that suit each column of ``schema``: floats
    byte-stream-split without a dictionary (they are nearly all distinct: pyarrow's default
    dictionary cost a quarter of the SDSS write's CPU and made the files larger; split bytes
    compress better at no cost), 64-bit unsigned ids delta-packed (they rise within a piece),
    binary values (images) plain: each image is its own value, so a dictionary only copies it
    once more on both sides, and a row group of large images (224x224x3) lands whole in one
    dictionary page that a cold reader read at half the speed of plain pages; the rest (labels,
    indices, text) dictionary-encoded as before. Images are not compressed (images writer 4):
    snappy kept 65-79 % of their bytes and its decompression was over half a reader's CPU per
    GB of pixels, which on a fast disk made the CPU, not the disk, the limit; every other column
    is snappy-compressed. Measured in docs/preprocessing.md, "Parquet encodings".

    No min/max statistics for the floats: a split's rows are in the order of their id's hash,
    so every row group's range of a feature is about the whole range and lets a reader skip
    nothing, and computing them cost a fifth of the write's CPU at 1,000-row groups (the ids',
    which rise within a piece, are kept)."""
    import pyarrow as pa

    dictionary, encoding, statistics = [], {}, []
    compression = {field.name: "SNAPPY" for field in schema}
    for field in schema:
        if pa.types.is_floating(field.type):
            encoding[field.name] = "BYTE_STREAM_SPLIT"
            continue
        statistics.append(field.name)
        if pa.types.is_uint64(field.type):
            encoding[field.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):
            compression[field.name] = "NONE"
            continue  # plain (pyarrow's fallback encoding without a dictionary)
        else:
            dictionary.append(field.name)
    return {
        "use_dictionary": dictionary,
        "column_encoding": encoding or None,
        "write_statistics": statistics,
        "compression": compression,
    }


def write_parquet(table: Any, path: Path, *, row_group_size: int) -> Result:
    """Write ``table`` to ``path`` whole or not at all, fsynced, in :func:`encodings`; returns
    what the catalog records of it, computed while writing: {"bytes", "sha256", "rows",
    "row_groups"}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    collected: list[Any] = []
    # Written into memory, then hashed and written out in one call each: through a Python
    # file object pyarrow makes a call per page (1,500 per SDSS file of 1,000-row groups:
    # 0.4 s of Python per 2M rows). One file of one task is small beside a worker's memory.
    buffer = pa.BufferOutputStream()
    pq.write_table(
        table,
        buffer,
        row_group_size=row_group_size,
        metadata_collector=collected,
        **encodings(table.schema),
    )
    data = buffer.getvalue()
    try:
        with open(partial, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)  # a shard is whole or absent
    finally:
        partial.unlink(missing_ok=True)
    crash_point("after-shard", path)
    return {
        "bytes": data.size,
        "sha256": hashlib.sha256(memoryview(data)).hexdigest(),
        "rows": table.num_rows,
        "row_groups": collected[0].num_row_groups,
    }


def described(relpath: str, written: Result) -> Any:
    """The catalog's entry of a file a task wrote, from :func:`write_parquet`'s result (or
    any {"bytes", "sha256"} a writer hashed; rows and row groups None where it has none)."""
    from data_catalog import FileEntry

    def count(key: str) -> int | None:
        return None if written.get(key) is None else int(written[key])

    return FileEntry(
        path=relpath,
        bytes=int(written["bytes"]),
        sha256=str(written["sha256"]),
        rows=count("rows"),
        row_groups=count("row_groups"),
    )


def crash_point(where: str, path: Path) -> None:
    """Failpoint for the crash tests: with ``SHARDFLOW_CRASH_AT=<where>:N`` (``after-shard``
    for preprocessing, ``after-file`` for ingest) the worker process writing its N-th file
    (counting from 1, across the whole job) dies by SIGKILL right after the file is in place,
    once per job folder."""
    spec = os.environ.get("SHARDFLOW_CRASH_AT")
    if not spec or not spec.startswith(where + ":"):
        return
    import fcntl
    import hashlib
    import signal
    import tempfile

    nth = int(spec.split(":", 1)[1])
    job_folder = str(path.parent.parent.resolve())
    marker = Path(tempfile.gettempdir()) / (
        "shardflow-crash-" + hashlib.sha256(job_folder.encode()).hexdigest()[:16]
    )
    with open(marker, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        count = len(f.read().splitlines()) + 1
        f.write(f"{path.name}\n")
        f.flush()
    if count == nth:
        os.kill(os.getpid(), signal.SIGKILL)


def recorded_result(output: Path) -> Result | None:
    """What the task that wrote ``output`` returned, when it finished (an interrupted run's
    file whole, with its result beside it), else None."""
    import json

    record = output.with_name(output.name + ".result.json")
    try:
        kept = json.loads(record.read_text())
        whole = output.stat().st_size == int(kept["output_bytes"])
        result: Result = kept["result"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if whole else None


def record_result(output: Path, result: Result) -> None:
    """Keep ``result`` beside ``output`` (whole or absent), for :func:`recorded_result`."""
    import json

    record = output.with_name(output.name + ".result.json")
    partial = partial_path(record)
    kept = {"output_bytes": output.stat().st_size, "result": result}
    try:
        partial.write_text(json.dumps(kept, sort_keys=True))
        os.replace(partial, record)
    finally:
        # A full disk must not keep a partial record: it holds the space the rerun needs.
        partial.unlink(missing_ok=True)
