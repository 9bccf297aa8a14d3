"""Raw SDSS photometry + spectroscopic classes → features for star/galaxy/QSO training, one raw
piece at a time, so that a new raw version redoes only the pieces it adds.

raw version "sdss": Parquet files (from SkyServer pages or CasJobs exports), row groups of at
most 100,000 rows; a *piece* is one row group of one file, named by the file's sha256 and the
group's index, numbered in the raw version's file order
    │  scan pass, one Dask task per piece: rows with a sentinel (-9999 ...), NaN, an unknown
    │  class or the (objid, specobjid) of an earlier row of the piece are set aside with their
    │  reason; the good rows are hashed by (objid, specobjid) into train/validation/test
    │  (features computed: magnitudes, colours u-g g-r r-i i-z, Petrosian magnitudes and radii,
    │  the class encoded, redshift and the ids kept), their keys written sorted by key hash
    ▼
(matches pass, only when an earlier version holds every piece but the new ones, in order: at
most 16 tasks, each a group of earlier pieces, keep the earlier keys whose key hash a new key
has; each earlier key hash is read once)
    ▼
duplicates pass, one task per range of key buckets (a bucket: a range of the key hash, about
250,000 keys; at most 16 tasks, each mapping every piece's keys file once): bucket by bucket,
the keys of that bucket from every piece (after a matches pass: from the new pieces and the
matched earlier keys, plus the earlier version's duplicates); a key already in a lower piece
marks its row a duplicate
    │  rescan pass, one task per piece holding such rows: the scan again, those rows quarantined
    │  as "duplicate (objid, specobjid)" too (none when the pieces share no key)
    ▼
write pass, one task per piece: its rows of each split into split=<split>/part-NNNNN.parquet, in
row groups of R rows (its last one shorter: no row is dropped or repeated); its quarantined rows
into _quarantine/part-NNNNN.parquet; its keys into _state/keys/part-NNNNN.arrow; its training rows'
feature sums for the normalisation
    ▼
processed version "sdss-processed"; rows in = rows out + rows quarantined; _state/pieces.json
records every piece's counts, sums, duplicates and files, _state/duplicates.arrow every row
repeating a lower piece's key

Every output of a piece depends on that piece, R, the split fractions and which of its rows
repeat a lower piece's keys: a processed version of a raw version that adds pieces to an earlier
one (a nightly export) reuses the earlier version's outputs of every piece whose duplicates did
not change (the files are shared, not copied) and scans, writes and stores only the new ones.
The result is the same, byte for byte, as processing the new raw version from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from data_catalog import (
    Catalog,
    FileEntry,
    Manifest,
    ParentRef,
    Staging,
    derived_version,
    processed_name,
)
from data_catalog.errors import ConfigError, ShardflowError
from data_catalog.layout import (
    QUARANTINE,
    ProcessedLayout,
    Quarantine,
    SplitLayout,
    part_folder,
    version_file,
)
from data_catalog.staged_files import digest
from preprocessing import schemas, splits
from preprocessing.config import JobOptions
from preprocessing.driver import Result, Results, TaskSpec
from preprocessing.fingerprint import stage_code
from preprocessing.publish import commit_processed
from preprocessing.raw_files import local_copy, parquet_file
from preprocessing.shard_files import (
    described,
    partial_path,
    record_result,
    recorded_result,
    write_parquet,
)
from preprocessing.statistics import normalization_of

# Bumped when the bytes this module writes change for the same input and parameters.
# 4: floats byte-stream-split without dictionary, ids delta-packed; 5: no statistics of floats
WRITER_VERSION = 5
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1

_BANDS = ("u", "g", "r", "i", "z")
_MAGNITUDES = (*_BANDS, *(f"petroMag_{b}" for b in _BANDS))
_RADII = tuple(f"petroRad_{b}" for b in _BANDS)
# SDSS marks missing photometry with -9999 (and -1000 and the like); real magnitudes are
# between about 5 and 35, Petrosian radii positive.
_MAGNITUDE_RANGE = (0.0, 40.0)
_RADIUS_RANGE = (0.0, 1_000.0)
_CLASSES = pa.array(schemas.SDSS_CLASSES, type=pa.string())
# Keys are compared across pieces in buckets (ranges of the key hash) of about this many, one
# task each: a task's memory stays flat however many rows the input has. Two such tasks run
# at once in one process on threads (preprocessing.cluster.PlannedRunner): at 1,000,000 keys
# they lifted its peak RSS by 150 MB, to 390 MB at 2M rows.
KEY_BUCKET_ROWS = 250_000
# ... and at least this many (no more than there are pieces), so that one bucket task does not
# keep one worker busy while the others wait.
MIN_KEY_BUCKETS = 2
MAX_KEY_BUCKETS = 1 << 16
# Duplicates tasks: at most this many, each a contiguous range of buckets, so that a task maps
# each piece's keys file once for all its buckets (a mapping and its first page faults cost
# about 0.14 ms of CPU per file: with a task per bucket, 22.5 CPU-s for the 256 buckets of a
# 20 GB base, measured alone, and most of a 1 % delta's 45; growing as pieces x buckets;
# docs/scale.md). A constant, not a function of the workers: the plan
# is made before the runner, and how the work is split never changes what is written. 16 keeps
# 16 workers busy, balances 2 to 8 of them, and is a power of two like the bucket count, so
# every task gets as many buckets; a task still handles one bucket at a time (flat memory).
MAX_DUPLICATE_TASKS = 16
# The work subfolder of a piece scanned again to drop its duplicates of other pieces' rows.
RESCAN_FOLDER = "rescan"
# What every processed version records of its pieces, for the next version to reuse them.
PIECES_FILE = "_state/pieces.json"
# ... and of its rows that repeat a lower piece's key (piece key, row, key hash): the next
# version's duplicates pass then compares only the keys of the pieces it adds (docs/scale.md).
DUPLICATES_FILE = "_state/duplicates.arrow"
# Matches tasks (that comparison's first half) read about this many of the earlier pieces' keys
# each, at least two tasks and at most MAX_DUPLICATE_TASKS: each task first builds the table of
# the new keys' hashes (about 40 ms of CPU per 500,000 new keys), then reads each key hash once
# (about 6 ns each). At 8,000,000 a 20 GB base took 7 tasks and 1.0 CPU-s; at 32,000,000, 2.
MATCH_TASK_ROWS = 32_000_000
SPLIT_BY = "hash of (objid, specobjid) (preprocessing.splits.sample_hash)"


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One raw row group: the unit the scan pass reads and every output is cut by."""

    number: int
    path: str
    """A local path or an object-store URL."""
    row_group: int
    rows: int
    key: str = ""
    """What it is, whatever its number: "<sha256 of its raw file>#<row group>"."""


def read_piece(piece: Piece) -> tuple[pa.Table, int]:
    """The piece's rows, and the bytes of its row group in the file (what was read)."""
    source = parquet_file(piece.path)
    group = source.metadata.row_group(piece.row_group)
    read = sum(group.column(i).total_compressed_size for i in range(group.num_columns))
    table: pa.Table = source.read_row_group(piece.row_group)
    return table, read


def _checks() -> list[tuple[str, str]]:
    """(column, reason) of every check, in the order a row's first failure is reported."""
    checks = []
    for name in (*_MAGNITUDES, *_RADII):
        checks += [(name, f"nan:{name}"), (name, f"infinite:{name}"), (name, f"sentinel:{name}")]
    return [*checks, ("redshift", "nan:redshift"), ("class", "unknown class")]


# Reason 0 is a good row; a reason's number is its position here, the same for every piece.
DUPLICATE = "duplicate (objid, specobjid)"
REASONS = ("", *(reason for _column, reason in _checks()), DUPLICATE)
_REASON_CODE = {reason: code for code, reason in enumerate(REASONS)}


@dataclass(frozen=True, kw_only=True)
class Scanned:
    """What the scan learns of a piece's rows, each computed once: the checks' float columns
    feed the features, the sample hash both the split and the key hash, the one sort by key
    hash both the repeats within the piece and the keys file."""

    codes: npt.NDArray[np.int16]
    """Why each row cannot be used: an index into :data:`REASONS` (0 when it can)."""
    floats: dict[str, npt.NDArray[np.float64]]
    labels: npt.NDArray[np.int64]
    """Each row's index into SDSS_CLASSES; -1 for a class outside them."""
    objid: npt.NDArray[np.uint64]
    specobjid: npt.NDArray[np.uint64]
    sample: npt.NDArray[np.uint64]
    """:func:`splits.sample_hash` of (objid, specobjid): the split's hash."""
    hashes: npt.NDArray[np.uint64]
    """:func:`key_hash`: the duplicates passes' buckets."""
    order: npt.NDArray[np.intp]
    """The rows by key hash (a stable sort: equal hashes in row order)."""

    def floats_of(self, table: pa.Table, name: str) -> npt.NDArray[np.float64]:
        if name not in self.floats:
            self.floats[name] = _float64(table, name)
        return self.floats[name]


def _float64(table: pa.Table, name: str) -> npt.NDArray[np.float64]:
    # No copy when the column is float64 already (a raw SDSS piece's are); nulls become NaN.
    values = table.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=np.float64)


def _ids(table: pa.Table, name: str) -> npt.NDArray[np.uint64]:
    return np.asarray(table.column(name).to_numpy(), dtype=np.uint64)


def scanned(table: pa.Table) -> Scanned:
    """:class:`Scanned` of ``table``'s rows. A row's reason is its first failed check, in a
    fixed order; then a repeat of an earlier row's (objid, specobjid) in the same piece
    (repeats across pieces: :func:`find_duplicates`)."""
    codes = np.zeros(table.num_rows, dtype=np.int16)

    def mark(bad: npt.NDArray[np.bool_], reason: str) -> None:
        codes[bad & (codes == 0)] = _REASON_CODE[reason]

    floats: dict[str, npt.NDArray[np.float64]] = {}
    for name in (*_MAGNITUDES, *_RADII):
        if name not in table.column_names:
            continue  # a source without Petrosian columns (its features have none)
        values = floats[name] = _float64(table, name)
        low, high = _MAGNITUDE_RANGE if name in _MAGNITUDES else _RADIUS_RANGE
        mark(np.isnan(values), f"nan:{name}")
        mark(~np.isfinite(values), f"infinite:{name}")
        mark((values <= low) | (values >= high), f"sentinel:{name}")
    redshift = floats["redshift"] = _float64(table, "redshift")
    mark(~np.isfinite(redshift), "nan:redshift")
    # A null class, or one outside SDSS_CLASSES, has no index.
    index = pc.index_in(table.column("class"), value_set=_CLASSES).fill_null(-1)
    labels = np.asarray(index.to_numpy(zero_copy_only=False), dtype=np.int64)
    mark(labels < 0, "unknown class")
    objid, specobjid = _ids(table, "objid"), _ids(table, "specobjid")
    sample = splits.sample_hash(objid, specobjid)
    hashes = _key_hash_of(sample)
    order = stable_order(hashes)
    mark(_repeats(hashes, objid, specobjid, order), DUPLICATE)
    return Scanned(
        codes=codes,
        floats=floats,
        labels=labels,
        objid=objid,
        specobjid=specobjid,
        sample=sample,
        hashes=hashes,
        order=order,
    )


def stable_order(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
    """``np.argsort(hashes, kind="stable")`` at the speed of numpy's unstable sort: 1.9 ms
    against 8.9 ms at 100,000 random keys (numpy 1.26 sorts 64-bit keys stably by merging,
    unstably with AVX-512). Equal hashes, the repeats of a key, are rare: only their runs are
    then put in row order."""
    order = np.argsort(hashes)
    h = hashes[order]
    tie = h[1:] == h[:-1]
    if tie.any():
        in_run = np.zeros(len(order), dtype=bool)
        in_run[1:] |= tie
        in_run[:-1] |= tie
        positions = np.flatnonzero(in_run)
        rows = order[positions]
        # The runs' positions are in hash order already: sorting them by (hash, row) leaves
        # each run where it is, its rows ascending.
        order[positions] = rows[np.lexsort((rows, h[positions]))]
    return order


def _repeats(
    hashes: npt.NDArray[np.uint64],
    objid: npt.NDArray[np.uint64],
    specobjid: npt.NDArray[np.uint64],
    order: npt.NDArray[np.intp],
) -> npt.NDArray[np.bool_]:
    """The rows whose (objid, specobjid) an earlier row has, from ``order`` (the rows by
    hash, stably): a key's rows are neighbours there, its first row first."""
    h, o, s = hashes[order], objid[order], specobjid[order]
    same_hash = h[1:] == h[:-1]
    same_key = same_hash & (o[1:] == o[:-1]) & (s[1:] == s[:-1])
    repeated = np.zeros(len(order), dtype=bool)
    repeated[order[1:][same_key]] = True
    collided = same_hash & ~same_key
    if collided.any():
        # Two keys of one hash (about one pair in 2^64): their rows need not be neighbours,
        # so those hashes' rows are compared in full.
        rows = order[np.isin(h, h[1:][collided])]
        keys = np.stack([objid[rows], specobjid[rows]], axis=1)
        _unique, first = np.unique(keys, axis=0, return_index=True)
        repeated[rows] = True
        repeated[rows[first]] = False
    return repeated


def quarantine_codes(table: pa.Table) -> npt.NDArray[np.int16]:
    """Why each row cannot be used, as an index into :data:`REASONS` (0 when it can): see
    :func:`scanned`."""
    return scanned(table).codes


def quarantine_reasons(table: pa.Table) -> npt.NDArray[np.object_]:
    """:func:`quarantine_codes` as their reasons ("" when the row can be used)."""
    reasons: npt.NDArray[np.object_] = np.asarray(REASONS, dtype=object)[quarantine_codes(table)]
    return reasons


def split_codes(table: pa.Table, fractions: dict[str, float]) -> npt.NDArray[np.int8]:
    """The split of each row (an index into :data:`splits.SPLITS`) from (objid, specobjid)."""
    objid, specobjid = _ids(table, "objid"), _ids(table, "specobjid")
    return splits.assign(splits.sample_hash(objid, specobjid), fractions)


def features(
    table: pa.Table,
    scan: Scanned,
    rows: npt.NDArray[np.intp],
    stored: tuple[str, ...] = schemas.SDSS_FEATURES,
) -> pa.Table:
    """The output rows of ``table``'s ``rows`` (good rows, ascending), in
    :func:`schemas.sdss_schema` of ``stored``: colours are differences of magnitudes taken in
    float64, every feature then float32."""
    values: dict[str, Any] = {}
    for name in stored:
        if "_" in name and name.split("_")[0] in _BANDS and name.split("_")[1] in _BANDS:
            first, second = name.split("_")
            difference = scan.floats_of(table, first)[rows] - scan.floats_of(table, second)[rows]
            values[name] = difference.astype(np.float32)
        else:
            values[name] = scan.floats_of(table, name)[rows].astype(np.float32)
    values["label"] = scan.labels[rows]
    values["redshift"] = scan.floats_of(table, "redshift")[rows]
    values["objid"] = scan.objid[rows]
    values["specobjid"] = scan.specobjid[rows]
    schema = schemas.sdss_schema(stored)
    return pa.Table.from_arrays([values[name] for name in schema.names], schema=schema)


def segment_path(work: str, piece: int, split: str) -> Path:
    """The good rows of ``split`` in piece ``piece``, as features, in an Arrow IPC file."""
    return Path(work) / "segments" / f"{piece:05d}-{split}.arrow"


def keys_path(work: str, piece: int) -> Path:
    """The good rows' (objid, specobjid) of piece ``piece``, their key hash and their row
    numbers in the piece, sorted by key hash, in an Arrow IPC file."""
    return Path(work) / "keys" / f"{piece:05d}.arrow"


def duplicates_path(work: str, bucket: int) -> Path:
    """The (piece, row) of the rows of key bucket ``bucket`` that repeat a lower piece's key."""
    return Path(work) / "duplicates" / f"{bucket:05d}.arrow"


def matches_path(work: str, group: int) -> Path:
    """The keys of group ``group`` of an earlier version's pieces whose key hash a new piece's
    key shares: (piece, hash, objid, specobjid, row), sorted by key hash."""
    return Path(work) / "matches" / f"{group:05d}.arrow"


def output_path(split: str, piece: int) -> str:
    """Where piece ``piece``'s rows of ``split`` go in the version (also "quarantine")."""
    return version_file(split, f"part-{piece:05d}.parquet")


def keys_output_path(piece: int) -> str:
    return f"_state/keys/part-{piece:05d}.arrow"


def num_key_buckets(rows: int, pieces: int = 1) -> int:
    """Key buckets for ``rows`` raw rows in ``pieces`` pieces: a power of two, at least one.
    The count changes how the work is split, never what is written."""
    wanted = max(1, -(-rows // KEY_BUCKET_ROWS), min(pieces, MIN_KEY_BUCKETS))
    return min(MAX_KEY_BUCKETS, 1 << (wanted - 1).bit_length())


def duplicate_task_buckets(num_buckets: int) -> list[tuple[int, int]]:
    """The buckets of each duplicates task, [first, stop): contiguous ranges of equal size, at
    most :data:`MAX_DUPLICATE_TASKS` of them (both counts powers of two), one bucket each when
    there are no more buckets than that."""
    tasks = min(num_buckets, MAX_DUPLICATE_TASKS)
    size = num_buckets // tasks
    return [(task * size, (task + 1) * size) for task in range(tasks)]


def key_hash(
    objid: npt.NDArray[np.uint64], specobjid: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint64]:
    """The hash that orders keys into buckets: independent of the split's hash (which takes
    the sample hash's high bits), so that every bucket holds every split."""
    return _key_hash_of(splits.sample_hash(objid, specobjid))


def _key_hash_of(sample: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    return splits.mix64(sample ^ np.uint64(0x5BD1E9955BD1E995))


def bucket_bounds(bucket: int, num_buckets: int) -> tuple[int, int]:
    """The key hashes of ``bucket`` of ``num_buckets`` (a power of two): [low, high)."""
    width = (1 << 64) // num_buckets
    return bucket * width, (bucket + 1) * width


def _write_ipc(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _write_keys(scan: Scanned, path: Path) -> Result:
    """The good rows' keys, key hashes and row numbers into ``path``, sorted by key hash (so
    that any number of buckets slices it); its {"bytes", "sha256"}."""
    rows = scan.order[scan.codes[scan.order] == 0]
    keys = pa.table(
        {
            "hash": scan.hashes[rows],
            "objid": scan.objid[rows],
            "specobjid": scan.specobjid[rows],
            "row": rows.astype(np.int64),
        }
    )
    _write_ipc(keys, path)
    # Hashed here, on the task's thread, rather than read again by the commit.
    return {"bytes": path.stat().st_size, "sha256": digest(path)[1]}


def scan_piece(
    piece: Piece,
    fractions: dict[str, float],
    work: str,
    stored: tuple[str, ...] = schemas.SDSS_FEATURES,
) -> Result:
    """Scan task, the one read of a raw piece (unless it holds duplicates of other pieces'
    rows): its bad rows set aside with their reason; its good rows, as features, into one
    Arrow IPC segment per split (which its write task reads, memory-mapped, instead of the
    piece again), their keys into its keys file; counts per split."""
    done = segment_path(work, piece.number, splits.SPLITS[0])
    recorded = recorded_result(done)
    if recorded is not None and recorded.get("key") == piece.key:
        return {**recorded, "reused": True}
    table, read = read_piece(piece)
    scan = scanned(table)
    keys_file = _write_keys(scan, keys_path(work, piece.number))
    result = _write_scan(piece.number, table, scan, fractions, work, stored)
    result["key"] = piece.key
    result["keys"] = str(keys_path(work, piece.number))
    result["keys_file"] = keys_file
    result["input"] = {"bytes": read}
    record_result(done, result)
    return result


KEY_COLUMNS = ("hash", "objid", "specobjid", "row")
# The columns the duplicates tasks compare, with the piece of each key, and their types.
KEY_KINDS: dict[str, type] = {
    "piece": np.int64,
    "hash": np.uint64,
    "objid": np.uint64,
    "specobjid": np.uint64,
    "row": np.int64,
}


def _mapped_keys(path: str, columns: tuple[str, ...] = KEY_COLUMNS) -> dict[str, npt.NDArray[Any]]:
    """A keys file's columns as numpy views of its memory map (its file is closed at once: the
    mapping lives as long as the arrays, and a task holding every piece's keys holds no file
    descriptors)."""
    with pa.memory_map(path) as source:
        keys = pa.ipc.open_file(source).read_all()
    return {name: keys.column(name).to_numpy() for name in columns}


def _bucket_starts(
    hashes: npt.NDArray[np.uint64], buckets: range, num_buckets: int
) -> npt.NDArray[np.int64]:
    """Where each of ``buckets`` (contiguous) starts in sorted ``hashes``, and where the last
    one stops: one binary search of all the bounds."""
    lows = [bucket_bounds(bucket, num_buckets)[0] for bucket in buckets]
    high = bucket_bounds(buckets[-1], num_buckets)[1]
    # The last bucket runs to the end (2**64 is no uint64).
    ends = [high] if high < 1 << 64 else []
    starts = np.searchsorted(hashes, np.array([*lows, *ends], dtype=np.uint64), side="left")
    stops: npt.NDArray[np.int64] = np.append(starts, len(hashes)) if not ends else starts
    return stops.astype(np.int64)


@dataclass(frozen=True)
class KnownDuplicates:
    """An earlier version's rows that repeat a lower piece's key (its :data:`DUPLICATES_FILE`),
    and the number each of its pieces has now: they repeat it still when the earlier pieces
    keep their order and none is gone."""

    location: str
    numbers: dict[str, int]
    """This version's number of each earlier piece, by piece key."""

    def read(self, work: str) -> dict[str, npt.NDArray[Any]]:
        """Their (piece, row, hash), sorted by key hash, pieces numbered as now."""
        with pa.memory_map(local_copy(self.location, work)) as source:
            table = pa.ipc.open_file(source).read_all()
        pieces = table.column("piece").combine_chunks()
        numbers = np.array(
            [self.numbers[key] for key in pieces.dictionary.to_pylist()], dtype=np.int64
        )
        return {
            "piece": numbers[pieces.indices.to_numpy()],
            "row": table.column("row").to_numpy(),
            "hash": table.column("hash").to_numpy(),
        }


def find_duplicates(
    buckets: tuple[int, int],
    num_buckets: int,
    keys: tuple[tuple[int, str], ...],
    work: str,
    matches: tuple[str, ...] = (),
    known: KnownDuplicates | None = None,
) -> Result:
    """Duplicates task, the key buckets ``range(*buckets)``: ``keys`` are (piece, keys file) of
    every piece, each mapped once for all the buckets; then bucket by bucket,
    :func:`bucket_duplicates` of its slice of every file. A bucket a run before this one
    recorded is not done again. The result: each bucket's, in bucket order, under "buckets".

    An incremental run passes the new pieces' keys only, with the earlier pieces' keys that
    share a hash with one of them (``matches``, :func:`match_old_keys`) and the earlier
    version's own duplicates (``known``): what a run over every piece's keys finds."""
    todo = range(*buckets)
    recorded = {bucket: recorded_result(duplicates_path(work, bucket)) for bucket in todo}
    results: dict[int, Result] = {
        bucket: {**result, "reused": True}
        for bucket, result in recorded.items()
        if result is not None
    }
    left = [bucket for bucket in todo if bucket not in results]
    if left:
        span = range(left[0], left[-1] + 1)
        files = []
        for number, path in keys:
            columns = _mapped_keys(local_copy(path, work))
            columns["piece"] = np.full(len(columns["row"]), number, dtype=np.int64)
            files.append((columns, _bucket_starts(columns["hash"], span, num_buckets)))
        for path in matches:
            columns = _mapped_keys(path, ("piece", *KEY_COLUMNS))
            files.append((columns, _bucket_starts(columns["hash"], span, num_buckets)))
        drops = None
        if known is not None:
            columns = known.read(work)
            drops = (columns, _bucket_starts(columns["hash"], span, num_buckets))
        for bucket in left:
            at = bucket - left[0]
            parts = [_sliced(columns, starts, at) for columns, starts in files]
            earlier = _sliced(*drops, at) if drops is not None else None
            results[bucket] = bucket_duplicates(bucket, parts, work, earlier)
    return {
        "buckets": [results[bucket] for bucket in todo],
        "reused": not left,
    }


def _sliced(
    columns: dict[str, npt.NDArray[Any]], starts: npt.NDArray[np.int64], at: int
) -> dict[str, npt.NDArray[Any]]:
    """The rows of bucket ``at`` (of :func:`_bucket_starts`) of every column."""
    return {name: column[starts[at] : starts[at + 1]] for name, column in columns.items()}


def _concatenated(
    parts: Sequence[dict[str, npt.NDArray[Any]]], names: dict[str, type]
) -> tuple[npt.NDArray[Any], ...]:
    return tuple(
        np.concatenate([part[name] for part in parts]).astype(kind, copy=False)
        if parts
        else np.zeros(0, dtype=kind)
        for name, kind in names.items()
    )


def bucket_duplicates(
    bucket: int,
    parts: Sequence[dict[str, npt.NDArray[Any]]],
    work: str,
    earlier: dict[str, npt.NDArray[Any]] | None = None,
) -> Result:
    """One key bucket: ``parts`` are the keys of the bucket (piece, hash, objid, specobjid,
    row) of every piece. Of the rows sharing a key, the one in the lowest piece is kept; the
    others, and the ``earlier`` duplicates (piece, row, hash) if any, are written to
    :func:`duplicates_path`, by (piece, row). A piece holds a key once (the scan quarantined
    its repeats), so which row is first never depends on the order of the tasks."""
    out = duplicates_path(work, bucket)
    piece, hashes, objid, specobjid, row = _concatenated(parts, KEY_KINDS)
    keys_in_bucket = len(objid)
    # Only rows whose objid occurs more than once can repeat a key: one sort of one column
    # finds them (a four-column lexsort of every key cost 10 % of the whole preprocess).
    # Any sort will do (the lexsort below orders the candidates fully): not a stable one.
    by_objid = np.argsort(objid)
    same = objid[by_objid][1:] == objid[by_objid][:-1]
    shared = np.zeros(keys_in_bucket, dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    candidates = by_objid[shared]
    objid, specobjid, row, piece, hashes = (
        a[candidates] for a in (objid, specobjid, row, piece, hashes)
    )
    order = np.lexsort((row, piece, specobjid, objid))
    objid, specobjid = objid[order], specobjid[order]
    repeat = np.zeros(len(order), dtype=bool)
    repeat[1:] = (objid[1:] == objid[:-1]) & (specobjid[1:] == specobjid[:-1])
    dropped = {
        "piece": piece[order][repeat],
        "row": row[order][repeat],
        "hash": hashes[order][repeat],
    }
    if earlier is not None:
        # The earlier version's duplicates, some of which a new key may have found again.
        dropped = {name: np.concatenate([dropped[name], earlier[name]]) for name in dropped}
        _, first = np.unique(
            np.stack([dropped["piece"], dropped["row"]]), axis=1, return_index=True
        )
        dropped = {name: column[first] for name, column in dropped.items()}
    by = np.lexsort((dropped["row"], dropped["piece"]))
    _write_ipc(pa.table({name: column[by] for name, column in dropped.items()}), out)
    pieces, counts = np.unique(dropped["piece"], return_counts=True)
    result: Result = {
        "bucket": bucket,
        "keys": keys_in_bucket,
        "pieces": [[int(p), int(c)] for p, c in zip(pieces, counts, strict=True)],
    }
    record_result(out, result)
    return result


def match_old_keys(
    group: int, old: tuple[tuple[int, str], ...], new: tuple[str, ...], work: str
) -> Result:
    """Matches task (an incremental run), a group of an earlier version's pieces: ``old`` are
    (piece, keys file) of each, ``new`` the keys files of the pieces this version adds. Writes
    the old keys whose key hash is also a new key's to :func:`matches_path` (sorted by key
    hash: the duplicates tasks slice it by bucket, as a piece's keys file), so that those
    tasks compare the new keys with the old ones they may repeat and never read the rest.

    Each old key hash is read once and looked up in two tables of the new hashes, of their high
    bits and of their low bits (about 32 slots per new key each: one old key in a thousand
    passes both), then searched exactly; only a file with a match is read further."""
    out = matches_path(work, group)
    recorded = recorded_result(out)
    if recorded is not None:
        return {**recorded, "reused": True}
    wanted = np.unique(
        np.concatenate(
            [_mapped_keys(local_copy(path, work), ("hash",))["hash"] for path in new]
            or [np.zeros(0, dtype=np.uint64)]
        )
    )
    bits = int(min(26, max(16, (len(wanted) * 32).bit_length())))
    shift, mask = np.uint64(64 - bits), np.uint64((1 << bits) - 1)
    high, low = np.zeros(1 << bits, dtype=bool), np.zeros(1 << bits, dtype=bool)
    # The shifted and masked hashes are below 2**26: viewed as intp, they index as they are (a
    # uint64 index costs numpy a conversion of every element; 0.27 s of 0.6 at 20 GB).
    high[(wanted >> shift).view(np.intp)] = True
    low[(wanted & mask).view(np.intp)] = True
    found: list[dict[str, npt.NDArray[Any]]] = []
    keys = 0
    for number, path in old:
        hashes = _mapped_keys(local_copy(path, work), ("hash",))["hash"]
        keys += len(hashes)
        maybe = np.flatnonzero(high[(hashes >> shift).view(np.intp)])
        maybe = maybe[low[(hashes[maybe] & mask).view(np.intp)]]
        if not len(maybe):  # always so when there are no new keys
            continue
        at = np.minimum(np.searchsorted(wanted, hashes[maybe]), len(wanted) - 1)
        maybe = maybe[wanted[at] == hashes[maybe]]
        if not len(maybe):
            continue
        columns = _mapped_keys(local_copy(path, work))
        found.append(
            {"piece": np.full(len(maybe), number, dtype=np.int64)}
            | {name: columns[name][maybe] for name in KEY_COLUMNS}
        )
    matched = dict(zip(KEY_KINDS, _concatenated(found, KEY_KINDS), strict=True))
    order = np.argsort(matched["hash"], kind="stable")
    _write_ipc(pa.table({name: column[order] for name, column in matched.items()}), out)
    result: Result = {"group": group, "keys": keys, "matches": len(order)}
    record_result(out, result)
    return result


def duplicates_digest(rows: npt.NDArray[np.int64]) -> str:
    """Names a piece's set of rows that repeat a lower piece's key (what its outputs depend on
    besides the piece itself)."""
    return hashlib.sha256(np.sort(rows).astype("<i8").tobytes()).hexdigest()


NO_DUPLICATES = duplicates_digest(np.zeros(0, dtype=np.int64))


def _duplicate_rows(work: str, piece: int, buckets: Sequence[int]) -> npt.NDArray[np.int64]:
    """The rows of ``piece`` that the duplicates tasks of ``buckets`` marked, in order."""
    found = []
    for bucket in buckets:
        source = pa.ipc.open_file(pa.memory_map(str(duplicates_path(work, bucket))))
        table = source.read_all()
        pieces = table.column("piece").to_numpy()
        start, stop = np.searchsorted(pieces, [piece, piece + 1], side="left")
        found.append(table.column("row").to_numpy()[start:stop])
    if not found:
        return np.zeros(0, dtype=np.int64)
    rows: npt.NDArray[np.int64] = np.sort(np.concatenate(found)).astype(np.int64)
    return rows


def rescan_piece(
    piece: Piece,
    fractions: dict[str, float],
    work: str,
    buckets: tuple[int, ...],
    stored: tuple[str, ...] = schemas.SDSS_FEATURES,
) -> Result:
    """Rescan task, a piece holding duplicates of lower pieces' rows: the scan again into
    the work subfolder :data:`RESCAN_FOLDER`, those rows quarantined as duplicates too."""
    folder = str(Path(work) / RESCAN_FOLDER)
    done = segment_path(folder, piece.number, splits.SPLITS[0])
    recorded = recorded_result(done)
    if recorded is not None:
        return {**recorded, "reused": True}
    table, read = read_piece(piece)
    scan = scanned(table)
    rows = _duplicate_rows(work, piece.number, buckets)
    # Only good rows' keys went into the buckets.
    assert not scan.codes[rows].any(), f"piece {piece.number}: a quarantined row marked again"
    scan.codes[rows] = _REASON_CODE[DUPLICATE]
    result = _write_scan(piece.number, table, scan, fractions, folder, stored)
    result["folder"] = RESCAN_FOLDER
    result["input"] = {"bytes": read}
    record_result(done, result)
    return result


def _write_scan(
    number: int,
    table: pa.Table,
    scan: Scanned,
    fractions: dict[str, float],
    work: str,
    stored: tuple[str, ...],
) -> Result:
    """A piece's quarantined rows (``scan.codes`` not 0) and its good rows' segments into
    ``work``; the counts (the caller records them beside the first split's segment)."""
    codes = scan.codes
    bad = codes != 0
    result: Result = {"piece": number, "rows_in": table.num_rows}
    result["quarantined"] = int(np.count_nonzero(bad))
    kinds, counts = np.unique(codes[bad], return_counts=True)
    result["reasons"] = {REASONS[k]: int(c) for k, c in zip(kinds, counts, strict=True)}
    if bad.any():
        relpath = output_path(QUARANTINE, number)
        reasons = pa.array(np.asarray(REASONS, dtype=object)[codes[bad]], type=pa.string())
        quarantined = table.filter(pa.array(bad)).append_column("reason", reasons)
        written = write_parquet(
            quarantined, Path(work) / relpath, row_group_size=max(1, quarantined.num_rows)
        )
        result["quarantine"] = {"path": relpath, **written}
    split_of = splits.assign(scan.sample, fractions)
    result["split_rows"] = {}
    # The first split's segment last: its result beside it says the piece is done.
    for code, split in reversed(list(enumerate(splits.SPLITS))):
        chosen = features(table, scan, np.flatnonzero(~bad & (split_of == code)), stored)
        result["split_rows"][split] = chosen.num_rows
        _write_ipc(chosen, segment_path(work, number, split))
    return result


def feature_sums(table: pa.Table, columns: tuple[str, ...] = schemas.SDSS_FEATURES) -> Result:
    """The training rows' count, and each of ``columns``' (the features trained on) sum and
    sum of squares in float64, column by column (numpy's pairwise sums: no copy of the rows
    into one matrix), for the normalisation."""
    sums, squares = [], []
    for name in columns:
        values = table.column(name).to_numpy().astype(np.float64)
        sums.append(float(values.sum()))
        squares.append(float(np.square(values).sum()))
    return {"count": table.num_rows, "sum": sums, "sumsq": squares}


def write_piece(
    number: int,
    folder: str,
    rows_per_group: int,
    work: str,
    feature_columns: tuple[str, ...] = schemas.SDSS_FEATURES,
) -> Result:
    """Write task, one piece: its rows of each split, from its segments in ``folder`` (the
    scan's or the rescan's), into ``<split>/part-NNNNN.parquet`` in the job's ``out/`` folder,
    in row groups of ``rows_per_group`` rows (the last shorter); the training rows' feature sums.
    Files of a run of the same job already written whole are kept."""
    out = Path(work) / "out"
    # Beside the piece's files, once they are all whole: its result.
    marker = out / f".piece-{number:05d}"
    recorded = recorded_result(marker)
    if recorded is not None:
        return {**recorded, "reused": True}
    result: Result = {"piece": number, "files": {}}
    read = 0
    for split in splits.SPLITS:
        mapped = pa.memory_map(str(segment_path(folder, number, split)))
        read += mapped.size()
        rows = pa.ipc.open_file(mapped).read_all().combine_chunks()
        if split == "train":
            result["sums"] = feature_sums(rows, feature_columns)
        if rows.num_rows == 0:
            continue
        relpath = output_path(split, number)
        result["files"][split] = {
            "path": relpath,
            **write_parquet(rows, out / relpath, row_group_size=rows_per_group),
        }
    # What it read, for the pass's table (its planned bytes are not known before the scan).
    result["input"] = {"bytes": read}
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("")
    record_result(marker, result)
    return result


# ---------------------------------------------------------------------------------------------
# The job


@dataclass(frozen=True, kw_only=True)
class Earlier:
    """An earlier processed version made by this code with these parameters, and what it
    records of its pieces (``_state/pieces.json``), by piece key."""

    manifest: Manifest
    pieces: dict[str, dict[str, Any]]
    files: dict[str, FileEntry]
    """Its files, by path."""
    keys: dict[str, str]
    """Each piece's keys file where a task can open it, by piece key."""
    duplicates: str | None = None
    """Its :data:`DUPLICATES_FILE` where a task can open it (None if it has none)."""


@dataclass(frozen=True, kw_only=True)
class SdssJob:
    """A planned preprocessing run of a raw "sdss" version (a :class:`driver.Job`), reusing
    the pieces an earlier version holds (``earlier``)."""

    raw: Manifest
    name: str
    version: str
    parents: tuple[ParentRef, ...]
    parameters: dict[str, Any]
    pieces: tuple[Piece, ...]
    fractions: dict[str, float]
    rank_multiple: int
    target_rows_per_group: int
    earlier: Earlier | None = None
    stored: tuple[str, ...] = schemas.SDSS_FEATURES
    """The features written: Petrosian ones only when every raw file has their columns."""
    feature_columns: tuple[str, ...] = schemas.SDSS_FEATURES
    """What training takes: ``stored``, and redshift when asked for."""
    kind: str = "processed"
    passes: tuple[str, ...] = ("scan", "matches", "duplicates", "rescan", "write")

    @property
    def work_key(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def num_key_buckets(self) -> int:
        return num_key_buckets(sum(p.rows for p in self.pieces), len(self.pieces))

    def _kept_record(self, piece: Piece) -> dict[str, Any] | None:
        if self.earlier is None:
            return None
        return self.earlier.pieces.get(piece.key)

    def kept(self, pass_name: str, done: Results) -> list[Result]:
        """Scan: each piece an earlier version holds. Write: those whose duplicates did not
        change (the rescan pass has none of them)."""
        if pass_name == "scan":
            return [
                {**record["scan"], "piece": p.number, "key": p.key, "earlier": True}
                for p in self.pieces
                if (record := self._kept_record(p)) is not None
            ]
        if pass_name == "write":
            rescanned = {int(r["piece"]) for r in done.get("rescan", ())}
            rows_per_group = self.rows_per_group(done)
            return [
                {**record["write"], "piece": p.number, "earlier": True}
                for p in self.pieces
                if (record := self._kept_record(p)) is not None
                and p.number not in rescanned
                and int(record["rows_per_group"]) == rows_per_group
            ]
        return []

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        if pass_name == "scan":
            return [
                TaskSpec(
                    key=f"scan-{p.number:05d}",
                    fn=scan_piece,
                    args=(p, self.fractions, str(work), self.stored),
                    rows=p.rows,
                    threads=True,
                )
                for p in self.pieces
                if self._kept_record(p) is None
            ]
        if pass_name == "matches":
            self._refuse_no_training_rows(done["scan"])
            return self._match_tasks(done["scan"], work)
        if pass_name == "duplicates":
            return self._duplicate_tasks(done, work)
        if pass_name == "rescan":
            return self._rescan_tasks(done, work)
        return self._write_tasks(done, work)

    def _refuse_no_training_rows(self, scans: Sequence[Result]) -> None:
        """A raw version none of whose rows can train (all quarantined, say for class values
        of another spelling) is refused here, saying so with the counts and the reasons."""
        if sum(int(r["split_rows"]["train"]) for r in scans) > 0:
            return
        rows = sum(int(r["rows_in"]) for r in scans)
        quarantined = sum(int(r["quarantined"]) for r in scans)
        reasons: dict[str, int] = {}
        for scan in scans:
            for reason, count in scan["reasons"].items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
        known = f" (expected {' / '.join(schemas.SDSS_CLASSES)})"
        why = ", ".join(
            f"{count:,} {reason}" + (known if "class" in reason else "")
            for reason, count in sorted(reasons.items(), key=lambda item: -item[1])[:3]
        )
        raise ShardflowError(
            f"{self.raw.name}@{self.raw.version}: {quarantined:,} of {rows:,} rows were "
            f"quarantined ({why}), which leaves no training rows; fix the source and ingest "
            "again (docs/preprocessing.md, 'SDSS rows that cannot be used')"
        )

    def _keys_file(self, scan: Result) -> str:
        if scan.get("earlier"):
            assert self.earlier is not None
            return self.earlier.keys[str(scan["key"])]
        return str(scan["keys"])

    def _old_pieces(self) -> list[Piece] | None:
        """The pieces the earlier version holds, when the duplicates pass need compare only
        the new pieces' keys with theirs: it records its duplicates, this version holds each
        of its pieces once (none is gone) and in the same order, so that among them the same
        row of a key is first. None when the pass must compare every key."""
        earlier = self.earlier
        if earlier is None or earlier.duplicates is None:
            return None
        old = [p for p in self.pieces if p.key in earlier.pieces]
        before = [int(earlier.pieces[p.key]["number"]) for p in old]
        if len({p.key for p in old}) != len(earlier.pieces) or len(old) != len(earlier.pieces):
            return None
        return old if before == sorted(before) else None

    def _match_tasks(self, scans: Sequence[Result], work: Path) -> list[TaskSpec]:
        """An incremental run's: groups of the earlier pieces, each task finding which of
        their keys share a key hash with a new piece's (:func:`match_old_keys`)."""
        old = self._old_pieces()
        ordered = sorted(scans, key=lambda r: r["piece"])
        new = tuple(self._keys_file(r) for r in ordered if not r.get("earlier"))
        if old is None or not new:
            return []
        rows = sum(p.rows for p in old)
        tasks = min(
            MAX_DUPLICATE_TASKS, len(old), max(MIN_KEY_BUCKETS, -(-rows // MATCH_TASK_ROWS))
        )
        groups = [old[len(old) * t // tasks : len(old) * (t + 1) // tasks] for t in range(tasks)]
        assert self.earlier is not None
        return [
            TaskSpec(
                key=f"matches-{group:05d}",
                fn=match_old_keys,
                args=(
                    group,
                    tuple((p.number, self.earlier.keys[p.key]) for p in pieces),
                    new,
                    str(work),
                ),
                rows=sum(p.rows for p in pieces),
                threads=True,
            )
            for group, pieces in enumerate(groups)
        ]

    def _duplicate_tasks(self, done: Results, work: Path) -> list[TaskSpec]:
        """Tasks of ranges of key buckets over every piece's keys; in an incremental run, over
        the new pieces' keys, the earlier ones they match and the earlier version's
        duplicates."""
        scans = sorted(done["scan"], key=lambda r: r["piece"])
        matches = tuple(str(matches_path(str(work), int(r["group"]))) for r in done["matches"])
        old = self._old_pieces()
        known = None
        if old is not None:
            assert self.earlier is not None and self.earlier.duplicates is not None
            known = KnownDuplicates(self.earlier.duplicates, {p.key: p.number for p in old})
            scans = [r for r in scans if not r.get("earlier")]
        keys = tuple((int(r["piece"]), self._keys_file(r)) for r in scans)
        rows = sum(p.rows for p in self.pieces)
        num_buckets = self.num_key_buckets
        return [
            TaskSpec(
                # Named by its first bucket, as when a task had one bucket.
                key=f"duplicates-{first:05d}",
                fn=find_duplicates,
                args=((first, stop), num_buckets, keys, str(work), matches, known),
                rows=rows * (stop - first) // num_buckets,
                threads=True,
            )
            for first, stop in duplicate_task_buckets(num_buckets)
        ]

    def duplicate_rows(self, done: Results, work: Path) -> dict[int, tuple[int, ...]]:
        """The buckets holding each piece's duplicates of lower pieces' keys."""
        buckets: dict[int, list[int]] = {}
        results = [bucket for task in done["duplicates"] for bucket in task["buckets"]]
        for result in sorted(results, key=lambda r: r["bucket"]):
            for piece, _count in result["pieces"]:
                buckets.setdefault(int(piece), []).append(int(result["bucket"]))
        return {piece: tuple(found) for piece, found in buckets.items()}

    def _duplicates_digest(self, piece: int, buckets: Sequence[int], work: Path) -> str:
        if not buckets:
            return NO_DUPLICATES
        return duplicates_digest(_duplicate_rows(str(work), piece, buckets))

    def _rescan_tasks(self, done: Results, work: Path) -> list[TaskSpec]:
        """Pieces holding rows that repeat a lower piece's key, unless an earlier version
        holds the piece with exactly those rows set aside (and in row groups of the same size:
        else its rows are read again too)."""
        tasks = []
        found = self.duplicate_rows(done, work)
        rows_per_group = self.rows_per_group(done)
        for piece in self.pieces:
            buckets = found.get(piece.number, ())
            digest = self._duplicates_digest(piece.number, buckets, work)
            record = self._kept_record(piece)
            if (
                record is not None
                and record["duplicates"] == digest
                and int(record["rows_per_group"]) == rows_per_group
            ):
                continue
            if record is None and not buckets:
                continue  # a new piece without duplicates: its scan is final
            tasks.append(
                TaskSpec(
                    key=f"rescan-{piece.number:05d}",
                    fn=rescan_piece,
                    args=(piece, self.fractions, str(work), buckets, self.stored),
                    rows=piece.rows,
                    threads=True,
                )
            )
        return tasks

    def piece_results(self, done: Results) -> list[Result]:
        """Each piece's scan result, in piece order; a rescanned piece's rescan result."""
        by_piece = {int(r["piece"]): r for r in done["scan"]}
        by_piece.update({int(r["piece"]): r for r in done.get("rescan", ())})
        return [by_piece[number] for number in sorted(by_piece)]

    def rows_per_group(self, done: Results) -> int:
        """R: the target, or fewer rows when the pieces' training rows (as scanned, before
        duplicates across pieces are set aside) fill fewer than ``rank_multiple`` groups of the
        target, so that that many ranks each get one. A function of the pieces alone."""
        train = sum(int(r["split_rows"]["train"]) for r in done["scan"])
        return max(1, min(self.target_rows_per_group, train // self.rank_multiple))

    def _write_tasks(self, done: Results, work: Path) -> list[TaskSpec]:
        kept = {int(r["piece"]) for r in self.kept("write", done)}
        rows_per_group = self.rows_per_group(done)
        return [
            TaskSpec(
                key=f"write-{int(r['piece']):05d}",
                fn=write_piece,
                args=(
                    int(r["piece"]),
                    str(work / str(r.get("folder", ""))) if r.get("folder") else str(work),
                    rows_per_group,
                    str(work),
                    self.feature_columns,
                ),
                rows=sum(int(n) for n in r["split_rows"].values()),
                threads=True,
            )
            for r in self.piece_results(done)
            if int(r["piece"]) not in kept
        ]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        scans = self.piece_results(done)
        written = {int(r["piece"]): r for r in done["write"]}
        if set(written) != {p.number for p in self.pieces}:
            missing = sorted({p.number for p in self.pieces} - set(written))
            raise ShardflowError(f"{len(missing)} pieces were not written, e.g. {missing[0]}")
        rows_per_group = self.rows_per_group(done)
        found = self.duplicate_rows(done, work)
        files: dict[str, FileEntry] = {}
        records = []
        for piece, scan in zip(self.pieces, scans, strict=True):
            write = written[piece.number]
            outputs = self._stage_piece(stage, piece, scan, write, work)
            files.update(outputs)
            records.append(
                {
                    "key": piece.key,
                    "number": piece.number,
                    "rows_per_group": rows_per_group,
                    "duplicates": self._duplicates_digest(
                        piece.number, found.get(piece.number, ()), work
                    ),
                    "scan": _renumbered(
                        {k: scan[k] for k in ("rows_in", "quarantined", "reasons", "split_rows")}
                        | ({"quarantine": scan["quarantine"]} if "quarantine" in scan else {}),
                        piece.number,
                    ),
                    "write": _renumbered(
                        {"sums": write["sums"], "files": write["files"]}, piece.number
                    ),
                }
            )
        state = stage.path / PIECES_FILE
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"pieces": records}, sort_keys=True) + "\n")
        self._record_duplicates(stage.path / DUPLICATES_FILE, work)
        layout = self.layout(scans, [written[p.number] for p in self.pieces], rows_per_group)
        reused = sum(bool(written[p.number].get("earlier")) for p in self.pieces)
        if self.earlier is not None:
            new = [p for p in self.pieces if not written[p.number].get("earlier")]
            stage.note_run(
                incremental={
                    "base": str(self.earlier.manifest.ref),
                    "pieces": len(self.pieces),
                    "pieces_reused": reused,
                    "pieces_new": len(new),
                },
                # What is new since the version it grew from: the pieces read and written, by
                # raw file and row group (catalog lineage shows it).
                new_since={
                    "base": str(self.earlier.manifest.ref),
                    "reused": reused,
                    "new": [f"{_raw_file(self.raw, p)}#{p.row_group}" for p in new],
                },
            )
        return commit_processed(
            stage,
            code=stage_code(__name__),
            layout=layout,
            parents=self.parents,
            parameters=self.parameters,
            described=files,
        )

    def _record_duplicates(self, path: Path, work: Path) -> None:
        """Every bucket's duplicates, by piece key and sorted by key hash, into ``path`` (the
        version's :data:`DUPLICATES_FILE`, for the next version to start from)."""
        found = [
            pa.ipc.open_file(pa.memory_map(str(duplicates_path(str(work), bucket)))).read_all()
            for bucket in range(self.num_key_buckets)
        ]
        table = pa.concat_tables(found)
        keys = np.array([p.key for p in self.pieces], dtype=object)
        order = np.argsort(table.column("hash").to_numpy(), kind="stable")
        pieces = keys[table.column("piece").to_numpy()[order]]
        _write_ipc(
            pa.table(
                {
                    "piece": pa.array(pieces, type=pa.string()).dictionary_encode(),
                    "row": table.column("row").to_numpy()[order],
                    "hash": table.column("hash").to_numpy()[order],
                }
            ),
            path,
        )

    def _stage_piece(
        self, stage: Staging, piece: Piece, scan: Result, write: Result, work: Path
    ) -> dict[str, FileEntry]:
        """Put one piece's outputs into ``stage``: an earlier version's files as they are (no
        copy), a task's from the work folder; the entries of the latter, as the tasks that
        wrote them hashed and counted them (a rescanned piece's keys file is hashed at the
        commit)."""
        earlier = self.earlier
        record = self._kept_record(piece)
        staged: dict[str, FileEntry] = {}
        if record is not None:
            assert earlier is not None
            # The keys depend on the piece alone: an earlier version's serve every version.
            old = earlier.files[keys_output_path(int(record["number"]))]
            stage.reuse(earlier.manifest, old, keys_output_path(piece.number))
        else:
            relpath = keys_output_path(piece.number)
            stage.adopt(keys_path(str(work), piece.number), relpath)
            if "keys_file" in scan:  # else hashed at the commit
                staged[relpath] = described(relpath, scan["keys_file"])
        outputs: dict[str, dict[str, Any]] = {
            split: entry for split, entry in write["files"].items()
        }
        if "quarantine" in scan:
            outputs["quarantine"] = scan["quarantine"]
        for kind, entry in sorted(outputs.items()):
            relpath = output_path(kind, piece.number)
            if write.get("earlier") and (kind != "quarantine" or scan.get("earlier")):
                assert earlier is not None and record is not None
                old = earlier.files[output_path(kind, int(record["number"]))]
                stage.reuse(earlier.manifest, old, relpath)  # described by its manifest entry
                continue
            folder = work / "out" if kind != "quarantine" else work / str(scan.get("folder", ""))
            stage.adopt(folder / str(entry["path"]), relpath)
            staged[relpath] = described(relpath, entry)
        return staged

    def layout(
        self, scans: Sequence[Result], written: Sequence[Result], rows_per_group: int
    ) -> ProcessedLayout:
        reasons: dict[str, int] = {}
        for scan in scans:
            for reason, count in scan["reasons"].items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
        split_layouts = {}
        for split in splits.SPLITS:
            entries = [w["files"][split] for w in written if split in w["files"]]
            rows = sum(int(e["rows"]) for e in entries)
            if split != "train" and rows == 0:
                continue
            split_layouts[split] = SplitLayout(
                rows=rows,
                source_rows=rows,
                rows_per_group=rows_per_group,
                num_row_groups=sum(int(e["row_groups"]) for e in entries),
                num_shards=len(entries),
                dropped_rows=0,
                padded_rows=0,
                policy="whole",
            )
        return ProcessedLayout(
            kind="tabular",
            format="parquet",
            arrow_schema=schemas.sdss_schema(self.stored).to_string(),
            columns=tuple(schemas.sdss_schema(self.stored).names),
            feature_columns=self.feature_columns,
            label_column="label",
            num_classes=len(schemas.SDSS_CLASSES),
            class_names=schemas.SDSS_CLASSES,
            split_by=SPLIT_BY,
            split_fractions=self.fractions,
            splits=split_layouts,
            normalization=normalization_of(
                [w["sums"] for w in written if w["sums"]["count"]],
                "train split, per feature in feature_columns order",
            ),
            quarantine=Quarantine(
                rows=sum(int(s["quarantined"]) for s in scans),
                reasons=dict(sorted(reasons.items())),
                files=sum("quarantine" in s for s in scans),
                contents=f"{part_folder(QUARANTINE)}/ (all raw columns + reason)",
            ),
            rows_in=sum(int(s["rows_in"]) for s in scans),
        )


def _raw_file(raw: Manifest, piece: Piece) -> str:
    """The raw version's file a piece is a row group of."""
    sha = piece.key.partition("#")[0]
    return next((f.path for f in raw.files if f.sha256 == sha), sha)


def _renumbered(record: dict[str, Any], number: int) -> dict[str, Any]:
    """``record`` (a piece's scan or write result) with its files' paths those of piece
    ``number``: a record reads the same whoever wrote the files (an earlier version, under
    another number, or this run)."""
    out = dict(record)
    if "quarantine" in out:
        out["quarantine"] = {**out["quarantine"], "path": output_path("quarantine", number)}
    if "files" in out:
        out["files"] = {
            split: {**entry, "path": output_path(split, number)}
            for split, entry in out["files"].items()
        }
    return out


def _earlier(catalog: Catalog, name: str, parameters: dict[str, Any]) -> Earlier | None:
    """The newest processed version of ``name`` made by this code with ``parameters`` that
    records its pieces; None if there is none."""
    code = stage_code(__name__)
    for manifest in reversed(catalog.versions(name)):
        if manifest.code_version != code or manifest.parameters != parameters:
            continue
        files = {f.path: f for f in manifest.files}
        if PIECES_FILE not in files:
            continue
        import fsspec

        with fsspec.open(catalog.file_url(manifest, files[PIECES_FILE]), "rt") as f:
            records = json.load(f)["pieces"]
        return Earlier(
            manifest=manifest,
            pieces={r["key"]: r for r in records},
            files=files,
            duplicates=(
                catalog.file_url(manifest, files[DUPLICATES_FILE])
                if DUPLICATES_FILE in files
                else None
            ),
            keys={
                r["key"]: catalog.file_url(manifest, files[keys_output_path(int(r["number"]))])
                for r in records
            },
        )
    return None


def plan_sdss_job(catalog: Catalog, raw: Manifest, options: JobOptions) -> SdssJob:
    """Plan the processing of a raw "sdss" version (reads its manifest and Parquet footers, and
    what the newest earlier processed version records of its pieces)."""
    pieces: list[Piece] = []
    columns: list[set[str]] = []
    for entry in sorted(raw.files, key=lambda e: e.path):
        if not entry.path.endswith(".parquet"):
            continue
        path = catalog.file_url(raw, entry)
        metadata = parquet_file(path).metadata
        columns.append(set(metadata.schema.to_arrow_schema().names))
        for group in range(metadata.num_row_groups):
            pieces.append(
                Piece(
                    number=len(pieces),
                    path=path,
                    row_group=group,
                    rows=metadata.row_group(group).num_rows,
                    key=f"{entry.sha256}#{group}",
                )
            )
    if not pieces:
        raise ShardflowError(f"{raw.name}@{raw.version} holds no Parquet rows")
    validation = (
        DEFAULT_VALIDATION_FRACTION
        if options.validation_fraction is None
        else options.validation_fraction
    )
    test = DEFAULT_TEST_FRACTION if options.test_fraction is None else options.test_fraction
    if validation + test >= 1:
        raise ConfigError("test_fraction", f"plus validation_fraction must be below 1, got {test}")
    fractions = {"train": 1.0 - validation - test, "validation": validation, "test": test}
    if (options.format or "parquet") != "parquet":
        raise ConfigError("format", "must be parquet for sdss (tabular features)")
    config = options.plan
    if config.remainder not in (None, "keep"):
        raise ConfigError(
            "remainder",
            f"{config.remainder!r} does not apply to sdss: it keeps every training row, its row "
            "groups cut per raw piece (each piece's last one shorter), and every rank takes "
            "the same number of steps (docs/preprocessing.md)",
        )
    stored, feature_columns = _features(columns, options.redshift_feature)
    name = processed_name(raw.name)
    parents = (raw.ref,)
    # What shapes the bytes: the row groups' target size and the least number of them, the
    # split fractions; shards are one per piece.
    parameters = {
        "rows_per_group": config.target_rows_per_group,
        "rank_multiple": config.rank_multiple,
        "format": "parquet",
        "split_fractions": fractions,
        "writer_version": WRITER_VERSION,
    }
    if feature_columns != schemas.SDSS_FEATURES:
        # Only when not the seed's set, so that versions made before the choice keep their ids.
        parameters["feature_columns"] = list(feature_columns)
    return SdssJob(
        raw=raw,
        name=name,
        version=derived_version(
            name=name,
            kind="processed",
            parents=parents,
            parameters=parameters,
            code=stage_code(__name__),
        ),
        parents=parents,
        parameters=parameters,
        pieces=tuple(pieces),
        fractions=fractions,
        rank_multiple=config.rank_multiple,
        target_rows_per_group=config.target_rows_per_group,
        earlier=_earlier(catalog, name, parameters),
        stored=stored,
        feature_columns=feature_columns,
    )


def _features(
    columns: Sequence[set[str]], redshift: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(features written, features trained on) for raw files of ``columns``: the Petrosian
    ones only when every file has them (the DR14 sample has none); redshift trained on only
    when asked for, since it nearly decides the class by itself."""
    petrosian = all(set(schemas.SDSS_PETROSIAN) <= names for names in columns)
    stored = schemas.SDSS_FEATURES if petrosian else schemas.SDSS_PHOTOMETRY
    return stored, (*stored, "redshift") if redshift else stored
