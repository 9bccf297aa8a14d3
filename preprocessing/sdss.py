"""Raw SDSS photometry + spectroscopic classes → features for star/galaxy/QSO training.

raw version "sdss": Parquet files (from SkyServer pages or CasJobs exports), row groups of at
most 100,000 rows
    │  scan pass, one Dask task per raw row group ("piece"): rows with a sentinel (-9999 ...),
    │  NaN, an unknown class or the (objid, specobjid) of an earlier row go to
    │  quarantine/part-NNNNN.parquet with their reason; the good rows are hashed by (objid,
    │  specobjid) into train/validation/test and counted, their keys into key buckets
    ▼
duplicates pass, one task per key bucket (about a million keys): the keys of that bucket from
every piece; a key already in a lower piece marks its row a duplicate
    │  rescan pass, one task per piece holding such rows: the scan again, those rows quarantined
    │  as "duplicate (objid, specobjid)" too (none when the pieces share no key)
    ▼
plan (pure, from the counts after both): each split's rows are the good rows of that split in
piece order; the training split is cut into equal row groups; every output shard knows the
pieces (and the offsets in them) it needs
    │  write pass, one Dask task per output shard: read its pieces, keep its rows, compute the
    │  features (magnitudes, colours u-g g-r r-i i-z, Petrosian magnitudes and radii), encode the
    │  class, keep redshift and the ids; training shards return feature sums
    ▼
processed version "sdss-processed"; rows in = rows out + rows quarantined
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from data_catalog import Catalog, Manifest, ParentRef, Staging, derived_version, processed_name
from data_catalog.errors import ConfigError, ShardflowError
from data_catalog.layout import ProcessedLayout, Quarantine
from preprocessing import schemas, splits
from preprocessing.config import JobOptions
from preprocessing.driver import Result, Results, TaskSpec
from preprocessing.fingerprint import stage_code
from preprocessing.plan import (
    PlanConfig,
    Shard,
    SplitPlan,
    plan_evaluation_split,
    plan_training_split,
)
from preprocessing.publish import commit_processed, split_layouts
from preprocessing.raw_files import parquet_file
from preprocessing.shard_files import (
    described,
    partial_path,
    record_result,
    recorded_result,
    write_parquet,
)

# Bumped when the bytes this module writes change for the same input and parameters.
WRITER_VERSION = 2
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1
# Rows are small: by default shards of about a raw row group, so that each piece is read about
# once by the write pass.
DEFAULT_ROWS_PER_SHARD = 100_000

_BANDS = ("u", "g", "r", "i", "z")
_MAGNITUDES = (*_BANDS, *(f"petroMag_{b}" for b in _BANDS))
_RADII = tuple(f"petroRad_{b}" for b in _BANDS)
# SDSS marks missing photometry with -9999 (and -1000 and the like); real magnitudes are
# between about 5 and 35, Petrosian radii positive.
_MAGNITUDE_RANGE = (0.0, 40.0)
_RADIUS_RANGE = (0.0, 1_000.0)
_CLASSES = pa.array(schemas.SDSS_CLASSES, type=pa.string())
# Keys are compared across pieces in buckets (by hash) of about this many, one task each: a
# task's memory stays flat however many rows the input has.
KEY_BUCKET_ROWS = 1_000_000
# ... and at least this many (no more than there are pieces), so that one bucket task does not
# keep one worker busy while the others wait.
MIN_KEY_BUCKETS = 2
# The work subfolder of a piece scanned again to drop its duplicates of other pieces' rows.
RESCAN_FOLDER = "rescan"


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One raw row group: the unit the scan pass reads."""

    number: int
    path: str
    """A local path or an object-store URL."""
    row_group: int
    rows: int


def read_piece(piece: Piece) -> pa.Table:
    table: pa.Table = parquet_file(piece.path).read_row_group(piece.row_group)
    return table


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


def quarantine_codes(table: pa.Table) -> npt.NDArray[np.int16]:
    """Why each row cannot be used, as an index into :data:`REASONS` (0 when it can): the
    first failed check, in a fixed order; then a repeat of an earlier row's (objid,
    specobjid) in the same piece (repeats across pieces: :func:`find_duplicates`)."""
    codes = np.zeros(table.num_rows, dtype=np.int16)

    def mark(bad: npt.NDArray[np.bool_], reason: str) -> None:
        codes[bad & (codes == 0)] = _REASON_CODE[reason]

    for name in (*_MAGNITUDES, *_RADII):
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        low, high = _MAGNITUDE_RANGE if name in _MAGNITUDES else _RADIUS_RANGE
        mark(np.isnan(values), f"nan:{name}")
        mark(~np.isfinite(values), f"infinite:{name}")
        mark((values <= low) | (values >= high), f"sentinel:{name}")
    redshift = table.column("redshift").to_numpy(zero_copy_only=False).astype(np.float64)
    mark(~np.isfinite(redshift), "nan:redshift")
    known = pc.is_in(table.column("class"), value_set=_CLASSES).to_numpy(zero_copy_only=False)
    mark(~known, "unknown class")
    keys = np.stack(
        [table.column(n).to_numpy().astype(np.uint64) for n in ("objid", "specobjid")], axis=1
    )
    _unique, first = np.unique(keys, axis=0, return_index=True)
    repeated = np.ones(table.num_rows, dtype=bool)
    repeated[first] = False
    mark(repeated, DUPLICATE)
    return codes


def quarantine_reasons(table: pa.Table) -> npt.NDArray[np.object_]:
    """:func:`quarantine_codes` as their reasons ("" when the row can be used)."""
    reasons: npt.NDArray[np.object_] = np.asarray(REASONS, dtype=object)[quarantine_codes(table)]
    return reasons


def split_codes(table: pa.Table, fractions: dict[str, float]) -> npt.NDArray[np.int8]:
    """The split of each row (an index into :data:`splits.SPLITS`) from (objid, specobjid)."""
    objid = table.column("objid").to_numpy().astype(np.uint64)
    specobjid = table.column("specobjid").to_numpy().astype(np.uint64)
    return splits.assign(splits.sample_hash(objid, specobjid), fractions)


def features(table: pa.Table) -> pa.Table:
    """The output rows of good input rows, in :data:`schemas.SDSS_SCHEMA`."""

    def column(name: str) -> npt.NDArray[np.float64]:
        values: npt.NDArray[np.float64] = (
            table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        )
        return values

    values: dict[str, Any] = {}
    for name in schemas.SDSS_FEATURES:
        if "_" in name and name.split("_")[0] in _BANDS and name.split("_")[1] in _BANDS:
            first, second = name.split("_")
            values[name] = (column(first) - column(second)).astype(np.float32)
        else:
            values[name] = column(name).astype(np.float32)
    labels = pc.index_in(table.column("class"), value_set=_CLASSES)
    values["label"] = labels.to_numpy(zero_copy_only=False).astype(np.int64)
    values["redshift"] = column("redshift")
    values["objid"] = table.column("objid").to_numpy().astype(np.uint64)
    values["specobjid"] = table.column("specobjid").to_numpy().astype(np.uint64)
    return pa.Table.from_pydict(
        {name: values[name] for name in schemas.SDSS_SCHEMA.names}, schema=schemas.SDSS_SCHEMA
    )


def segment_path(work: str, piece: int, split: str) -> Path:
    """The good rows of ``split`` in piece ``piece``, as features, in an Arrow IPC file."""
    return Path(work) / "segments" / f"{piece:05d}-{split}.arrow"


def keys_path(work: str, piece: int) -> Path:
    """The (objid, specobjid) of piece ``piece``'s good rows and their row numbers in the
    piece, by key bucket, in an Arrow IPC file."""
    return Path(work) / "keys" / f"{piece:05d}.arrow"


def duplicates_path(work: str, bucket: int) -> Path:
    """The (piece, row) of the rows of key bucket ``bucket`` that repeat a lower piece's key."""
    return Path(work) / "duplicates" / f"{bucket:05d}.arrow"


def num_key_buckets(rows: int, pieces: int = 1) -> int:
    """Key buckets for ``rows`` raw rows in ``pieces`` pieces (at least one). The count
    changes how the work is split, never what is written."""
    return max(1, -(-rows // KEY_BUCKET_ROWS), min(pieces, MIN_KEY_BUCKETS))


def key_buckets(
    objid: npt.NDArray[np.uint64], specobjid: npt.NDArray[np.uint64], num_buckets: int
) -> npt.NDArray[np.int64]:
    """The key bucket of each (objid, specobjid): its low hash bits (the split takes the high
    ones, so every bucket holds every split)."""
    hashes = splits.sample_hash(objid, specobjid)
    buckets: npt.NDArray[np.int64] = (hashes % np.uint64(num_buckets)).astype(np.int64)
    return buckets


def _write_ipc(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _write_keys(
    table: pa.Table, codes: npt.NDArray[np.int16], num_buckets: int, path: Path
) -> list[int]:
    """The good rows' keys and row numbers into ``path``, ordered by key bucket; where each
    bucket starts in it (and where the last ends)."""
    rows = np.flatnonzero(codes == 0)
    objid = table.column("objid").to_numpy().astype(np.uint64)[rows]
    specobjid = table.column("specobjid").to_numpy().astype(np.uint64)[rows]
    buckets = key_buckets(objid, specobjid, num_buckets)
    order = np.argsort(buckets, kind="stable")
    keys = pa.table(
        {
            "objid": objid[order],
            "specobjid": specobjid[order],
            "row": rows[order].astype(np.int64),
        }
    )
    _write_ipc(keys, path)
    starts = np.searchsorted(buckets[order], np.arange(num_buckets + 1), side="left")
    return [int(s) for s in starts]


def scan_piece(piece: Piece, fractions: dict[str, float], work: str, num_buckets: int) -> Result:
    """Scan task, the one read of a raw piece (unless it holds duplicates of other pieces'
    rows): its bad rows go to quarantine with their reason; its good rows, as features, into
    one Arrow IPC segment per split (which the write tasks slice, memory-mapped, instead of
    reading the piece again), their keys into ``num_buckets`` key buckets; counts per split."""
    done = segment_path(work, piece.number, splits.SPLITS[0])
    recorded = recorded_result(done)
    # A run before key buckets (or with another number of them) left no usable keys.
    if recorded is not None and len(recorded.get("key_buckets", ())) == num_buckets + 1:
        return {**recorded, "reused": True}
    table = read_piece(piece)
    codes = quarantine_codes(table)
    starts = _write_keys(table, codes, num_buckets, keys_path(work, piece.number))
    result = _write_scan(piece.number, table, codes, fractions, work)
    result["key_buckets"] = starts
    record_result(done, result)
    return result


def find_duplicates(bucket: int, parts: tuple[tuple[int, int, int], ...], work: str) -> Result:
    """Duplicates task, one key bucket: ``parts`` are (piece, start, stop) of the bucket's
    keys in each piece's keys file. Of the rows sharing a key, the one in the lowest piece is
    kept; the others are written to :func:`duplicates_path`, by (piece, row). A piece holds a
    key once (the scan quarantined its repeats), so which row is first never depends on the
    order of the tasks."""
    out = duplicates_path(work, bucket)
    recorded = recorded_result(out)
    if recorded is not None:
        return {**recorded, "reused": True}
    columns: dict[str, list[npt.NDArray[Any]]] = {"objid": [], "specobjid": [], "row": []}
    numbers = []
    for number, start, stop in parts:
        source = pa.ipc.open_file(pa.memory_map(str(keys_path(work, number))))
        keys = source.read_all().slice(start, stop - start)
        for name, arrays in columns.items():
            arrays.append(keys.column(name).to_numpy())
        numbers.append(np.full(stop - start, number, dtype=np.int64))
    empty = {"objid": np.uint64, "specobjid": np.uint64, "row": np.int64}
    objid, specobjid, row = (
        np.concatenate(arrays) if arrays else np.zeros(0, dtype=empty[name])
        for name, arrays in columns.items()
    )
    piece = np.concatenate(numbers) if numbers else np.zeros(0, dtype=np.int64)
    keys_in_bucket = len(objid)
    # Only rows whose objid occurs more than once can repeat a key: one sort of one column
    # finds them (a four-column lexsort of every key cost 10 % of the whole preprocess).
    by_objid = np.argsort(objid, kind="stable")
    same = objid[by_objid][1:] == objid[by_objid][:-1]
    shared = np.zeros(keys_in_bucket, dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    candidates = by_objid[shared]
    objid, specobjid, row, piece = (a[candidates] for a in (objid, specobjid, row, piece))
    order = np.lexsort((row, piece, specobjid, objid))
    objid, specobjid = objid[order], specobjid[order]
    repeat = np.zeros(len(order), dtype=bool)
    repeat[1:] = (objid[1:] == objid[:-1]) & (specobjid[1:] == specobjid[:-1])
    dropped_piece, dropped_row = piece[order][repeat], row[order][repeat]
    by = np.lexsort((dropped_row, dropped_piece))
    _write_ipc(pa.table({"piece": dropped_piece[by], "row": dropped_row[by]}), out)
    pieces, counts = np.unique(dropped_piece, return_counts=True)
    result: Result = {
        "bucket": bucket,
        "keys": keys_in_bucket,
        "pieces": [[int(p), int(c)] for p, c in zip(pieces, counts, strict=True)],
    }
    record_result(out, result)
    return result


def _duplicate_rows(work: str, piece: int, buckets: Sequence[int]) -> npt.NDArray[np.int64]:
    """The rows of ``piece`` that the duplicates tasks of ``buckets`` marked, in order."""
    found = []
    for bucket in buckets:
        source = pa.ipc.open_file(pa.memory_map(str(duplicates_path(work, bucket))))
        table = source.read_all()
        pieces = table.column("piece").to_numpy()
        start, stop = np.searchsorted(pieces, [piece, piece + 1], side="left")
        found.append(table.column("row").to_numpy()[start:stop])
    rows: npt.NDArray[np.int64] = np.sort(np.concatenate(found)).astype(np.int64)
    return rows


def rescan_piece(
    piece: Piece, fractions: dict[str, float], work: str, buckets: tuple[int, ...]
) -> Result:
    """Rescan task, a piece holding duplicates of lower pieces' rows: the scan again into
    the work subfolder :data:`RESCAN_FOLDER`, those rows quarantined as duplicates too."""
    folder = str(Path(work) / RESCAN_FOLDER)
    done = segment_path(folder, piece.number, splits.SPLITS[0])
    recorded = recorded_result(done)
    if recorded is not None:
        return {**recorded, "reused": True}
    table = read_piece(piece)
    codes = quarantine_codes(table)
    rows = _duplicate_rows(work, piece.number, buckets)
    # Only good rows' keys went into the buckets.
    assert not codes[rows].any(), f"piece {piece.number}: a quarantined row marked again"
    codes[rows] = _REASON_CODE[DUPLICATE]
    result = _write_scan(piece.number, table, codes, fractions, folder)
    result["folder"] = RESCAN_FOLDER
    record_result(done, result)
    return result


def _write_scan(
    number: int,
    table: pa.Table,
    codes: npt.NDArray[np.int16],
    fractions: dict[str, float],
    work: str,
) -> Result:
    """A piece's quarantined rows (``codes`` not 0) and its good rows' segments into ``work``;
    the counts (the caller records them beside the first split's segment)."""
    bad = codes != 0
    result: Result = {"piece": number, "rows_in": table.num_rows}
    result["quarantined"] = int(np.count_nonzero(bad))
    kinds, counts = np.unique(codes[bad], return_counts=True)
    result["reasons"] = {REASONS[k]: int(c) for k, c in zip(kinds, counts, strict=True)}
    if bad.any():
        relpath = f"quarantine/part-{number:05d}.parquet"
        reasons = pa.array(np.asarray(REASONS, dtype=object)[codes[bad]], type=pa.string())
        quarantined = table.filter(pa.array(bad)).append_column("reason", reasons)
        written = write_parquet(
            quarantined, Path(work) / relpath, row_group_size=max(1, quarantined.num_rows)
        )
        result["quarantine"] = {"path": relpath, **written}
    good = table.filter(pa.array(~bad))
    split_of = split_codes(good, fractions)
    rows = features(good)
    result["split_rows"] = {}
    # The first split's segment last: its result beside it says the piece is done.
    for code, split in reversed(list(enumerate(splits.SPLITS))):
        chosen = rows.filter(pa.array(split_of == code))
        result["split_rows"][split] = chosen.num_rows
        _write_ipc(chosen, segment_path(work, number, split))
    return result


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Rows ``start .. stop`` of one piece's good rows of a split."""

    piece: int
    start: int
    stop: int
    folder: str = ""
    """The work subfolder of the piece's segments: "" as scanned, :data:`RESCAN_FOLDER` when
    it was scanned again without its duplicates."""


def segments(start: int, rows: int, bounds: npt.NDArray[np.int64]) -> list[Segment]:
    """The pieces (and local offsets) that hold positions ``start .. start + rows`` of a split
    whose pieces' rows end at ``bounds`` (cumulative, from 0); positions past the end wrap
    ("pad"). O(log pieces) per segment."""
    total = int(bounds[-1])
    out: list[Segment] = []
    position, left = start, rows
    while left > 0:
        at = position % total
        number = int(np.searchsorted(bounds, at, side="right")) - 1
        local = at - int(bounds[number])
        take = min(left, int(bounds[number + 1]) - at)
        out.append(Segment(piece=number, start=local, stop=local + take))
        position += take
        left -= take
    return out


@dataclass(frozen=True, kw_only=True)
class ShardTask:
    shard: Shard
    segments: tuple[Segment, ...]
    work: str


def feature_sums(table: pa.Table) -> Result:
    matrix = np.stack(
        [table.column(n).to_numpy().astype(np.float64) for n in schemas.SDSS_FEATURES], axis=1
    )
    return {
        "count": int(matrix.shape[0]),
        "sum": matrix.sum(axis=0).tolist(),
        "sumsq": np.square(matrix).sum(axis=0).tolist(),
    }


def write_shard(task: ShardTask) -> Result:
    """Write task: one output shard, sliced from its split's segments (memory-mapped: only its
    own rows are read), unless a run of the same job already wrote it whole."""
    shard = task.shard
    path = Path(task.work) / shard.path
    recorded = recorded_result(path)
    if recorded is not None:
        return {**recorded, "reused": True}
    parts = []
    for segment in task.segments:
        folder = str(Path(task.work) / segment.folder)
        source = pa.ipc.open_file(
            pa.memory_map(str(segment_path(folder, segment.piece, shard.split)))
        )
        parts.append(source.read_all().slice(segment.start, segment.stop - segment.start))
    out = pa.concat_tables(parts).combine_chunks()
    if out.num_rows != shard.rows:
        raise ShardflowError(f"{shard.path}: gathered {out.num_rows} rows, planned {shard.rows}")
    result: Result = {"path": shard.path, "split": shard.split}
    if shard.split == "train":
        result["sums"] = feature_sums(out)
    result.update(write_parquet(out, path, row_group_size=shard.rows_per_group))
    record_result(path, result)
    return result


@dataclass(frozen=True, kw_only=True)
class SdssJob:
    """A planned preprocessing run of a raw "sdss" version (an :class:`engine.Job`)."""

    raw: Manifest
    name: str
    version: str
    parents: tuple[ParentRef, ...]
    parameters: dict[str, Any]
    pieces: tuple[Piece, ...]
    fractions: dict[str, float]
    plan_config: PlanConfig
    kind: str = "processed"
    passes: tuple[str, ...] = ("scan", "duplicates", "rescan", "write")

    @property
    def work_key(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def num_key_buckets(self) -> int:
        return num_key_buckets(sum(p.rows for p in self.pieces), len(self.pieces))

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        if pass_name == "scan":
            return self._scan_tasks(work)
        if pass_name == "duplicates":
            return self._duplicate_tasks(done["scan"], work)
        if pass_name == "rescan":
            return self._rescan_tasks(done["duplicates"], work)
        return self._write_tasks(self.piece_results(done), work)

    def _scan_tasks(self, work: Path) -> list[TaskSpec]:
        return [
            TaskSpec(
                key=f"scan-{p.number:05d}",
                fn=scan_piece,
                args=(p, self.fractions, str(work), self.num_key_buckets),
                rows=p.rows,
            )
            for p in self.pieces
        ]

    def _duplicate_tasks(self, scans: Sequence[Result], work: Path) -> list[TaskSpec]:
        ordered = sorted(scans, key=lambda r: r["piece"])
        tasks = []
        for bucket in range(self.num_key_buckets):
            parts = tuple(
                (int(r["piece"]), int(r["key_buckets"][bucket]), int(r["key_buckets"][bucket + 1]))
                for r in ordered
                if r["key_buckets"][bucket + 1] > r["key_buckets"][bucket]
            )
            tasks.append(
                TaskSpec(
                    key=f"duplicates-{bucket:05d}",
                    fn=find_duplicates,
                    args=(bucket, parts, str(work)),
                    rows=sum(stop - start for _piece, start, stop in parts),
                )
            )
        return tasks

    def _rescan_tasks(self, found: Sequence[Result], work: Path) -> list[TaskSpec]:
        buckets: dict[int, list[int]] = {}
        for result in sorted(found, key=lambda r: r["bucket"]):
            for piece, _count in result["pieces"]:
                buckets.setdefault(int(piece), []).append(int(result["bucket"]))
        return [
            TaskSpec(
                key=f"rescan-{number:05d}",
                fn=rescan_piece,
                args=(self.pieces[number], self.fractions, str(work), tuple(buckets[number])),
                rows=self.pieces[number].rows,
            )
            for number in sorted(buckets)
        ]

    def piece_results(self, done: Results) -> list[Result]:
        """Each piece's scan result, in piece order; a rescanned piece's rescan result."""
        by_piece = {int(r["piece"]): r for r in done["scan"]}
        by_piece.update({int(r["piece"]): r for r in done.get("rescan", ())})
        return [by_piece[number] for number in sorted(by_piece)]

    def plans(self, scans: Sequence[Result]) -> list[SplitPlan]:
        """The split plans from the scan counts (pure)."""
        counts = {
            split: [int(r["split_rows"][split]) for r in sorted(scans, key=lambda r: r["piece"])]
            for split in splits.SPLITS
        }
        plans = [plan_training_split("train", sum(counts["train"]), self.plan_config)]
        for split in ("validation", "test"):
            if sum(counts[split]):
                plans.append(plan_evaluation_split(split, sum(counts[split]), self.plan_config))
        return plans

    def _write_tasks(self, scans: Sequence[Result], work: Path) -> list[TaskSpec]:
        ordered = sorted(scans, key=lambda r: r["piece"])
        tasks = []
        for plan in self.plans(scans):
            # Where each piece's rows of this split end: computed once per split, so that
            # planning costs O(pieces + shards), not O(pieces x shards).
            bounds = np.concatenate(
                [[0], np.cumsum([int(r["split_rows"][plan.split]) for r in ordered])]
            ).astype(np.int64)
            for shard in plan.shards:
                task = ShardTask(
                    shard=shard,
                    segments=tuple(
                        replace(s, folder=str(ordered[s.piece].get("folder", "")))
                        for s in segments(shard.start, shard.rows, bounds)
                    ),
                    work=str(work),
                )
                tasks.append(
                    TaskSpec(
                        key=f"write-{shard.split}-{shard.index:05d}",
                        fn=write_shard,
                        args=(task,),
                        rows=shard.rows,
                    )
                )
        return tasks

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        from preprocessing.images import normalization_of

        scans, written = self.piece_results(done), done["write"]
        plans = self.plans(scans)
        expected = {shard.path for plan in plans for shard in plan.shards}
        missing = expected - {str(r["path"]) for r in written}
        if missing:
            raise ShardflowError(f"{len(missing)} shards were not written, e.g. {min(missing)}")
        files = {str(r["path"]): r for r in written}
        files.update(
            {str(r["quarantine"]["path"]): r["quarantine"] for r in scans if "quarantine" in r}
        )
        folders = {
            str(r["quarantine"]["path"]): str(r.get("folder", ""))
            for r in scans
            if "quarantine" in r
        }
        quarantine = sorted(path for path in files if path.startswith("quarantine/"))
        for relpath in sorted(files):
            stage.adopt(work / folders.get(relpath, "") / relpath, relpath)
        in_order = sorted(written, key=lambda r: str(r["path"]))
        reasons: dict[str, int] = {}
        for scan in scans:
            for reason, count in scan["reasons"].items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
        layout = ProcessedLayout(
            kind="tabular",
            format="parquet",
            arrow_schema=schemas.SDSS_SCHEMA.to_string(),
            columns=tuple(schemas.SDSS_SCHEMA.names),
            feature_columns=schemas.SDSS_FEATURES,
            label_column="label",
            num_classes=len(schemas.SDSS_CLASSES),
            class_names=schemas.SDSS_CLASSES,
            split_by="hash of (objid, specobjid) (preprocessing.splits.sample_hash)",
            split_fractions=self.fractions,
            splits=split_layouts(plans),
            normalization=normalization_of(
                [r["sums"] for r in in_order if "sums" in r],
                "train split, per feature in feature_columns order",
            ),
            quarantine=Quarantine(
                rows=sum(int(s["quarantined"]) for s in scans),
                reasons=dict(sorted(reasons.items())),
                files=len(quarantine),
                contents="quarantine/ (all raw columns + reason)",
            ),
            rows_in=sum(int(s["rows_in"]) for s in scans),
        )
        return commit_processed(
            stage,
            code=stage_code(__name__),
            layout=layout,
            parents=self.parents,
            parameters=self.parameters,
            # Hashed and counted by the tasks that wrote them: the commit reads nothing again.
            described={relpath: described(relpath, result) for relpath, result in files.items()},
        )


def plan_sdss_job(catalog: Catalog, raw: Manifest, options: JobOptions) -> SdssJob:
    """Plan the processing of a raw "sdss" version (reads its manifest and Parquet footers)."""
    pieces: list[Piece] = []
    for entry in sorted(raw.files, key=lambda e: e.path):
        if not entry.path.endswith(".parquet"):
            continue
        path = catalog.file_url(raw, entry)
        metadata = parquet_file(path).metadata
        for group in range(metadata.num_row_groups):
            pieces.append(
                Piece(
                    number=len(pieces),
                    path=path,
                    row_group=group,
                    rows=metadata.row_group(group).num_rows,
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
    if config.target_rows_per_shard == PlanConfig().target_rows_per_shard:
        config = replace(config, target_rows_per_shard=DEFAULT_ROWS_PER_SHARD)
    name = processed_name(raw.name)
    parents = (raw.ref,)
    parameters = {
        "plan": asdict(config),
        "format": "parquet",
        "split_fractions": fractions,
        "writer_version": WRITER_VERSION,
    }
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
        plan_config=config,
    )
