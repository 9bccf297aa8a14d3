"""Raw SDSS photometry + spectroscopic classes → features for star/galaxy/QSO training.

raw version "sdss": Parquet files (from SkyServer pages or CasJobs exports), row groups of at
most 100,000 rows
    │  scan pass, one Dask task per raw row group ("piece"): rows with a sentinel (-9999 ...),
    │  NaN or an unknown class go to quarantine/part-NNNNN.parquet with their reason; the good
    │  rows are hashed by (objid, specobjid) into train/validation/test and counted
    ▼
plan (pure, from the counts): each split's rows are the good rows of that split in piece
order; the training split is cut into equal row groups; every output shard knows the pieces
(and the offsets in them) it needs
    │  write pass, one Dask task per output shard: read its pieces, keep its rows, compute the
    │  features (magnitudes, colours u-g g-r r-i i-z, Petrosian magnitudes and radii), encode the
    │  class, keep redshift and the ids; training shards return feature sums
    ▼
processed version "sdss-processed"; rows in = rows out + rows quarantined
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest, ParentRef, Staging, derived_version
from data_catalog.errors import ShardflowError
from preprocessing import schemas, splits
from preprocessing.engine import JobOptions, Result, TaskSpec, finished_parquet, write_parquet
from preprocessing.plan import (
    PlanConfig,
    Shard,
    SplitPlan,
    plan_evaluation_split,
    plan_training_split,
)

# Bumped when the bytes this module writes change for the same input and parameters.
WRITER_VERSION = 1
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


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One raw row group: the unit the scan pass reads."""

    number: int
    path: str
    row_group: int
    rows: int


def read_piece(piece: Piece) -> pa.Table:
    table: pa.Table = pq.ParquetFile(piece.path).read_row_group(piece.row_group)
    return table


def quarantine_reasons(table: pa.Table) -> npt.NDArray[np.object_]:
    """Why each row cannot be used ("" when it can): the first failed check, in a fixed order."""
    n = table.num_rows
    reasons = np.full(n, "", dtype=object)

    def mark(bad: npt.NDArray[np.bool_], reason: str) -> None:
        reasons[bad & (reasons == "")] = reason

    for name in (*_MAGNITUDES, *_RADII):
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        low, high = _MAGNITUDE_RANGE if name in _MAGNITUDES else _RADIUS_RANGE
        mark(np.isnan(values), f"nan:{name}")
        mark(~np.isfinite(values), f"infinite:{name}")
        mark((values <= low) | (values >= high), f"sentinel:{name}")
    redshift = table.column("redshift").to_numpy(zero_copy_only=False).astype(np.float64)
    mark(~np.isfinite(redshift), "nan:redshift")
    classes = np.asarray(table.column("class").to_pylist(), dtype=object)
    known = np.isin(classes, schemas.SDSS_CLASSES)
    mark(~known, "unknown class")
    return reasons


def split_codes(table: pa.Table, fractions: dict[str, float]) -> npt.NDArray[np.int8]:
    """The split of each row (an index into :data:`splits.SPLITS`) from (objid, specobjid)."""
    objid = table.column("objid").to_numpy().astype(np.uint64)
    specobjid = table.column("specobjid").to_numpy().astype(np.uint64)
    return splits.assign(splits.sample_hash(objid, specobjid), fractions)


def scan_piece(piece: Piece, fractions: dict[str, float], work: str) -> Result:
    """Scan task: count one piece's good rows per split; write its bad rows to quarantine."""
    table = read_piece(piece)
    reasons = quarantine_reasons(table)
    bad = reasons != ""
    result: Result = {"piece": piece.number, "rows_in": table.num_rows}
    codes = split_codes(table, fractions)
    result["split_rows"] = {
        split: int(np.count_nonzero(~bad & (codes == code)))
        for code, split in enumerate(splits.SPLITS)
    }
    result["quarantined"] = int(np.count_nonzero(bad))
    kinds, counts = np.unique(reasons[bad].astype(str), return_counts=True)
    result["reasons"] = {str(k): int(c) for k, c in zip(kinds, counts, strict=True)}
    if bad.any():
        relpath = f"quarantine/part-{piece.number:05d}.parquet"
        quarantined = table.filter(pa.array(bad)).append_column(
            "reason", pa.array(reasons[bad].astype(str).tolist(), type=pa.string())
        )
        write_parquet(
            quarantined, Path(work) / relpath, row_group_size=max(1, quarantined.num_rows)
        )
        result["quarantine_file"] = relpath
    return result


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
    classes = np.asarray(table.column("class").to_pylist(), dtype=object)
    codes = {name: code for code, name in enumerate(schemas.SDSS_CLASSES)}
    values["label"] = np.fromiter((codes[c] for c in classes), dtype=np.int64, count=len(classes))
    values["redshift"] = column("redshift")
    values["objid"] = table.column("objid").to_numpy().astype(np.uint64)
    values["specobjid"] = table.column("specobjid").to_numpy().astype(np.uint64)
    return pa.Table.from_pydict(
        {name: values[name] for name in schemas.SDSS_SCHEMA.names}, schema=schemas.SDSS_SCHEMA
    )


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Rows ``start .. stop`` of one piece's good rows of a split."""

    piece: Piece
    start: int
    stop: int


def segments(
    start: int, rows: int, counts: Sequence[int], pieces: Sequence[Piece]
) -> list[Segment]:
    """The pieces (and local offsets) that hold positions ``start .. start + rows`` of a split
    whose pieces hold ``counts`` rows each; positions past the end wrap ("pad")."""
    total = sum(counts)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    out: list[Segment] = []
    position, left = start, rows
    while left > 0:
        at = position % total
        number = int(np.searchsorted(bounds, at, side="right")) - 1
        local = at - int(bounds[number])
        take = min(left, int(counts[number]) - local)
        out.append(Segment(piece=pieces[number], start=local, stop=local + take))
        position += take
        left -= take
    return out


@dataclass(frozen=True, kw_only=True)
class ShardTask:
    shard: Shard
    segments: tuple[Segment, ...]
    fractions: dict[str, float]
    out_dir: str


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
    """Write task: one output shard from the pieces it needs (memory: one piece at a time plus
    the shard), unless a run of the same job already wrote it whole."""
    shard = task.shard
    code = splits.SPLITS.index(shard.split)
    parts = []
    for segment in task.segments:
        table = read_piece(segment.piece)
        keep = (quarantine_reasons(table) == "") & (split_codes(table, task.fractions) == code)
        chosen = table.filter(pa.array(keep)).slice(segment.start, segment.stop - segment.start)
        parts.append(features(chosen))
        del table
    out = pa.concat_tables(parts).combine_chunks()
    result: Result = {"path": shard.path, "split": shard.split}
    if shard.split == "train":
        result["sums"] = feature_sums(out)
    path = Path(task.out_dir) / shard.path
    finished = finished_parquet(path, rows=shard.rows, row_groups=shard.num_row_groups)
    if finished is not None:
        return {**result, **finished}
    if out.num_rows != shard.rows:
        raise ShardflowError(f"{shard.path}: gathered {out.num_rows} rows, planned {shard.rows}")
    nbytes = write_parquet(out, path, row_group_size=shard.rows_per_group)
    return {**result, "rows": shard.rows, "bytes": nbytes}


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

    def scan_tasks(self, work: Path) -> list[TaskSpec]:
        return [
            TaskSpec(
                key=f"scan-{p.number:05d}",
                fn=scan_piece,
                args=(p, self.fractions, str(work)),
                rows=p.rows,
            )
            for p in self.pieces
        ]

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

    def write_tasks(self, scans: Sequence[Result], work: Path) -> list[TaskSpec]:
        ordered = sorted(scans, key=lambda r: r["piece"])
        tasks = []
        for plan in self.plans(scans):
            counts = [int(r["split_rows"][plan.split]) for r in ordered]
            for shard in plan.shards:
                task = ShardTask(
                    shard=shard,
                    segments=tuple(segments(shard.start, shard.rows, counts, self.pieces)),
                    fractions=self.fractions,
                    out_dir=str(work),
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

    def commit(
        self, stage: Staging, scans: Sequence[Result], written: Sequence[Result], work: Path
    ) -> Manifest:
        from preprocessing.images import combine_sums

        plans = self.plans(scans)
        expected = {shard.path for plan in plans for shard in plan.shards}
        missing = expected - {str(r["path"]) for r in written}
        if missing:
            raise ShardflowError(f"{len(missing)} shards were not written, e.g. {min(missing)}")
        quarantine = sorted(str(r["quarantine_file"]) for r in scans if "quarantine_file" in r)
        for relpath in sorted(expected) + quarantine:
            stage.adopt(work / relpath, relpath)
        in_order = sorted(written, key=lambda r: str(r["path"]))
        reasons: dict[str, int] = {}
        for scan in scans:
            for reason, count in scan["reasons"].items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
        statistics: dict[str, Any] = {p.split: p.statistics() for p in plans}
        statistics["normalization"] = {
            **combine_sums([r["sums"] for r in in_order if "sums" in r]),
            "over": "train split, per feature in feature_columns order",
        }
        statistics["quarantine"] = {
            "rows": sum(int(s["quarantined"]) for s in scans),
            "reasons": dict(sorted(reasons.items())),
            "files": len(quarantine),
        }
        statistics["rows_in"] = sum(int(s["rows_in"]) for s in scans)
        statistics["class_names"] = list(schemas.SDSS_CLASSES)
        return stage.commit(
            parents=self.parents,
            parameters=self.parameters,
            schema={
                "format": "parquet",
                "kind": "tabular",
                "arrow_schema": schemas.SDSS_SCHEMA.to_string(),
                "columns": list(schemas.SDSS_SCHEMA.names),
                "feature_columns": list(schemas.SDSS_FEATURES),
                "label_column": "label",
                "num_classes": len(schemas.SDSS_CLASSES),
                "class_names": list(schemas.SDSS_CLASSES),
                "splits": {p.split: p.split for p in plans},
                "split_by": "hash of (objid, specobjid) (preprocessing.splits.sample_hash)",
                "split_fractions": self.fractions,
                "quarantine": "quarantine/ (all raw columns + reason)",
            },
            statistics=statistics,
            rows=sum(p.rows for p in plans),
        )


def plan_sdss_job(catalog: Catalog, raw: Manifest, options: JobOptions) -> SdssJob:
    """Plan the processing of a raw "sdss" version (reads its manifest and Parquet footers)."""
    pieces: list[Piece] = []
    for entry in sorted(raw.files, key=lambda e: e.path):
        if not entry.path.endswith(".parquet"):
            continue
        path = str(catalog.file_path(raw, entry))
        metadata = pq.read_metadata(path)
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
        raise ShardflowError("--validation-fraction plus --test-fraction must be below 1")
    fractions = {"train": 1.0 - validation - test, "validation": validation, "test": test}
    if (options.format or "parquet") != "parquet":
        raise ShardflowError("sdss is written as plain Parquet (tabular features); drop --format")
    config = options.plan
    if config.target_rows_per_shard == PlanConfig().target_rows_per_shard:
        config = replace(config, target_rows_per_shard=DEFAULT_ROWS_PER_SHARD)
    name = "sdss-processed"
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
            name=name, kind="processed", parents=parents, parameters=parameters
        ),
        parents=parents,
        parameters=parameters,
        pieces=tuple(pieces),
        fractions=fractions,
        plan_config=config,
    )
