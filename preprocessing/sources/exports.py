"""One CasJobs export file into one Parquet file: the per-file task of the Dask ingest.

url (a local path or any fsspec URL) ── read once, streaming; every byte read is hashed
    │  CSV      the header matched here (optional "#Table1" line, UTF-8 BOM); the rows parsed by
    │           pyarrow.csv on one thread with explicit types: ids uint64 (exact, never float),
    │           floats float64 (empty, nan, inf kept as NaN / inf), text string
    │  FITS     astropy memory-maps a local file (hashed on its own); a remote one is first
    │           copied beside ``out``, hashed while copied; every table HDU, in order (all of
    │           one schema, or refused naming the HDU that differs)
    │  VOTable  astropy parses the same hashing stream
    ▼
<out>.<pid>-<token>.partial ── row groups of exactly 100,000 rows (the last smaller): the bytes
    │  depend on the rows only, not on how they arrived; hashed while written, fsynced;
    │  removed on any failure
    ▼
out (renamed whole) + a small dict of digests and counts for the driver to commit

Parallelism comes from running many of these tasks at once (one per input file): on single-
threaded Dask workers, or, for CSV on one machine, on threads of the command's process (the
CSV parser, the Parquet writer and hashlib release the GIL); nothing here starts threads of
its own.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import secrets
import struct
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from data_catalog import Catalog, FileEntry, Manifest, Staging, version_id
from data_catalog.errors import ShardflowError
from data_catalog.layout import ExportsLayout
from preprocessing.driver import Results, TaskSpec, run_job, serial_runner
from preprocessing.fingerprint import stage_code
from preprocessing.shard_files import HashingSink, crash_point, record_result, recorded_result
from preprocessing.sources import derived_ids
from preprocessing.sources.errors import SourceError
from preprocessing.sources.fetch import sha256_file
from preprocessing.sources.inputs import InputFile, list_inputs
from preprocessing.sources.sdss import (
    _IDENT,
    FLOAT64,
    OPTIONAL,
    SCHEMA,
    STRING,
    UINT64,
    _arrow_table,
    _one_line,
    _parse_uint64,
)

__all__ = [
    "ROW_GROUP_ROWS",
    "ExportsJob",
    "convert_export",
    "ingest_exports",
    "output_schema",
    "plan_ingest",
]

# Downstream preprocessing takes a raw file's row groups as its pieces.
ROW_GROUP_ROWS = 100_000

_ARROW_TYPES = {UINT64: pa.uint64(), FLOAT64: pa.float64(), STRING: pa.string()}
# Bytes asked of the input at a time (also pyarrow's CSV block size).
_READ_BLOCK = 1 << 20
# A header line longer than this is not a CasJobs header.
_HEADER_LIMIT = 1 << 16
# Written explicitly so that a change of pyarrow's defaults cannot change the output bytes
# silently. Dictionaries only for the text columns: the float columns are nearly all distinct,
# and a 100,000-row group of them stays under the dictionary page limit, so pyarrow would
# dictionary-encode them to no gain.
_PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "snappy",
    "use_dictionary": ["class", "provenance"],
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
}

_CONVERSION_ERROR = re.compile(
    r"In CSV column #(\d+): Row #(\d+): CSV conversion error to (\w+): "
    r"(?:invalid value '(.*)'|(.*))",
    re.DOTALL,
)
_ROW_ERROR = re.compile(r"Row #(\d+): Expected (\d+) columns, got (\d+)(?:: (.*))?", re.DOTALL)
_FLOATLIKE = re.compile(r"[-+]?[0-9]*\.?[0-9]*[eE.][-+]?[0-9]*")
# Built from its bytes: pyarrow checks every Python value it converts (pa.scalar(math.nan),
# pc.equal(column, "text")) for a pandas object, which imports pandas (0.17 CPU-s) into a
# command that never uses it.
_NAN = pa.Array.from_buffers(pa.float64(), 1, [None, pa.py_buffer(struct.pack("<d", math.nan))])[0]


def output_schema(schema: Mapping[str, str]) -> pa.Schema:
    """The Parquet schema of a raw export file, as ``sdss._arrow_table`` builds it."""
    return pa.schema(
        [pa.field(name, _ARROW_TYPES[kind], nullable=False) for name, kind in schema.items()]
    )


# ---------------------------------------------------------------------------------------------
# Input and output streams that hash what passes through them


class _HashingReader:
    """A read-only stream over ``source`` that hashes and counts every byte it reads from it.

    ``readline`` keeps what it read past the line; ``read`` hands that out first.
    """

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._held = b""
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.closed = False

    def _pull(self, size: int) -> bytes:
        chunk = self._source.read(size)
        self._hash.update(chunk)
        self.bytes += len(chunk)
        return chunk

    def read(self, size: int = -1) -> bytes:
        if self._held:
            if size < 0 or size >= len(self._held):
                chunk, self._held = self._held, b""
            else:
                chunk, self._held = self._held[:size], self._held[size:]
            return chunk
        if size < 0:
            return b"".join(iter(lambda: self._pull(_READ_BLOCK), b""))
        return self._pull(size)

    def readline(self, limit: int) -> bytes:
        """The next line with its end, or what is left; at most ``limit`` bytes searched."""
        while b"\n" not in self._held and len(self._held) < limit:
            chunk = self._pull(_READ_BLOCK)
            if not chunk:
                break
            self._held += chunk
        end = self._held.find(b"\n", 0, limit)
        end = len(self._held) if end < 0 else end + 1
        line, self._held = self._held[:end], self._held[end:]
        return line

    def drain(self) -> None:
        """Read (and hash) whatever the consumer left unread."""
        self._held = b""
        while self._pull(_READ_BLOCK):
            pass

    def digest(self) -> str:
        return self._hash.hexdigest()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.bytes - len(self._held)

    def close(self) -> None:
        self.closed = True


# ---------------------------------------------------------------------------------------------
# Formats and columns


FORMATS = {
    ".csv": "csv",
    ".fits": "fits",
    ".fit": "fits",
    ".fts": "fits",
    ".vot": "votable",
    ".votable": "votable",
    ".xml": "votable",
}


def export_format(path: Path) -> str | None:
    return FORMATS.get(path.suffix.lower())


def match_columns(names: Sequence[str], where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Map export column names onto SCHEMA (+ OPTIONAL), case-insensitively.

    Returns (canonical name -> name in the file, canonical schema of this file).

    Only letter case is mapped (objID, specObjID, petroMag_u ... as CasJobs spells them). The
    spectroscopic redshift must be called ``redshift``: a bare ``z`` is the z-band magnitude,
    and an export with both as ``z`` is refused as a duplicate column, since which is which
    cannot be told from the file."""
    for name in names:
        if not _IDENT.fullmatch(name):
            raise SourceError(f"{where}: column name {name[:40]!r} is not a plain identifier")
    by_lower: dict[str, str] = {}
    for name in names:
        if name.lower() in by_lower:
            raise SourceError(f"{where}: column {name!r} appears twice (ignoring case)")
        by_lower[name.lower()] = name
    wanted = {**SCHEMA, **OPTIONAL}
    known = {n.lower() for n in wanted}
    missing = [n for n in SCHEMA if n.lower() not in by_lower]
    unexpected = [n for n in names if n.lower() not in known]
    if missing or unexpected:
        raise SourceError(
            f"{where}: columns differ from the expected schema: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing)}" if missing else "",
                    f"unexpected {', '.join(unexpected)}" if unexpected else "",
                )
                if part
            )
        )
    mapping = {n: by_lower[n.lower()] for n in wanted if n.lower() in by_lower}
    return mapping, {n: wanted[n] for n in mapping}


def table_column(table: Any, name: str, kind: str, where: str) -> npt.NDArray[Any] | list[str]:
    column = table[name]
    if getattr(column, "mask", None) is not None and np.any(column.mask):
        raise SourceError(f"{where}: column {name} has null values")
    values = np.asarray(column)
    dtype = values.dtype
    if kind == UINT64:
        if dtype.kind == "u":
            return values.astype(np.uint64)
        if dtype.kind == "i":
            if values.size and int(values.min()) < 0:
                raise SourceError(
                    f"{where}: column {name} is signed {dtype.name} with negative values; "
                    "64-bit ids must be exported unsigned or as text"
                )
            return values.astype(np.uint64)
        if dtype.kind in "USO":
            text = values.astype(str)
            return np.array(
                [_parse_uint64(v, where, name, r) for r, v in enumerate(text.tolist(), 1)],
                dtype=np.uint64,
            )
        raise SourceError(
            f"{where}: column {name} is {dtype.name}, not an integer; 64-bit ids lose digits as "
            "floats, re-export it as bigint or text"
        )
    if kind == FLOAT64:
        if dtype.kind not in "iuf":
            raise SourceError(f"{where}: column {name} is {dtype.name}, not a number")
        return values.astype(np.float64)
    if dtype.kind not in "USO":
        raise SourceError(f"{where}: column {name} is {dtype.name}, not text")
    return [str(v).strip() for v in values.astype(str).tolist()]


# ---------------------------------------------------------------------------------------------
# Reading


def _format(url: str) -> str:
    fmt = export_format(Path(urllib.parse.urlsplit(url).path if "://" in url else url))
    if fmt is None:
        raise SourceError(f"{url}: not a CSV, FITS or VOTable file (by its suffix)")
    return fmt


def _open(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """(fsspec filesystem, path in it) of ``url``."""
    import fsspec

    options = dict(storage_options or {})
    if url.startswith(("http://", "https://")):
        # One streamed GET: with a block size fsspec fetches ranges, and a server that ignores
        # Range would send the whole file for every block.
        options.setdefault("block_size", 0)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise SourceError(f"{url}: cannot open: {exc}") from exc
    return fs, str(path)


def _open_error(url: str, exc: OSError) -> SourceError:
    if isinstance(exc, FileNotFoundError):
        return SourceError(f"{url}: no such file")
    return SourceError(f"{url}: cannot read: {exc}")


def _csv_header(stream: _HashingReader, where: str) -> list[str]:
    """The column names of the header line, after an optional "#Table1" line and BOM."""

    def line() -> str:
        raw = stream.readline(_HEADER_LIMIT)
        if raw and not raw.endswith(b"\n") and len(raw) >= _HEADER_LIMIT:
            raise SourceError(f"{where}: header line longer than {_HEADER_LIMIT:,} bytes")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError(f"{where}: unreadable CSV header: {exc}") from exc

    first = line().removeprefix("\ufeff")
    if first.strip() == "#Table1":
        first = line()
    if not first.strip():
        raise SourceError(f"{where}: empty file, no header line")
    try:
        header = next(csv.reader([first.rstrip("\r\n")], strict=True))
    except csv.Error as exc:
        raise SourceError(f"{where}: unreadable CSV header: {exc}") from exc
    return [name.strip() for name in header]


def _csv_error(exc: pa.ArrowInvalid, names: Sequence[str], where: str) -> SourceError:
    """One line naming the file, the row (numbered from the first data row) and the column."""
    message = str(exc)
    if match := _ROW_ERROR.search(message):
        number, expected, actual, text = match.groups()
        return SourceError(
            f"{where}: row {number} has {actual} fields, header has {expected}"
            + (f" ({_one_line(text, 80)})" if text else "")
        )
    if match := _CONVERSION_ERROR.search(message):
        index, number, kind, value, reason = match.groups()
        name = names[int(index)]
        if value is None:
            return SourceError(f"{where}: {name} in row {number}: {_one_line(reason)}")
        shown = repr(value[:30])
        # pyarrow shows bytes that are not UTF-8 as U+FFFD.
        encoding = " (bytes that are not UTF-8)" if "\ufffd" in value else ""
        if kind == "uint64":
            hint = ""
            if _FLOATLIKE.fullmatch(value.strip()):
                hint = "; 64-bit ids lose digits as floats, re-export them as bigint or text"
            return SourceError(
                f"{where}: {name} in row {number} is {shown}{encoding}, not a uint64{hint}"
            )
        return SourceError(f"{where}: {name} in row {number} is {shown}{encoding}, not a number")
    return SourceError(f"{where}: unreadable CSV: {_one_line(message)}")


def _typed_batch(
    batch: pa.RecordBatch,
    schema: Mapping[str, str],
    target: pa.Schema,
    where: str,
    first_row: int,
) -> pa.RecordBatch:
    """The batch in the output's column order and types: float nulls (empty cells) as NaN,
    text trimmed; an empty id is refused."""
    arrays = []
    for name, kind in schema.items():
        column = batch.column(name)
        if kind == STRING:
            column = pc.utf8_trim_whitespace(column)
        elif column.null_count:
            if kind == UINT64:
                row = first_row + pc.index(column.is_null(), True).as_py()
                raise SourceError(f"{where}: {name} in row {row} is empty, not a uint64")
            column = column.fill_null(_NAN)
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=target)


def _csv_batches(stream: _HashingReader, where: str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    names = _csv_header(stream, where)
    variant = derived_ids.variant_of(names)
    if variant is None:
        mapping, kinds = match_columns(names, where)
        canonical = {in_file: name for name, in_file in mapping.items()}
        columns = [canonical[name] for name in names]
        target = read = output_schema(kinds)
    else:
        # An export without usable ids (the DR14 sample): read as it is, ids derived per batch.
        kinds = variant.read_kinds
        columns = list(kinds)
        read, target = output_schema(kinds), variant.schema

    def batches() -> Iterator[pa.RecordBatch]:
        first_row = 1
        try:
            # The header was consumed above: pyarrow numbers the data rows from 1, as we do.
            reader = pcsv.open_csv(
                stream,
                read_options=pcsv.ReadOptions(
                    use_threads=False, block_size=_READ_BLOCK, column_names=columns
                ),
                # No invalid_row_handler: pyarrow decodes a bad row's text as UTF-8 before
                # calling it, and a row that is not UTF-8 then printed "Exception ignored" and
                # a traceback. Without one, the error names the row and its text (decoded with
                # replacement characters).
                convert_options=pcsv.ConvertOptions(
                    column_types={name: _ARROW_TYPES[kinds[name]] for name in columns},
                    # Only an empty cell is null (NaN in a float column, refused for an id);
                    # pyarrow's default list would turn "nan", "NULL", "NA" ... into nulls too.
                    null_values=[""],
                    strings_can_be_null=False,
                ),
            )
            for batch in reader:
                typed = _typed_batch(batch, kinds, read, where, first_row)
                if variant is not None:
                    typed = derived_ids.derive(typed, target, where, first_row)
                yield typed
                first_row += batch.num_rows
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" in str(exc):
                return
            raise _csv_error(exc, columns, where) from None

    return target, batches()


def _astropy_batches(
    source: Path | _HashingReader, fmt: str, where: str
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """As ``sdss._astropy_chunks``, from a path or a stream, naming ``where`` in errors."""
    from astropy.table import Table

    try:
        if fmt == "fits":
            assert isinstance(source, Path)  # FITS is mapped by path (convert_export)
            tables = _fits_tables(source, where)
        else:
            tables = [Table.read(source, format="votable")]
    except SourceError:
        raise
    except Exception as exc:  # astropy raises many kinds for a corrupt file
        raise SourceError(f"{where}: unreadable {fmt.upper()}: {_one_line(str(exc))}") from exc
    mapping, schema = match_columns(list(tables[0].colnames), where)

    def batches() -> Iterator[pa.RecordBatch]:
        # FITS columns stay memory-mapped where astropy can: one row group converted at a time
        # (the writer cuts row groups by count: the tables' boundaries do not show).
        for table in tables:
            yield from _table_batches(table, mapping, schema, where)

    return output_schema(schema), batches()


def _fits_tables(source: Path, where: str) -> list[Any]:
    """Every table HDU of a FITS file, in order (memory-mapped); a SourceError naming the HDU
    whose columns differ from the first's: a file is one export of one schema."""
    from astropy.io import fits
    from astropy.table import Table

    with fits.open(source, memmap=True) as hdul:
        found = [
            (number, hdu.name)
            for number, hdu in enumerate(hdul)
            if isinstance(hdu, fits.BinTableHDU | fits.TableHDU)
        ]
    if not found:
        raise SourceError(f"{where}: no table HDU (BINTABLE or TABLE) in this FITS file")
    tables = []
    for number, _name in found:
        tables.append(
            Table.read(source, format="fits", hdu=number, memmap=True, character_as_bytes=False)
        )
    first = [(name, tables[0][name].dtype.kind) for name in tables[0].colnames]
    for (number, name), table in zip(found[1:], tables[1:], strict=True):
        columns = [(column, table[column].dtype.kind) for column in table.colnames]
        if columns != first:
            raise SourceError(
                f"{where}: HDU {number} ({name or 'unnamed'}) has other columns than HDU "
                f"{found[0][0]} ({', '.join(table.colnames[:5])}"
                f"{', ...' if len(table.colnames) > 5 else ''}): a FITS export's tables must "
                "share one schema; write each schema to a file of its own"
            )
    return tables


def _table_batches(
    table: Any, mapping: dict[str, str], schema: dict[str, str], where: str
) -> Iterator[pa.RecordBatch]:
    """One astropy table's rows as Arrow batches of at most a row group each."""
    for start in range(0, len(table), ROW_GROUP_ROWS):
        part = table[start : start + ROW_GROUP_ROWS]
        columns = {}
        for name, kind in schema.items():
            try:
                columns[name] = table_column(part, mapping[name], kind, where)
            except (UnicodeError, ValueError, TypeError) as exc:
                raise SourceError(
                    f"{where}: column {mapping[name]}: {_one_line(str(exc))}"
                ) from exc
        yield from _arrow_table(columns, schema).to_batches()


# ---------------------------------------------------------------------------------------------
# Writing


class _RowGroupWriter:
    """Writes batches as row groups of exactly ROW_GROUP_ROWS rows, the last one smaller.

    Groups are cut by row count, never where a batch ends, so the bytes do not depend on how
    the input arrived. Within a group pyarrow 14 writes the same bytes however its columns are
    chunked (seen, and held by test_same_input_same_bytes_however_read): no copy into one chunk.
    """

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self._writer = writer
        self._held: list[pa.RecordBatch] = []
        self._held_rows = 0
        self.rows = 0
        self.row_groups = 0
        self.synthetic_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if "provenance" in batch.schema.names:
            # value_counts, not equal(column, "synthetic"): see _NAN.
            counts = pc.value_counts(batch.column("provenance")).to_pylist()
            self.synthetic_rows += sum(c["counts"] for c in counts if c["values"] == "synthetic")
        self._held.append(batch)
        self._held_rows += batch.num_rows
        while self._held_rows >= ROW_GROUP_ROWS:
            self._write(ROW_GROUP_ROWS)

    def finish(self) -> None:
        if self._held_rows:
            self._write(self._held_rows)

    def _write(self, rows: int) -> None:
        held = pa.Table.from_batches(self._held)
        group = held.slice(0, rows)
        rest = held.slice(rows)
        self._held = [b for b in rest.to_batches() if b.num_rows]
        self._held_rows = rest.num_rows
        self._writer.write_table(group, row_group_size=rows)
        self.rows += rows
        self.row_groups += 1


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_parquet(
    out: Path, schema: pa.Schema, batches: Iterator[pa.RecordBatch], where: str
) -> dict[str, Any]:
    """Write ``batches`` to ``out`` whole or not at all; the output's digest, size and counts."""
    partial = out.with_name(f"{out.name}.{os.getpid()}-{secrets.token_hex(6)}.partial")
    try:
        with open(partial, "xb") as f:
            sink = HashingSink(f)
            writer = pq.ParquetWriter(sink, schema, **_PARQUET_OPTIONS)
            groups = _RowGroupWriter(writer)
            try:
                for batch in batches:
                    groups.add(batch)
                groups.finish()
            finally:
                writer.close()
            if groups.rows == 0:
                raise SourceError(f"{where}: no rows")
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_directory(out.parent)
    return {
        "output": {
            "bytes": sink.bytes,
            "sha256": sink.digest(),
            "rows": groups.rows,
            "row_groups": groups.row_groups,
        },
        "synthetic_rows": groups.synthetic_rows,
        **_schema_notes(schema),
    }


def _schema_notes(schema: pa.Schema) -> dict[str, Any]:
    """For a file whose columns are not SCHEMA's (ids derived): its columns and how each
    derived one was made, for the raw version's sources; {} for a usual export."""
    derived = derived_ids.derived_of(schema)
    if not derived:
        return {}
    columns = {f.name: next(k for k, t in _ARROW_TYPES.items() if t == f.type) for f in schema}
    return {"columns": columns, "derived": derived}


# ---------------------------------------------------------------------------------------------
# The task


def convert_export(
    url: str, out: str, *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Convert one CasJobs export (CSV, FITS or VOTable, by suffix) at ``url`` into Parquet at
    the local path ``out``, reading the input once.

    Returns ``{"rows", "input": {"sha256", "bytes", "format"}, "output": {"bytes", "sha256",
    "rows", "row_groups"}, "synthetic_rows"}``; ``out`` exists only when this returns.
    Refuses (SourceError, one line naming the file, and the row and column where there is one)
    schema drift, ids that are not exact uint64 (empty, float-mangled, out of range), numbers
    that are not numbers and rows with the wrong number of fields.
    """
    fmt = _format(url)
    target = Path(out)
    fs, path = _open(url, storage_options)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if fmt == "fits" and "file" in protocols:
        # astropy memory-maps a FITS file by path (a stream it would read whole into memory),
        # so a local one is hashed on its own: a second pass, from the page cache.
        try:
            digest, size = sha256_file(Path(path))
        except OSError as exc:
            raise _open_error(url, exc) from exc
        schema, batches = _astropy_batches(Path(path), fmt, url)
        result = _write_parquet(target, schema, batches, url)
        return _result(result, digest, size, fmt)
    try:
        source = fs.open(path, "rb")
    except OSError as exc:
        raise _open_error(url, exc) from exc
    copy: Path | None = None
    try:
        stream = _HashingReader(source)
        if fmt == "csv":
            schema, batches = _csv_batches(stream, url)
        elif fmt == "votable":
            schema, batches = _astropy_batches(stream, fmt, url)
        else:
            # A remote FITS file: copied beside the output (and hashed) for astropy to map.
            copy = target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(6)}.input")
            with open(copy, "xb") as f:
                while chunk := stream.read(_READ_BLOCK):
                    f.write(chunk)
            schema, batches = _astropy_batches(copy, fmt, url)
        expected = getattr(source, "size", None)  # known for local and object-store files
        checked = _then_drain(batches, stream, expected if isinstance(expected, int) else None, url)
        result = _write_parquet(target, schema, checked, url)
    finally:
        source.close()
        if copy is not None:
            copy.unlink(missing_ok=True)
    return _result(result, stream.digest(), stream.bytes, fmt)


def _then_drain(
    batches: Iterator[pa.RecordBatch], stream: _HashingReader, size: int | None, where: str
) -> Iterator[pa.RecordBatch]:
    """``batches``, then the rest of the input read and hashed, its length checked against
    ``size`` when known; all before the output is renamed."""
    yield from batches
    stream.drain()
    if size is not None and stream.bytes != size:
        raise SourceError(
            f"{where}: read {stream.bytes:,} bytes of {size:,}; the file changed while being read"
        )


def _result(written: dict[str, Any], digest: str, size: int, fmt: str) -> dict[str, Any]:
    return {
        "rows": written["output"]["rows"],
        "input": {"sha256": digest, "bytes": size, "format": fmt},
        **written,
    }


# ---------------------------------------------------------------------------------------------
# The ingest job: one convert task per export file, then one commit

# Bumped when the bytes convert_export writes change for the same input.
WRITER_VERSION = 2


def is_export(name: str) -> bool:
    return export_format(Path(name)) is not None


def _task_output(work: str, number: int, item: InputFile) -> Path:
    # The input's stamp in the name: a file that changed since an interrupted run is
    # converted again, one that did not is kept.
    return Path(work) / f"{number:05d}-{item.stem}-{item.stamp}.parquet"


def convert_task(item: InputFile, number: int, work: str) -> dict[str, Any]:
    """Convert one export into the job's folder, unless an interrupted run of the same job
    already converted this state of it (its result is kept beside the output)."""
    out = _task_output(work, number, item)
    recorded = recorded_result(out)
    if recorded is not None:
        return {**recorded, "number": number, "reused": True}
    result = convert_export(item.url, str(out))
    record_result(out, result)
    crash_point("after-file", out)
    return {**result, "number": number}


@dataclass(frozen=True, kw_only=True)
class Converted:
    """An input file an earlier raw version already holds converted: this state of it (same
    URL, size and modification time or ETag) by this code."""

    manifest: Manifest
    """The version holding it."""
    source: dict[str, Any]
    """Its entry in that version's sources."""
    entry: FileEntry
    """Its converted file in that version."""
    synthetic_rows: int

    def result(self, number: int) -> dict[str, Any]:
        """What converting it again would return."""
        return {
            "number": number,
            "rows": int(self.source["rows"]),
            "input": {k: self.source[k] for k in ("sha256", "bytes", "format")},
            "output": {
                "bytes": self.entry.bytes,
                "sha256": self.entry.sha256,
                "rows": self.entry.rows,
                "row_groups": self.entry.row_groups,
            },
            "synthetic_rows": self.synthetic_rows,
            "reused": True,
            **{k: self.source[k] for k in ("columns", "derived") if k in self.source},
        }


def converted_earlier(catalog: Catalog, name: str = "sdss") -> dict[str, Converted]:
    """Every input an earlier raw version of ``name`` made by this code converted, by the stamp
    of the state it had; the newest version's entry where several hold one."""
    code = stage_code(__name__)
    found: dict[str, Converted] = {}
    for manifest in catalog.versions(name):
        if manifest.kind != "raw" or manifest.code_version != code:
            continue
        sources = {str(s.get("file")): s for s in manifest.sources}
        files = {f.path: f for f in manifest.files}
        for noted in manifest.extra.get("inputs", ()):
            file = str(noted.get("file"))
            if file in sources and file in files and "stamp" in noted:
                found[str(noted["stamp"])] = Converted(
                    manifest=manifest,
                    source=dict(sources[file]),
                    entry=files[file],
                    synthetic_rows=int(noted.get("synthetic_rows", 0)),
                )
    return found


@dataclass(frozen=True, kw_only=True)
class ExportsJob:
    """CasJobs exports into a new raw "sdss" version (a :class:`preprocessing.driver.Job`):
    one convert task per input that no earlier version holds converted; the others are reused
    as they are (their Parquet file shared with the earlier version, neither read nor copied)."""

    source: str
    inputs: tuple[InputFile, ...]
    earlier: dict[str, Converted]
    """:func:`converted_earlier` of the catalog, by stamp."""
    name: str = "sdss"
    kind: str = "raw"
    passes: tuple[str, ...] = ("convert",)

    @property
    def version(self) -> str | None:
        """Known before any work when every input is reused (an unchanged source: its version
        is already committed); else at the commit, from the digests the tasks compute."""
        if not all(item.stamp in self.earlier for item in self.inputs):
            return None
        kept = self.kept("convert", {})
        return version_id(
            name=self.name,
            kind=self.kind,
            parents=(),
            sources=_sources(self.inputs, kept),
            parameters=PARAMETERS,
            code_version=stage_code(__name__),
        )

    @property
    def work_key(self) -> str:
        identity = [stage_code(__name__), WRITER_VERSION, sorted(item.url for item in self.inputs)]
        return f"{self.name}-exports-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}"

    def kept(self, pass_name: str, done: Results) -> list[dict[str, Any]]:
        return [
            self.earlier[item.stamp].result(number)
            for number, item in enumerate(self.inputs, start=1)
            if item.stamp in self.earlier
        ]

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        return [
            TaskSpec(
                key=f"convert-{number:05d}",
                fn=convert_task,
                args=(item, number, str(work)),
                bytes=item.size or 0,
                # Arrow's CSV parser and Parquet writer and hashlib release the GIL; astropy's
                # FITS and VOTable conversion holds it.
                threads=_format(item.url) == "csv",
            )
            for number, item in enumerate(self.inputs, start=1)
            if item.stamp not in self.earlier
        ]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        results = sorted(done["convert"], key=lambda r: int(r["number"]))
        if [int(r["number"]) for r in results] != list(range(1, len(self.inputs) + 1)):
            raise ShardflowError(f"{self.source}: not every input was converted")
        described: dict[str, FileEntry] = {}
        noted: list[dict[str, Any]] = []
        for number, (item, result) in enumerate(zip(self.inputs, results, strict=True), start=1):
            name = _file_name(number, item)
            if item.stamp in self.earlier:
                converted = self.earlier[item.stamp]
                stage.reuse(converted.manifest, converted.entry, name)
            else:
                stage.adopt(_task_output(str(work), number, item), name)
                out = result["output"]
                described[name] = FileEntry(
                    path=name,
                    bytes=int(out["bytes"]),
                    sha256=str(out["sha256"]),
                    rows=int(out["rows"]),
                    row_groups=int(out["row_groups"]),
                )
            noted.append(
                {
                    "file": name,
                    "uri": item.uri,
                    "stamp": item.stamp,
                    "synthetic_rows": int(result["synthetic_rows"]),
                    "reused": item.stamp in self.earlier,
                }
            )
        total = sum(int(r["rows"]) for r in results)
        synthetic = sum(int(r["synthetic_rows"]) for r in results)
        bases = sorted(
            {
                str(self.earlier[i.stamp].manifest.ref)
                for i in self.inputs
                if i.stamp in self.earlier
            }
        )
        if bases:
            stage.note_run(
                new_since={
                    "base": bases[-1] if len(bases) == 1 else bases,
                    "reused": sum(n["reused"] for n in noted),
                    "new": [n["file"] for n in noted if not n["reused"]],
                }
            )
        manifest: Manifest = stage.commit(
            code_version=stage_code(__name__),
            sources=_sources(self.inputs, results),
            parameters=PARAMETERS,
            **ExportsLayout(
                columns=_columns(self.source, results),
                optional=dict(OPTIONAL),
                rows=total,
                num_files=len(results),
                synthetic_rows=synthetic,
            ).to_manifest(),
            rows=total,
            described=described,
            # The state each input had (for the next ingest to find what it need not convert
            # again) and whether this ingest converted it: notes, not identity.
            extra={"inputs": noted},
        )
        return manifest


PARAMETERS = {"format": "casjobs-export"}


def _columns(source: str, results: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The columns every converted file has: SCHEMA's, or those of exports whose ids were
    derived; one version holds files of one schema."""
    found = {json.dumps(r.get("columns", SCHEMA), sort_keys=True) for r in results}
    if len(found) > 1:
        raise SourceError(
            f"{source}: exports whose ids are derived (no objid, spreadsheet-mangled specobjid) "
            "and exports with SDSS's own ids cannot share one raw version; ingest them apart"
        )
    columns: dict[str, str] = results[0].get("columns", dict(SCHEMA)) if results else dict(SCHEMA)
    return dict(columns)


def _file_name(number: int, item: InputFile) -> str:
    return f"{number:05d}-{item.stem}.parquet"


def _sources(
    inputs: Sequence[InputFile], results: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The raw version's sources (part of its identity): each input, its digest and counts."""
    sources = []
    ordered = sorted(results, key=lambda r: int(r["number"]))
    for number, (item, result) in enumerate(zip(inputs, ordered, strict=True), start=1):
        entry: dict[str, Any] = {
            "uri": item.uri,
            "file": _file_name(number, item),
            "format": result["input"]["format"],
            "sha256": result["input"]["sha256"],
            "bytes": result["input"]["bytes"],
            "rows": int(result["rows"]),
        }
        # synth.py's rows say so in a provenance column; CasJobs exports have none.
        marked = int(result["synthetic_rows"])
        if marked:
            entry["provenance"] = "synthetic" if marked == entry["rows"] else "mixed"
        # An export whose ids were rebuilt (derived_ids.py) says so, and which columns it has.
        for key in ("columns", "derived"):
            if key in result:
                entry[key] = result[key]
        sources.append(entry)
    return sources


def plan_ingest(source: str, catalog: Catalog | None = None) -> ExportsJob:
    """The ingest of the CasJobs exports (CSV, FITS, VOTable) in ``source``: a directory, a glob
    or an fsspec URL (reads listings, not files). With ``catalog``, inputs that an earlier raw
    version holds converted (the same state of the same file) are reused, not converted."""
    inputs = list_inputs(source, is_export, f"CSV, FITS or VOTable files ({', '.join(FORMATS)})")
    earlier = converted_earlier(catalog) if catalog is not None else {}
    return ExportsJob(source=source, inputs=tuple(inputs), earlier=earlier)


def ingest_exports(
    catalog: Catalog, *, source: str, progress: Callable[[str], None] = lambda _msg: None
) -> Manifest:
    """The exports in ``source`` into a new raw "sdss" version, in this process (the CLI and
    the flows run :func:`plan_ingest`'s job on Dask, a task per file)."""
    return run_job(catalog, plan_ingest(source, catalog), runner=serial_runner, progress=progress)
