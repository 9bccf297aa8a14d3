"""IDX files (the MNIST / Fashion-MNIST format), read with every check the format allows.

An IDX file is a 4-byte magic number -- two zero bytes, a type code, the number of dimensions --
then one big-endian uint32 per dimension, then the data. MNIST-style sets use type 0x08
(unsigned byte): images are 3-dimensional (count, rows, columns), labels 1-dimensional.

Files may be raw or gzip-compressed; compression is recognised by content, not by name.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import os
import secrets
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from data_catalog.errors import ShardflowError

GZIP_MAGIC = b"\x1f\x8b"
UBYTE = 0x08
# The largest image side accepted unless a dataset says otherwise: MNIST-style sets are 28 x 28;
# a header declaring far more (8000 x 8000 in a 260 KB file) is hostile or broken.
MAX_IMAGE_SIDE = 256
# Deflate cannot compress better than about 1032:1, so a gzip file of n bytes holds at most
# this many times n bytes: a header declaring more is refused before anything is inflated.
_GZIP_MAX_RATIO = 1032
# Type codes of the IDX format; only unsigned bytes occur in the datasets we read.
_TYPE_NAMES = {
    0x08: "ubyte",
    0x09: "byte",
    0x0B: "short",
    0x0C: "int",
    0x0D: "float",
    0x0E: "double",
}


class IdxError(ShardflowError):
    """An IDX file is malformed; the message names the file and what is wrong."""


@dataclass(frozen=True, kw_only=True)
class IdxHeader:
    """What the header of an IDX file declares."""

    type_code: int
    shape: tuple[int, ...]

    @property
    def offset(self) -> int:
        """Bytes before the first data byte."""
        return 4 + 4 * len(self.shape)

    @property
    def count(self) -> int:
        return self.shape[0]

    @property
    def item_bytes(self) -> int:
        """Bytes per record (one image, or one label)."""
        return math.prod(self.shape[1:])


def is_gzip(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _open(path: str | os.PathLike[str]) -> io.BufferedIOBase:
    if is_gzip(path):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_exact(f: io.BufferedIOBase, n: int, path: str | os.PathLike[str], what: str) -> bytes:
    try:
        data = f.read(n)
    except (EOFError, OSError, zlib.error) as exc:
        raise IdxError(f"{path}: corrupt or truncated gzip stream while reading {what}") from exc
    if len(data) != n:
        raise IdxError(f"{path}: truncated: expected {n} bytes of {what}, found {len(data)}")
    return data


def read_header(f: io.BufferedIOBase, path: str | os.PathLike[str]) -> IdxHeader:
    magic = _read_exact(f, 4, path, "the magic number")
    if magic[0:2] != b"\x00\x00":
        raise IdxError(
            f"{path}: not an IDX file (magic {magic.hex()} should start with 0000); "
            "is it an HTML error page or another format?"
        )
    type_code, num_dims = magic[2], magic[3]
    if type_code not in _TYPE_NAMES:
        raise IdxError(f"{path}: unknown IDX type code 0x{type_code:02x}")
    if num_dims == 0:
        raise IdxError(f"{path}: IDX header declares zero dimensions")
    dims = struct.unpack(f">{num_dims}I", _read_exact(f, 4 * num_dims, path, "the dimensions"))
    return IdxHeader(type_code=type_code, shape=tuple(int(d) for d in dims))


def _data_size(path: str | os.PathLike[str], header: IdxHeader, *, limit: int) -> int:
    """Bytes of data after the header, without holding the data in memory; a gzip file is
    inflated only until it holds more than ``limit`` bytes (then a size past it is returned)."""
    if not is_gzip(path):
        return os.path.getsize(path) - header.offset
    size = 0
    with gzip.open(path, "rb") as f:
        f.seek(header.offset)
        while size <= limit:
            chunk = _read_chunk(f, path)
            if not chunk:
                return size
            size += len(chunk)
    return size


def _read_chunk(f: io.BufferedIOBase, path: str | os.PathLike[str]) -> bytes:
    try:
        return f.read(1 << 20)
    except (EOFError, OSError, zlib.error) as exc:
        raise IdxError(f"{path}: corrupt or truncated gzip stream") from exc


@dataclass(frozen=True, kw_only=True)
class IdxPair:
    """A validated images file and labels file of one split."""

    images: Path
    labels: Path
    count: int
    image_shape: tuple[int, int]


def inspect(
    path: str | os.PathLike[str], *, num_dims: int, max_side: int = MAX_IMAGE_SIDE
) -> IdxHeader:
    """Read and check the header of ``path`` against its size; returns the header.

    The header is checked before any data is read (type, rank, no empty dimension, image
    sides at most ``max_side``, no more data declared than the file can hold), and a gzip file
    is inflated only up to the size the header declares."""
    with _open(path) as f:
        header = read_header(f, path)
    _check_declared(path, header, num_dims, max_side)
    expected = header.count * header.item_bytes
    _check_header(path, header, num_dims, _data_size(path, header, limit=expected))
    return header


def _check_declared(
    path: str | os.PathLike[str], header: IdxHeader, num_dims: int, max_side: int
) -> None:
    """Refuse, from the header alone, what no data could make acceptable: another type or
    rank, an empty dimension, images larger than ``max_side`` on a side, or more data declared
    than the file's size can hold."""
    if header.type_code != UBYTE:
        raise IdxError(f"{path}: IDX type {_TYPE_NAMES[header.type_code]}, expected ubyte (0x08)")
    if len(header.shape) != num_dims:
        raise IdxError(
            f"{path}: {len(header.shape)}-dimensional IDX, expected {num_dims} dimensions"
        )
    if header.count == 0:
        raise IdxError(f"{path}: header declares 0 records; the file holds no data")
    if 0 in header.shape[1:]:
        raise IdxError(f"{path}: header declares records of shape {header.shape[1:]}: empty")
    if any(side > max_side for side in header.shape[1:]):
        raise IdxError(
            f"{path}: header declares images of {' x '.join(map(str, header.shape[1:]))} "
            f"pixels; this dataset takes at most {max_side} x {max_side}"
        )
    declared = header.count * header.item_bytes
    stored = os.path.getsize(path)
    if is_gzip(path):
        most = stored * _GZIP_MAX_RATIO
        if declared > most:
            raise IdxError(
                f"{path}: header declares {header.count:,} records ({declared:,} bytes), more "
                f"than a {stored:,}-byte gzip file can hold"
            )
    elif declared > stored - header.offset:
        raise IdxError(
            f"{path}: header declares {header.count} records of shape {header.shape[1:]} "
            f"({declared} bytes) but the file holds {max(0, stored - header.offset)} bytes of "
            "data (truncated?)"
        )


def _check_header(
    path: str | os.PathLike[str], header: IdxHeader, num_dims: int, found: int
) -> None:
    """Refuse a header whose records ``found`` bytes of data do not hold exactly (the header
    itself passed :func:`_check_declared`)."""
    expected = header.count * header.item_bytes
    if found != expected:
        raise IdxError(
            f"{path}: header declares {header.count} records of shape {header.shape[1:]} "
            f"({expected} bytes) but the file holds {'more than ' if found > expected else ''}"
            f"{found} bytes of data" + (" (truncated?)" if found < expected else "")
        )


def decompressed_copy(
    path: str | os.PathLike[str], dest: Path, *, num_dims: int, max_side: int = MAX_IMAGE_SIDE
) -> dict[str, Any]:
    """Check a gzipped IDX file as :func:`inspect` does and write its decompressed bytes to
    ``dest`` (whole or absent), in one read; returns {"header", "sha256", "bytes"} of the copy.
    Nothing is inflated past the size the header declares.

    Shard writers then seek in the copy instead of inflating one serial gzip stream again."""
    digest = hashlib.sha256()
    partial = dest.with_name(f"{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with gzip.open(path, "rb") as f, open(partial, "wb") as out:
            header = read_header(f, path)
            _check_declared(path, header, num_dims, max_side)
            expected = header.count * header.item_bytes
            head = encode_header(header)
            out.write(head)
            digest.update(head)
            size = 0
            while size <= expected and (chunk := _read_chunk(f, path)):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        _check_header(path, header, num_dims, size)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return {"header": header, "sha256": digest.hexdigest(), "bytes": len(head) + size}


def check_labels(path: str | os.PathLike[str], *, num_classes: int) -> None:
    """Refuse a labels file holding a label outside ``0 .. num_classes - 1``."""
    for start, block in iter_records(path, batch=1 << 20):
        bad = np.flatnonzero(block >= num_classes)
        if bad.size:
            index = start + int(bad[0])
            raise IdxError(
                f"{path}: label {int(block[bad[0]])} at record {index} is outside "
                f"0..{num_classes - 1}"
            )


def check_pair(
    images: str | os.PathLike[str], labels: str | os.PathLike[str], *, num_classes: int
) -> IdxPair:
    """Validate an images/labels pair: magic, dimensions, size, equal counts, label range."""
    image_header = inspect(images, num_dims=3)
    label_header = inspect(labels, num_dims=1)
    if image_header.count != label_header.count:
        raise IdxError(
            f"{images} holds {image_header.count} images but {labels} holds "
            f"{label_header.count} labels"
        )
    check_labels(labels, num_classes=num_classes)
    rows, cols = image_header.shape[1], image_header.shape[2]
    return IdxPair(
        images=Path(images), labels=Path(labels), count=image_header.count, image_shape=(rows, cols)
    )


def read_records(
    path: str | os.PathLike[str], start: int = 0, count: int | None = None
) -> npt.NDArray[np.uint8]:
    """Records ``start`` .. ``start + count`` of a validated ubyte IDX file, shape (n, *dims).

    Memory is bounded by the records asked for: raw files are read at an offset, gzip files are
    decompressed as a stream up to the offset.
    """
    with _open(path) as f:
        header = read_header(f, path)
        if count is None:
            count = header.count - start
        if start < 0 or count < 0 or start + count > header.count:
            raise IdxError(
                f"{path}: records {start}..{start + count} asked for, file holds {header.count}"
            )
        f.seek(header.offset + start * header.item_bytes)
        data = _read_exact(f, count * header.item_bytes, path, f"{count} records")
    return np.frombuffer(data, dtype=np.uint8).reshape((count, *header.shape[1:]))


def iter_records(
    path: str | os.PathLike[str], *, batch: int
) -> Iterator[tuple[int, npt.NDArray[np.uint8]]]:
    """(start index, records) blocks of at most ``batch`` records, streamed."""
    with _open(path) as f:
        header = read_header(f, path)
        start = 0
        while start < header.count:
            n = min(batch, header.count - start)
            data = _read_exact(f, n * header.item_bytes, path, f"records {start}..{start + n}")
            yield start, np.frombuffer(data, dtype=np.uint8).reshape((n, *header.shape[1:]))
            start += n


def encode_header(header: IdxHeader) -> bytes:
    """The bytes of an IDX header."""
    dims = len(header.shape)
    return bytes([0, 0, header.type_code, dims]) + struct.pack(f">{dims}I", *header.shape)


def encode(array: npt.NDArray[np.uint8]) -> bytes:
    """The IDX bytes of a uint8 array (any number of dimensions)."""
    if array.dtype != np.uint8:
        raise ValueError(f"IDX writer takes uint8 arrays, got {array.dtype}")
    header = IdxHeader(type_code=UBYTE, shape=tuple(int(d) for d in array.shape))
    return encode_header(header) + np.ascontiguousarray(array).tobytes()


def write(path: str | os.PathLike[str], array: npt.NDArray[np.uint8], *, compress: bool) -> None:
    """Write ``array`` as an IDX file, gzip-compressed when ``compress``."""
    data = encode(array)
    if compress:
        # mtime=0 so the same array always gives the same bytes (stable digests).
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
            gz.write(data)
        data = buf.getvalue()
    Path(path).write_bytes(data)
