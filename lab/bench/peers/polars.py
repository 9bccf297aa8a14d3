"""The SDSS stages in Polars (lazy), as a user would write them: see :mod:`lab.bench.peers`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import polars as pl

from lab.bench.peers import spec


def _mix(z: pl.Expr) -> pl.Expr:
    # UInt64 arithmetic in Polars wraps, as SplitMix64 needs.
    z = z + spec.GOLDEN
    z = (z ^ (z // 2**30)) * spec.MIX1
    z = (z ^ (z // 2**27)) * spec.MIX2
    return z ^ (z // 2**31)


def _reason() -> pl.Expr:
    """The first failed check of a row, else null."""
    failed = []
    for name, kind, reason in spec.checks():
        column = pl.col(name)
        if kind == "nan":
            bad = column.is_nan()
        elif kind == "infinite":
            bad = ~column.is_finite()
        elif kind == "sentinel":
            low, high = spec.value_range(name)
            bad = (column <= low) | (column >= high)
        else:
            bad = ~column.is_in(spec.CLASSES)
        failed.append(pl.when(bad).then(pl.lit(reason)))
    return pl.coalesce(failed)


def _rows(files: list[str]) -> pl.LazyFrame:
    """Every raw row with its file, its row in the file, its piece (a raw row group) and the
    first check it fails (null if none)."""
    frames = [
        pl.scan_parquet(f).with_row_index("row").with_columns(file=pl.lit(n, pl.UInt32))
        for n, f in enumerate(files)
    ]
    return pl.concat(frames).with_columns(
        piece=pl.col("file") * 1_000_000 + pl.col("row") // spec.PIECE_ROWS, reason=_reason()
    )


def _duplicates(rows: pl.LazyFrame) -> pl.LazyFrame:
    """The good rows that repeat a key: one whose piece has the key in an earlier row, or
    whose key's first row in a lower piece is good."""
    key = ["objid", "specobjid"]
    first_in_piece = pl.int_range(pl.len()).over([*key, "piece"]) == 0
    rows = rows.with_columns(first_in_piece=first_in_piece)
    in_keys = (pl.col("first_in_piece") & pl.col("reason").is_null()).cast(pl.UInt32)
    before = (in_keys.cum_sum() - in_keys).over(key)
    duplicate = pl.col("reason").is_null() & (~pl.col("first_in_piece") | (before > 0))
    return rows.filter(duplicate)


def _features(good: pl.LazyFrame) -> pl.LazyFrame:
    split_hash = _mix(_mix(pl.col("objid")) ^ pl.col("specobjid"))
    split = (
        pl.when(split_hash < spec.TRAIN_BELOW)
        .then(0)
        .when(split_hash < spec.VALIDATION_BELOW)
        .then(1)
        .otherwise(2)
    )
    colours = {c: (pl.col(c[0]) - pl.col(c[2])).cast(pl.Float32) for c in spec.COLOURS}
    return good.select(
        *(colours.get(f, pl.col(f).cast(pl.Float32)).alias(f) for f in spec.FEATURES),
        # Not replace_strict(): in Polars 2.1's streaming engine its memory grew with the rows
        # read (720 MiB for 12 M rows, one column), as a cast to an Enum's codes' does not.
        label=pl.col("class").cast(pl.Enum(spec.CLASSES)).to_physical().cast(pl.Int64),
        redshift=pl.col("redshift"),
        objid=pl.col("objid"),
        specobjid=pl.col("specobjid"),
        split=split,
    )


def preprocess(out: Path, files: list[str]) -> dict[str, object]:
    """Written for data larger than memory (51 M rows in 5-9 GiB), and faster than the
    all-in-memory form at 2M rows (about half its CPU): Polars' streaming engine, the keys
    seen more than once found by a group_by, the duplicates' windows (``.over()``) over those
    keys' rows only (over every row they held 51 M rows in memory: more than 14 GiB), the
    quarantine and the three splits sunk as they are computed, in no particular order."""
    key = ["objid", "specobjid"]
    rows = _rows(files)
    repeated = rows.group_by(key).len().filter(pl.col("len") > 1).select(key)
    among = rows.select(*key, "file", "row", "piece", "reason").join(
        repeated.collect(engine="streaming").lazy(), on=key, how="semi"
    )
    # The windows need the rows in the files' order; the streaming join does not keep it.
    at = pl.col("file").cast(pl.UInt64) * 2**32 + pl.col("row")
    duplicates = _duplicates(among.sort("file", "row")).select(at=at)
    found = duplicates.collect(engine="streaming")["at"].implode()
    # By is_in() of the few duplicates, not a join: a streaming left join with them held memory
    # growing with the rows (1.5 GiB at 6.4 M rows against 0.5 without it).
    marked = rows.with_columns(
        reason=pl.when(at.is_in(found)).then(pl.lit(spec.DUPLICATE)).otherwise("reason")
    )
    raw = list(pl.read_parquet_schema(files[0]))
    quarantine = marked.filter(pl.col("reason").is_not_null()).select(*raw, "reason")
    quarantine.sink_parquet(out / "quarantine.parquet", engine="streaming")
    # One sink partitioned by split, not a sink per split: four sinks of one query (collect_all)
    # buffered the rows a slower sink had not taken yet, 14 GiB and more at 51 M rows.
    features = _features(marked.filter(pl.col("reason").is_null()))
    # approximate_bytes_per_file: by default ("auto") a split came in several files at 20 GB.
    parts = pl.PartitionBy(
        out / "parts", key="split", include_key=False, approximate_bytes_per_file=None
    )
    features.sink_parquet(parts, engine="streaming", mkdir=True)
    counts = {}
    for code, name in enumerate(spec.SPLITS):
        (part,) = (out / "parts" / f"split={code}").glob("*.parquet")
        part.rename(out / f"{name}.parquet")
        counts[name] = pl.scan_parquet(out / f"{name}.parquet").select(pl.len()).collect().item()
    shutil.rmtree(out / "parts")
    train = pl.scan_parquet(out / "train.parquet").select(pl.col(spec.FEATURES).cast(pl.Float64))
    means, deviations = pl.collect_all([train.mean(), train.std(ddof=0)], engine="streaming")
    reasons = pl.scan_parquet(out / "quarantine.parquet").group_by("reason").len()
    return {
        "splits": counts,
        "quarantine": dict(reasons.collect(engine="streaming").rows()),
        "mean": means.row(0),
        "std": deviations.row(0),
    }


def ingest(out: Path, files: list[str]) -> dict[str, object]:
    """Each CSV export into Parquet, ids exact uint64, empty float cells NaN, row groups of
    100,000 rows."""
    rows = []
    for path in files:
        header = pl.read_csv(path, n_rows=0).columns
        types = {
            name: pl.UInt64
            if name in ("objid", "specobjid")
            else pl.String
            if name in ("class", "provenance")
            else pl.Float64
            for name in header
        }
        frame = pl.read_csv(path, schema_overrides=types, null_values=[""])
        frame = frame.with_columns(pl.col(pl.Float64).fill_null(float("nan")))
        frame.write_parquet(out / f"{Path(path).stem}.parquet", row_group_size=spec.ROW_GROUP_ROWS)
        rows.append(frame.height)
    return {"rows": rows}


if __name__ == "__main__":
    stage, target, inputs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    target.mkdir(parents=True, exist_ok=True)
    spec.report((preprocess if stage == "preprocess" else ingest)(target, inputs), target)
