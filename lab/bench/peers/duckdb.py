"""The SDSS stages in DuckDB (SQL), as a user would write them: see :mod:`lab.bench.peers`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import duckdb

from lab.bench.peers import spec

_MASK = 2**64 - 1


def _sql(db: duckdb.DuckDBPyConnection, text: str) -> list[tuple[Any, ...]]:
    """Run one statement to its end (DuckDB 2 keeps a connection busy until its result is read)."""
    rows: list[tuple[Any, ...]] = db.execute(text).fetchall()
    return rows


def _mix(z: str) -> str:
    """SplitMix64 in SQL: DuckDB refuses a UBIGINT overflow, so through UHUGEINT and a mask."""

    def wrap(expr: str) -> str:
        return f"(({expr}) & {_MASK}::UHUGEINT)::UBIGINT"

    z = wrap(f"{z}::UHUGEINT + {spec.GOLDEN}")
    z = wrap(f"xor({z}, {z} >> 30)::UHUGEINT * {spec.MIX1}")
    z = wrap(f"xor({z}, {z} >> 27)::UHUGEINT * {spec.MIX2}")
    return f"xor({z}, {z} >> 31)"


def _reason() -> str:
    """The first failed check of a row, else NULL."""
    cases = []
    for name, kind, reason in spec.checks():
        column = f'"{name}"'
        if kind == "nan":
            # Not isnan(): DuckDB 2.0.1 folds it to false over a Parquet column whose min/max
            # statistics are finite (they leave NaN out): docs/STACK.md.
            bad = f"NOT (isfinite({column}) OR isinf({column}))"
        elif kind == "infinite":
            bad = f"NOT isfinite({column})"
        elif kind == "sentinel":
            low, high = spec.value_range(name)
            bad = f"({column} <= {low} OR {column} >= {high})"
        else:
            bad = f"{column} NOT IN {spec.CLASSES!r}"
        cases.append(f"WHEN {bad} THEN '{reason}'")
    return f"CASE {' '.join(cases)} END"


def _numbered(files: list[str]) -> str:
    """Every raw row with its file, its row in the file and its piece (a raw row group)."""
    return " UNION ALL ".join(
        f"SELECT *, {n} AS file, file_row_number AS row, "
        f"{n} * 1000000 + file_row_number // {spec.PIECE_ROWS} AS piece "
        f"FROM read_parquet('{f}', file_row_number=true)"
        for n, f in enumerate(files)
    )


def _features(source: str) -> str:
    """The features, label, redshift, ids and split code (0 train, 1 validation, 2 test) of the
    rows of ``source``."""
    colour = {c: f'("{c[0]}" - "{c[2]}")::FLOAT AS {c}' for c in spec.COLOURS}
    classes = ", ".join(f"'{c}'" for c in spec.CLASSES)
    return f"""
        SELECT {", ".join(colour.get(f, f'"{f}"::FLOAT AS "{f}"') for f in spec.FEATURES)},
               list_position([{classes}], class)::BIGINT - 1 AS label, redshift, objid, specobjid,
               CASE WHEN h < {spec.TRAIN_BELOW} THEN 0 WHEN h < {spec.VALIDATION_BELOW} THEN 1
                    ELSE 2 END AS split
        FROM (SELECT *, {_mix(f"xor({_mix('objid')}, specobjid)")} AS h FROM {source})"""


def _statistics() -> str:
    return ", ".join(f'avg("{f}"::DOUBLE), stddev_pop("{f}"::DOUBLE)' for f in spec.FEATURES)


def preprocess(out: Path, files: list[str]) -> dict[str, object]:
    """Written for data larger than memory, and as fast as the all-in-memory form at 2M rows
    (half its CPU): DuckDB spills to ``out/.spill`` past its memory limit (its default, 80 % of
    the machine's or the memory cgroup's), rows are written in no particular order, and
    duplicates are looked for only among the rows of keys seen more than once (an aggregate
    over the keys), not by windows over every row (which ran out of 14 GiB at 51 M rows). At
    51 M rows it used 11.9 GiB, within its default limit in a 14 GiB cgroup, and spilled
    nothing; with a limit of 4 GB it ran out of memory (docs/scale.md)."""
    db = duckdb.connect()
    spill = out / ".spill"
    _sql(db, f"SET temp_directory = '{spill}'")
    _sql(db, "SET preserve_insertion_order = false")
    raw = ", ".join(f'"{row[0]}"' for row in _sql(db, f"DESCRIBE SELECT * FROM '{files[0]}'"))
    _sql(db, f"CREATE VIEW rows AS SELECT *, {_reason()} AS reason FROM ({_numbered(files)})")
    _sql(
        db,
        "CREATE TABLE repeated AS SELECT objid, specobjid FROM rows "
        "GROUP BY objid, specobjid HAVING count(*) > 1",
    )
    # Among the repeated keys' rows only: a good row is a duplicate if an
    # earlier row of its piece has its key, or a lower piece's first row with the key is good.
    _sql(
        db,
        f"""
        CREATE TABLE duplicates AS
        SELECT file, row, '{spec.DUPLICATE}' AS duplicate FROM (
            SELECT *, coalesce(sum((first_in_piece AND reason IS NULL)::INT) OVER (
                PARTITION BY objid, specobjid ORDER BY file, row
                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS earlier
            FROM (
                SELECT objid, specobjid, file, row, reason, row_number() OVER (
                    PARTITION BY objid, specobjid, piece ORDER BY row) = 1 AS first_in_piece
                FROM rows SEMI JOIN repeated USING (objid, specobjid)))
        WHERE reason IS NULL AND (NOT first_in_piece OR earlier > 0)""",
    )
    _sql(
        db,
        f"COPY (SELECT {raw}, coalesce(reason, duplicate) AS reason "
        "FROM rows LEFT JOIN duplicates USING (file, row) "
        "WHERE reason IS NOT NULL OR duplicate IS NOT NULL) "
        f"TO '{out / 'quarantine.parquet'}' (FORMAT parquet)",
    )
    good = "(SELECT * FROM rows ANTI JOIN duplicates USING (file, row) WHERE reason IS NULL)"
    _sql(
        db,
        f"COPY ({_features(good)}) TO '{out / 'parts'}' (FORMAT parquet, PARTITION_BY (split))",
    )
    counts = {}
    for code, name in enumerate(spec.SPLITS):
        (part,) = (out / "parts" / f"split={code}").glob("*.parquet")
        part.rename(out / f"{name}.parquet")
        counts[name] = _sql(db, f"SELECT count(*) FROM '{out / (name + '.parquet')}'")[0][0]
    shutil.rmtree(out / "parts")
    stats = _sql(db, f"SELECT {_statistics()} FROM '{out / 'train.parquet'}'")[0]
    reasons = _sql(
        db,
        f"SELECT reason, count(*) FROM '{out / 'quarantine.parquet'}' GROUP BY reason",
    )
    db.close()
    shutil.rmtree(spill, ignore_errors=True)
    return {"splits": counts, "quarantine": dict(reasons), "mean": stats[0::2], "std": stats[1::2]}


def ingest(out: Path, files: list[str]) -> dict[str, object]:
    """Each CSV export into Parquet, ids exact uint64, empty float cells NaN, row groups of
    100,000 rows."""
    db = duckdb.connect()
    rows = []
    for path in files:
        header = [
            r[0] for r in _sql(db, f"DESCRIBE SELECT * FROM read_csv('{path}', all_varchar=true)")
        ]
        types = {
            name: "UBIGINT"
            if name in ("objid", "specobjid")
            else "VARCHAR"
            if name in ("class", "provenance")
            else "DOUBLE"
            for name in header
        }
        nan = ", ".join(
            f'coalesce("{n}", \'NaN\'::DOUBLE) AS "{n}"' if t == "DOUBLE" else f'"{n}"'
            for n, t in types.items()
        )
        target = out / f"{Path(path).stem}.parquet"
        _sql(
            db,
            f"COPY (SELECT {nan} FROM read_csv('{path}', header=true, columns={types!r}, "
            f"nullstr='')) TO '{target}' (FORMAT parquet, ROW_GROUP_SIZE {spec.ROW_GROUP_ROWS})",
        )
        rows.append(_sql(db, f"SELECT count(*) FROM '{target}'")[0][0])
    return {"rows": rows}


if __name__ == "__main__":
    stage, target, inputs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    target.mkdir(parents=True, exist_ok=True)
    spec.report((preprocess if stage == "preprocess" else ingest)(target, inputs), target)
