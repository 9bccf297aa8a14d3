"""A rank's row groups read with pyarrow, in petastorm's planned order, ahead of use.

```
files of the split (path order) ─► row group i = the i-th of all files' row groups
        │  rank r's groups in the epoch's order: input.row_group_order (petastorm's plan)
        ▼
reader threads: pq.ParquetFile.read_row_group, decode (pyarrow and numpy release the GIL)
        │  handed over in the planned order, ``ahead`` groups read in advance
        ▼
(inputs, labels) per row group: the pixels a view of the Parquet page buffer, no copy
```

A split larger than the memory that could cache it (the host's, or the memory cgroup's the
rank runs in) is read with direct I/O (:func:`direct_io_wanted`): each row group's column
chunks in one ``O_DIRECT`` read into memory of the reader's own, which pyarrow decodes in
place. Through the page cache every byte was copied once more, out of the cache, and on a
data set that cannot stay cached the kernel spent as much again reclaiming the pages it had
just filled (ImageNet-size images in a 2.7 GiB cgroup: 2.06 CPU-seconds per decoded GB
against 1.6-1.75 outside it).

petastorm 0.13.1 hands a rank the same row groups in the same order, but waits on its
ventilator by polling (``workers_pool/dummy_pool.py`` sleeps 0.1 s when no result is ready):
about 89 % of a rank's epoch went to those sleeps (issue #30). Reading the row groups here
gives the same rows in the same order, and ``tests/training/test_row_groups.py`` holds the two
readers to that.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class InputSpec(Protocol):
    """What of training.input.InputSpec the reader reads (this module sits below it)."""

    @property
    def kind(self) -> str: ...

    @property
    def format(self) -> str: ...

    @property
    def image_shape(self) -> list[int]: ...

    @property
    def feature_columns(self) -> list[str]: ...

    @property
    def label_column(self) -> str: ...

    @property
    def columns(self) -> list[str]: ...


# Row groups read ahead of the one handed over, by reader threads: on a cold page cache the
# epoch's order reads its row groups at random over the files, and a disk keeps up with such
# reads only with several of them under way (one rank, fashion-mnist grown to 8.6 GB: two
# readers read 79 MB/s of files, 0.58 of the device's sequential direct read).
READ_AHEAD = 6
READERS = 4
# With direct I/O nothing is read ahead for the reader but what it asks for itself, and the
# virtual disk here served a rank's random row groups (19 MB requests) faster with more of them
# under way: 877 against 807 MB/s (medians of 3 alternated cold rounds, 8 against 4 readers).
# Decoded row groups wait for the reader beyond the 8 under way only as far as they must: 8
# ahead read as fast as 12 (755 MB/s both, medians of 4 alternated cold rounds of 60 groups)
# and hold 4 row groups fewer (76 MB a rank at 224x224x3), which two ResNet-50 ranks in a
# 2.7 GiB memory cgroup need (bench storage's search, docs/training.md).
READ_AHEAD_DIRECT = 8
READERS_DIRECT = 8


@dataclass(frozen=True)
class RowGroup:
    """One row group: its file (a local path, or a path on ``filesystem``) and its index in
    that file."""

    path: str
    index: int
    rows: int


@dataclass(frozen=True)
class SplitFiles:
    """A split's files in path order, and every row group of them in petastorm's global
    order (the files' path order, then each file's groups)."""

    filesystem: Any
    """None for local files, else the fsspec filesystem the paths are on."""
    groups: tuple[RowGroup, ...]
    metadata: dict[str, Any]
    """Each file's Parquet footer, read once."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each local file's bytes (none on other file systems)."""

    @property
    def nbytes(self) -> int:
        """The local files' bytes."""
        return sum(self.sizes.values())

    def open(self, path: str) -> pq.ParquetFile:
        if self.filesystem is None:
            return pq.ParquetFile(path, metadata=self.metadata[path])
        return pq.ParquetFile(self.filesystem.open(path, "rb"), metadata=self.metadata[path])

    def read_direct(self, group: RowGroup, columns: Sequence[str]) -> pa.Table:
        """``columns`` of ``group``, their column chunks read in one ``O_DIRECT`` request
        (local files only: :func:`direct_io_wanted`)."""
        metadata = self.metadata[group.path]
        start, end = _chunk_span(metadata.row_group(group.index), columns)
        span = _DirectSpan(group.path, self.sizes[group.path], start, end)
        try:
            parquet = pq.ParquetFile(pa.PythonFile(span, mode="r"), metadata=metadata)
            table = parquet.read_row_group(group.index, columns=list(columns), use_threads=False)
            del parquet
        finally:
            span.close()
        return table


# O_DIRECT wants the file offset, the length and the memory aligned to the device's logical
# block; 4 KiB covers every block size Linux uses for it, and mmap's memory is page-aligned.
_DIRECT_ALIGN = 4096


def _chunk_span(row_group: Any, columns: Sequence[str]) -> tuple[int, int]:
    """The byte range of a row group's column chunks of ``columns`` (top-level names)."""
    wanted = set(columns)
    starts, ends = [], []
    for j in range(row_group.num_columns):
        chunk = row_group.column(j)
        if chunk.path_in_schema.split(".", 1)[0] not in wanted:
            continue
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
            start = min(start, chunk.dictionary_page_offset)
        starts.append(start)
        ends.append(start + chunk.total_compressed_size)
    if not starts:
        raise ValueError(f"the row group has none of the columns {sorted(wanted)}")
    return min(starts), max(ends)


class _DirectSpan:
    """A read-only file object over one byte span of a file, read at once with ``O_DIRECT``
    into page-aligned memory; ``read`` hands out views of that memory (pyarrow's PythonFile
    wraps them without copying). Reads outside the span are refused: the footer comes from
    the metadata read before."""

    def __init__(self, path: str, size: int, start: int, end: int) -> None:
        self.size = size
        self.first = start - start % _DIRECT_ALIGN
        length = -(-(end - self.first) // _DIRECT_ALIGN) * _DIRECT_ALIGN
        self._memory = _MEMORY.take(length)
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = 0
            view = memoryview(self._memory)
            while self.first + got < end:
                n = os.preadv(descriptor, [view[got:]], self.first + got)
                if n <= 0:
                    raise OSError(f"{path}: short read at byte {self.first + got} of {end}")
                got += n
            view.release()
        finally:
            os.close(descriptor)
        self._view = memoryview(self._memory)[: min(got, end - self.first)]
        self.last = self.first + len(self._view)
        self.position = 0
        self.closed = False

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: self.size}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, nbytes: int = -1) -> memoryview:
        if nbytes < 0:
            nbytes = self.size - self.position
        if self.position < self.first or self.position + nbytes > self.last:
            raise OSError(
                f"read of bytes {self.position}-{self.position + nbytes} outside the span "
                f"{self.first}-{self.last} read directly"
            )
        begin = self.position - self.first
        self.position += nbytes
        return self._view[begin : begin + nbytes]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        """Done with the span: its memory goes back to the pool for the next row group,
        unless something still holds a view of it (pyarrow decoded values in place)."""
        if self.closed:
            return
        self.closed = True
        self._view.release()
        _MEMORY.give(self._memory)


class _MemoryPool:
    """Page-aligned memory for direct reads, kept from one row group to the next: fresh
    memory costs a page fault and a zeroed page per 4 KiB, which is about what reading through
    the page cache cost (measured: per-row-group mmaps made direct reads dearer than buffered
    ones)."""

    STEP = 4 * 1024 * 1024
    KEPT = READERS_DIRECT + READ_AHEAD_DIRECT + 2

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            for i, memory in enumerate(self._free):
                if len(memory) >= nbytes:
                    return self._free.pop(i)
        return mmap.mmap(-1, -(-nbytes // self.STEP) * self.STEP)

    def give(self, memory: mmap.mmap) -> None:
        try:
            # Refused while a view of the memory is alive (mmap counts its exports).
            memory.resize(len(memory))
        except BufferError:
            return  # freed with the last view
        with self._lock:
            if len(self._free) < self.KEPT:
                self._free.append(memory)
                return
        memory.close()


_MEMORY = _MemoryPool()


def own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup: its folder and the name of its limit file, cgroup v2's
    (``memory.max``) where the host has v2, else v1's memory controller's
    (``memory.limit_in_bytes``); None without either."""
    root = Path("/sys/fs/cgroup")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = (root / "cgroup.controllers").is_file()
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if v2 and controllers == "":
            return root / path.lstrip("/"), "memory.max"
        if not v2 and "memory" in controllers.split(","):
            return root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"
    return None


def cache_memory() -> int:
    """Bytes of page cache this process could hold at most: the host's memory, or its memory
    cgroup's limit when lower (:func:`own_memory_cgroup`)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    own = own_memory_cgroup()
    if own is None:
        return total
    folder, limit_file = own
    try:
        text = (folder / limit_file).read_text().strip()
    except OSError:
        return total
    return min(total, int(text)) if text.isdigit() else total


def direct_io_wanted(files: SplitFiles, memory: int | None = None) -> bool:
    """Whether to read ``files`` with direct I/O: local files larger than the page cache
    could hold (``memory``, default :func:`cache_memory`), which every epoch would only
    evict again, on a file system that takes ``O_DIRECT`` (tmpfs before Linux 6.6 does not)."""
    if files.filesystem is not None or not files.groups:
        return False
    if files.nbytes <= (cache_memory() if memory is None else memory):
        return False
    try:
        descriptor = os.open(files.groups[0].path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(descriptor)
    return True


def _data_file(name: str) -> bool:
    # What petastorm's (pyarrow's legacy) dataset takes for a data file: not hidden, not
    # metadata (_common_metadata, _metadata, _SUCCESS).
    return not name.startswith(("_", ".")) and not name.endswith(".crc")


@functools.lru_cache(maxsize=8)
def split_files(url: str | tuple[str, ...]) -> SplitFiles:
    """The files of a split folder (``file://`` or an fsspec URL such as ``s3://``) or a
    tuple of its files' URLs, with their footers: the same row groups in the same order as
    petastorm's reader of the same URL(s)."""
    import fsspec

    first = url[0] if isinstance(url, tuple) else url
    filesystem, _ = fsspec.core.url_to_fs(first)
    local = first.startswith("file://")
    if isinstance(url, tuple):
        paths = [fsspec.core.url_to_fs(u)[1] for u in url]
    else:
        root = fsspec.core.url_to_fs(url)[1]
        paths = [
            p
            for p in filesystem.find(root)
            if _data_file(p.rstrip("/").rsplit("/", 1)[-1])
            and not any(_hidden(part) for part in p[len(root) :].split("/")[:-1])
        ]
    paths = sorted(paths)
    fs = None if local else filesystem
    sizes = {p: os.path.getsize(p) for p in paths} if fs is None else {}
    metadata: dict[str, Any] = {}
    groups: list[RowGroup] = []
    for path in paths:
        if fs is None:
            meta = pq.read_metadata(path)
        else:
            with fs.open(path, "rb") as handle:
                meta = pq.read_metadata(handle)
        metadata[path] = meta
        groups += [
            RowGroup(path, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)
        ]
    return SplitFiles(filesystem=fs, groups=tuple(groups), metadata=metadata, sizes=sizes)


def _hidden(part: str) -> bool:
    return part.startswith(("_", ".")) and "=" not in part


def binary_pixels(column: pa.ChunkedArray | pa.Array, row_bytes: int) -> np.ndarray[Any, Any]:
    """The values of a binary column of ``row_bytes`` bytes each as a (rows, row_bytes) uint8
    array: a view of the column's data buffer, not a copy, when it is one chunk."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = []
    for chunk in chunks:
        n = len(chunk)
        if chunk.type == pa.large_binary():
            offsets_type: Any = np.int64
        else:
            offsets_type = np.int32
        _validity, offsets_buffer, data = chunk.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=offsets_type)[
            chunk.offset : chunk.offset + n + 1
        ]
        start, end = int(offsets[0]), int(offsets[-1])
        if end - start != n * row_bytes or (n and not (np.diff(offsets) == row_bytes).all()):
            raise ValueError(f"a row group's values are not all {row_bytes} bytes long")
        parts.append(np.frombuffer(data, dtype=np.uint8)[start:end].reshape(n, row_bytes))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty((0, row_bytes), np.uint8)


def ndarray_pixels(column: pa.ChunkedArray, shape: Sequence[int]) -> np.ndarray[Any, Any]:
    """Pixels stored by petastorm's NdarrayCodec (each value an ``np.save`` of a uint8 array
    of ``shape``) as (rows, *shape): the header every value repeats is cut off, without
    decoding value by value; a column whose values do not share one header is decoded by
    petastorm's codec."""
    pixels = int(np.prod(shape))
    rows = len(column)
    if rows == 0:
        return np.empty((0, *shape), np.uint8)
    first = column[0].as_py()
    header = len(first) - pixels
    try:
        values = binary_pixels(column, len(first))
    except ValueError:
        values = None
    if values is not None and header > 0 and (values[:, :header] == values[0, :header]).all():
        import io

        probe = np.load(io.BytesIO(first))
        if probe.dtype == np.uint8 and probe.shape == tuple(shape):
            return values[:, header:].reshape(rows, *shape)
    from petastorm.codecs import NdarrayCodec

    codec = NdarrayCodec()
    decoded: np.ndarray[Any, Any] = np.stack([codec.decode(None, v) for v in column.to_pylist()])
    return decoded.reshape(rows, *shape)


def decode(table: pa.Table, spec: InputSpec) -> tuple[Any, Any]:
    """(inputs, int64 labels) of one row group's columns, as ``spec.arrays`` makes them of
    petastorm's batches: uint8 pixels (rows, cols, channels) or float32 features."""
    labels = table.column(spec.label_column).to_numpy().astype(np.int64, copy=False)
    if spec.kind == "tabular":
        features = np.stack(
            [
                table.column(c).to_numpy().astype(np.float32, copy=False)
                for c in spec.feature_columns
            ],
            axis=1,
        )
        return features, labels
    shape = tuple(spec.image_shape)
    if spec.format == "petastorm":
        return ndarray_pixels(table.column("image"), shape), labels
    pixels = binary_pixels(table.column("image"), int(np.prod(shape)))
    return pixels.reshape(len(labels), *shape), labels


def read_groups(
    files: SplitFiles,
    order: Sequence[int],
    spec: InputSpec,
    *,
    columns: Sequence[str] | None = None,
    readers: int | None = None,
    ahead: int | None = None,
    direct: bool | None = None,
) -> Iterator[tuple[Any, Any]]:
    """(inputs, labels) of the row groups ``order`` names (indexes into ``files.groups``), in
    that order, each read and decoded by one of ``readers`` threads up to ``ahead`` groups
    before it is handed over; with direct I/O when ``direct`` (None: when
    :func:`direct_io_wanted`). Unset, ``readers`` and ``ahead`` are :data:`READERS` and
    :data:`READ_AHEAD`, or their ``_DIRECT`` counterparts with direct I/O. Closing the iterator
    cancels what was not read yet."""
    wanted = list(columns or spec.columns)
    if direct is None:
        direct = direct_io_wanted(files)
    if readers is None:
        readers = READERS_DIRECT if direct else READERS
    if ahead is None:
        ahead = READ_AHEAD_DIRECT if direct else READ_AHEAD

    def read(i: int) -> tuple[Any, Any]:
        group = files.groups[i]
        if direct:
            table = files.read_direct(group, wanted)
        else:
            table = files.open(group.path).read_row_group(
                group.index, columns=wanted, use_threads=False
            )
        return decode(table, spec)

    if readers <= 0:
        for i in order:
            yield read(i)
        return
    pending: deque[Future[tuple[Any, Any]]] = deque()
    upcoming = iter(order)
    with ThreadPoolExecutor(readers, thread_name_prefix="row-groups") as pool:
        try:
            for i in upcoming:
                pending.append(pool.submit(read, i))
                if len(pending) > ahead:
                    break
            while pending:
                result = pending.popleft().result()
                following = next(upcoming, None)
                if following is not None:
                    pending.append(pool.submit(read, following))
                yield result
        finally:
            for future in pending:
                future.cancel()
