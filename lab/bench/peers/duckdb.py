"""The SDSS stages in DuckDB (SQL), as a user would write them: see :mod:`lab.bench.peers`."""

from __future__ import annotations

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


def preprocess(out: Path, files: list[str]) -> dict[str, object]:
    db = duckdb.connect()
    raw = ", ".join(f'"{row[0]}"' for row in _sql(db, f"DESCRIBE SELECT * FROM '{files[0]}'"))
    numbered = " UNION ALL ".join(
        f"SELECT *, {n} AS file, file_row_number AS row, "
        f"{n} * 1000000 + file_row_number // {spec.PIECE_ROWS} AS piece "
        f"FROM read_parquet('{f}', file_row_number=true)"
        for n, f in enumerate(files)
    )
    checked = f"""
        SELECT *, {_reason()} AS reason,
            row_number() OVER (PARTITION BY objid, specobjid, piece ORDER BY row) = 1
                AS first_in_piece
        FROM ({numbered})"""
    # A good row is a duplicate if an earlier row of its piece has its key, or a lower piece's
    # first row with the key is good.
    earlier_in_keys = """coalesce(sum((first_in_piece AND reason IS NULL)::INT) OVER (
            PARTITION BY objid, specobjid ORDER BY file, row
            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)"""
    _sql(
        db,
        f"""
        CREATE TABLE rows AS
        SELECT * REPLACE (
            CASE WHEN reason IS NULL AND (NOT first_in_piece OR {earlier_in_keys} > 0)
                THEN '{spec.DUPLICATE}' ELSE reason END AS reason)
        FROM ({checked}) ORDER BY file, row""",
    )
    _sql(
        db,
        f"COPY (SELECT {raw}, reason FROM rows WHERE reason IS NOT NULL ORDER BY file, row) "
        f"TO '{out / 'quarantine.parquet'}' (FORMAT parquet)",
    )
    colour = {c: f'("{c[0]}" - "{c[2]}")::FLOAT AS {c}' for c in spec.COLOURS}
    classes = ", ".join(f"'{c}'" for c in spec.CLASSES)
    _sql(
        db,
        f"""
        CREATE TABLE features AS
        SELECT {", ".join(colour.get(f, f'"{f}"::FLOAT AS "{f}"') for f in spec.FEATURES)},
               list_position([{classes}], class)::BIGINT - 1 AS label, redshift, objid, specobjid,
               CASE WHEN h < {spec.TRAIN_BELOW} THEN 0 WHEN h < {spec.VALIDATION_BELOW} THEN 1
                    ELSE 2 END AS split
        FROM (SELECT *, {_mix(f"xor({_mix('objid')}, specobjid)")} AS h FROM rows
              WHERE reason IS NULL ORDER BY file, row)
    """,
    )
    counts = {}
    for code, name in enumerate(spec.SPLITS):
        _sql(
            db,
            f"COPY (SELECT * EXCLUDE (split) FROM features WHERE split = {code}) "
            f"TO '{out / (name + '.parquet')}' (FORMAT parquet)",
        )
        counts[name] = _sql(db, f"SELECT count(*) FROM features WHERE split = {code}")[0][0]
    stats = _sql(
        db,
        "SELECT "
        + ", ".join(f'avg("{f}"::DOUBLE), stddev_pop("{f}"::DOUBLE)' for f in spec.FEATURES)
        + " FROM features WHERE split = 0",
    )[0]
    reasons = _sql(db, "SELECT reason, count(*) FROM rows WHERE reason IS NOT NULL GROUP BY reason")
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
