"""SDSS photometry + spectroscopic class: SkyServer SQL (via astroquery) or CasJobs exports.

SkyServer (``ingest_skyserver``)
    │  select count(*) with the query's WHERE
    │  keyset pages: select top N ... and (objid, specobjid) > last order by objid, specobjid
    │  (SkyServer caps rows per reply silently: a short page just means "ask again")
    ▼
staging dir of a new raw version ── one Parquet file per page; objid/specobjid exact uint64
    │  total fetched == count reported, or refuse
    ▼
raw catalog version "sdss" (sources: each query, its reply's sha256, fetch time)

The SQL is assembled from an allowlist of tables, columns and numeric bounds; no user string is
ever pasted into it. Replies are parsed here, not by astropy: 64-bit ids (specObjID passes 2^63)
must never go through float.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest
from preprocessing.sources.fetch import sha256_file
from preprocessing.sources.mnist import SourceError

__all__ = [
    "COLUMNS",
    "DEFAULT_BOUNDS",
    "Reply",
    "SourceError",
    "build_count_sql",
    "build_page_sql",
    "ingest_exports",
    "ingest_skyserver",
    "parse_reply",
    "typed_columns",
]

Progress = Callable[[str], None]

DEFAULT_SKYSERVER_URL = "https://skyserver.sdss.org"
DEFAULT_DATA_RELEASE = 17
DEFAULT_PAGE_SIZE = 10_000
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, kw_only=True)
class SkyServerOptions:
    """Where and what to query when SDSS is fetched from SkyServer rather than exports."""

    url: str = DEFAULT_SKYSERVER_URL
    """SkyServer base URL (a mirror, or a local server in tests)."""
    data_release: int = DEFAULT_DATA_RELEASE
    limit: int | None = None
    """At most this many rows; None: all that match."""


# Column types of the raw tables we write.
UINT64, FLOAT64, STRING = "uint64", "float64", "string"

_BANDS = ("u", "g", "r", "i", "z")

# (output name, table alias, column in that table, type). Output names are the SQL aliases too.
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("objid", "p", "objid", UINT64),
    ("ra", "p", "ra", FLOAT64),
    ("dec", "p", "dec", FLOAT64),
    *((b, "p", b, FLOAT64) for b in _BANDS),
    *((f"petroMag_{b}", "p", f"petroMag_{b}", FLOAT64) for b in _BANDS),
    *((f"petroRad_{b}", "p", f"petroRad_{b}", FLOAT64) for b in _BANDS),
    ("specobjid", "s", "specobjid", UINT64),
    ("class", "s", "class", STRING),
    ("redshift", "s", "z", FLOAT64),
)
SCHEMA: dict[str, str] = {name: kind for name, _t, _c, kind in COLUMNS}

# Tables and the columns of each that may appear in a bound (WHERE) clause.
_TABLES = {"p": "PhotoObj", "s": "SpecObj"}
_BOUNDABLE: dict[str, tuple[str, str]] = {
    name: (table, column) for name, table, column, kind in COLUMNS if kind == FLOAT64
}

# The seed project's cut: bright enough in u and g for reliable spectra.
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"u": (0.0, 19.6), "g": (0.0, 20.0)}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_UINT = re.compile(r"[0-9]{1,20}")
_TAG = re.compile(r"<[^>]*>")


# ---------------------------------------------------------------------------------------------
# SQL


def _number(x: float) -> str:
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise SourceError(f"SQL bound {x!r} is not a number") from None
    if not math.isfinite(value):
        raise SourceError(f"SQL bound {x!r} is not a finite number")
    return repr(value)


def _where(bounds: Mapping[str, tuple[float, float]]) -> str:
    clauses: list[str] = []
    for name in sorted(bounds):
        if name not in _BOUNDABLE:
            raise SourceError(
                f"cannot bound column {name!r}; boundable: {', '.join(sorted(_BOUNDABLE))}"
            )
        low, high = (_number(x) for x in bounds[name])
        if not float(low) <= float(high):
            raise SourceError(f"bound on {name}: low {low} exceeds high {high}")
        table, column = _BOUNDABLE[name]
        clauses.append(f"{table}.{column} between {low} and {high}")
    return " and ".join(clauses) if clauses else "1 = 1"


def _from() -> str:
    return f"from {_TABLES['p']} as p join {_TABLES['s']} as s on s.bestobjid = p.objid"


def build_count_sql(bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS) -> str:
    """The ``select count(*)`` with the same join and WHERE as the pages."""
    return f"select count(*) as n {_from()} where {_where(bounds)}"


def build_page_sql(
    top: int,
    after: tuple[int, int] | None,
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS,
) -> str:
    """One keyset page: the next ``top`` rows after (objid, specobjid) ``after``.

    The key is (objid, specobjid), not objid alone: one photometric object can be the best match
    of several spectra, and a page boundary inside such a group must not lose rows.
    """
    if not 1 <= int(top) <= 10_000_000:
        raise SourceError(f"page size {top!r} out of range 1..10,000,000")
    select = ", ".join(
        f"{t}.{c}" if c == name else f"{t}.{c} as {name}" for name, t, c, _k in COLUMNS
    )
    where = _where(bounds)
    if after is not None:
        objid, specobjid = (int(after[0]), int(after[1]))
        if not (0 <= objid <= UINT64_MAX and 0 <= specobjid <= UINT64_MAX):
            raise SourceError(f"keyset position {after!r} is not a pair of uint64")
        where += f" and (p.objid > {objid} or (p.objid = {objid} and s.specobjid > {specobjid}))"
    return f"select top {int(top)} {select} {_from()} where {where} order by p.objid, s.specobjid"


# ---------------------------------------------------------------------------------------------
# Replies


@dataclass(frozen=True)
class Reply:
    """A SkyServer CSV reply: a "#Table1" line, a header, then rows, all still text."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(_TAG.sub(" ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def parse_reply(text: str, *, where: str) -> Reply:
    """Parse one SkyServer CSV reply; ``where`` names its URL or file in errors.

    SkyServer answers a failed query with a text or HTML page carrying the error, not CSV, and
    sometimes with HTTP 200: anything not starting with "#Table1" is refused with its gist.
    """
    body = text.lstrip("\ufeff").strip()
    if not body:
        raise SourceError(f"{where}: empty reply")
    lines = body.splitlines()
    # SkyServer's error page (astroquery looks for "error_message" too), or a "CSV" whose
    # first line is the error text.
    first = lines[1] if lines[0].strip() == "#Table1" and len(lines) > 1 else lines[0]
    if "error_message" in body or first.lstrip().lower().startswith("error"):
        raise SourceError(f"{where}: SkyServer reported an error: {_one_line(body)}")
    if lines[0].strip() != "#Table1":
        raise SourceError(f"{where}: reply is not a '#Table1' CSV table: {_one_line(body)}")
    try:
        records = list(csv.reader(lines[1:], strict=True))
    except csv.Error as exc:
        raise SourceError(f"{where}: malformed CSV: {exc}") from exc
    if not records:
        raise SourceError(f"{where}: reply has no header line")
    header = tuple(h.strip() for h in records[0])
    seen: set[str] = set()
    for name in header:
        if not _IDENT.fullmatch(name):
            raise SourceError(f"{where}: column name {name[:40]!r} is not a plain identifier")
        if name.lower() in seen:
            raise SourceError(f"{where}: column {name!r} appears twice")
        seen.add(name.lower())
    rows = []
    for number, record in enumerate(records[1:], start=1):
        if len(record) == 1 and record[0].startswith("#Table"):
            raise SourceError(f"{where}: reply holds more than one table (row {number})")
        if len(record) != len(header):
            raise SourceError(
                f"{where}: row {number} has {len(record)} fields, header has {len(header)}"
                + (f" ({_one_line(','.join(record), 80)})" if record else "")
            )
        rows.append(tuple(record))
    return Reply(columns=header, rows=tuple(rows))


def _parse_uint64(value: str, where: str, column: str, row: int) -> int:
    v = value.strip()
    if not _UINT.fullmatch(v) or int(v) > UINT64_MAX:
        raise SourceError(f"{where}: {column} in row {row} is {v[:30]!r}, not a uint64")
    return int(v)


def _parse_float(value: str, where: str, column: str, row: int) -> float:
    v = value.strip()
    try:
        x = float(v)
    except ValueError:
        raise SourceError(f"{where}: {column} in row {row} is {v[:30]!r}, not a number") from None
    if not math.isfinite(x):
        raise SourceError(f"{where}: {column} in row {row} is {v[:30]!r}, not finite")
    return x


def typed_columns(
    reply: Reply, schema: Mapping[str, str], *, where: str, first_row: int = 1
) -> dict[str, npt.NDArray[Any] | list[str]]:
    """The columns of ``schema`` (matched case-insensitively), converted exactly.

    uint64 columns are parsed as integers (never float); -9999 sentinels stay as they are.
    """
    index = {c.lower(): i for i, c in enumerate(reply.columns)}
    missing = [name for name in schema if name.lower() not in index]
    if missing:
        raise SourceError(
            f"{where}: reply lacks column(s) {', '.join(missing)}; "
            f"it has {', '.join(reply.columns)}"
        )
    out: dict[str, npt.NDArray[Any] | list[str]] = {}
    for name, kind in schema.items():
        i = index[name.lower()]
        values = [row[i] for row in reply.rows]
        if kind == UINT64:
            out[name] = np.array(
                [_parse_uint64(v, where, name, r) for r, v in enumerate(values, first_row)],
                dtype=np.uint64,
            )
        elif kind == FLOAT64:
            out[name] = np.array(
                [_parse_float(v, where, name, r) for r, v in enumerate(values, first_row)],
                dtype=np.float64,
            )
        elif kind == STRING:
            out[name] = [v.strip() for v in values]
        else:
            raise ValueError(f"unknown column type {kind!r}")
    return out


def _arrow_table(
    columns: Mapping[str, npt.NDArray[Any] | list[str]], schema: Mapping[str, str] = SCHEMA
) -> Any:
    arrays = []
    fields = []
    for name, values in columns.items():
        kind = schema[name]
        if kind == UINT64:
            arrays.append(pa.array(values, type=pa.uint64()))
            fields.append(pa.field(name, pa.uint64(), nullable=False))
        elif kind == FLOAT64:
            arrays.append(pa.array(values, type=pa.float64()))
            fields.append(pa.field(name, pa.float64(), nullable=False))
        else:
            arrays.append(pa.array(values, type=pa.string()))
            fields.append(pa.field(name, pa.string(), nullable=False))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


# ---------------------------------------------------------------------------------------------
# Fetching


def query_url(skyserver_url: str, data_release: int) -> str:
    """The SQL endpoint, built the way astroquery's SDSSClass builds it, on any base URL."""
    from astroquery.sdss import SDSSClass

    if not skyserver_url.startswith(("http://", "https://")):
        raise SourceError(f"SkyServer URL {skyserver_url!r} is not http(s)")
    if data_release < 10:
        suffix = SDSSClass.QUERY_URL_SUFFIX_DR_OLD
    elif data_release == 10:
        suffix = SDSSClass.QUERY_URL_SUFFIX_DR_10
    else:
        suffix = SDSSClass.QUERY_URL_SUFFIX_DR_NEW
    return str(skyserver_url.rstrip("/") + suffix.format(dr=int(data_release)))


class _SkyServer:
    """astroquery's SDSS client pointed at one base URL, giving back reply text."""

    def __init__(self, skyserver_url: str, data_release: int, timeout: float) -> None:
        from astroquery.sdss import SDSSClass

        self.base = skyserver_url.rstrip("/")
        self.data_release = int(data_release)
        self.url = query_url(skyserver_url, data_release)
        self.timeout = timeout
        self.client = SDSSClass()

    def fetch(self, sql: str, *, attempts: int = 3) -> tuple[str, str]:
        """(reply text, fetch time) of one query. Retries transport errors, not bad replies."""
        import requests

        payload = self.client.query_sql_async(
            sql, data_release=self.data_release, get_query_payload=True
        )
        for attempt in range(1, attempts + 1):
            fetched_at = datetime.now(UTC).isoformat(timespec="seconds")
            try:
                response = self.client._request(
                    "GET", self.url, params=payload, timeout=self.timeout, cache=False
                )
            except (requests.RequestException, OSError) as exc:
                if attempt == attempts:
                    raise SourceError(f"{self.url}: cannot query SkyServer: {exc}") from exc
                time.sleep(2**attempt)
                continue
            if response.status_code >= 500 and attempt < attempts:
                time.sleep(2**attempt)
                continue
            if response.status_code != 200:
                raise SourceError(
                    f"{self.url}: HTTP {response.status_code}: {_one_line(response.text)}"
                )
            return str(response.text), fetched_at
        raise AssertionError("unreachable")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _count(reply: Reply, where: str) -> int:
    if len(reply.rows) != 1 or len(reply.columns) != 1:
        raise SourceError(
            f"{where}: count reply has {len(reply.rows)} rows of {len(reply.columns)} columns, "
            "expected one number"
        )
    return _parse_uint64(reply.rows[0][0], where, reply.columns[0], 1)


def _keys(columns: Mapping[str, Any]) -> list[tuple[int, int]]:
    return list(zip(columns["objid"].tolist(), columns["specobjid"].tolist(), strict=True))


def ingest_skyserver(
    catalog: Catalog,
    *,
    skyserver_url: str = DEFAULT_SKYSERVER_URL,
    data_release: int = DEFAULT_DATA_RELEASE,
    limit: int | None = None,
    page_size: int | None = None,
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS,
    timeout: float = 120.0,
    progress: Progress = lambda _msg: None,
) -> Manifest:
    """Query SkyServer for the photometry + class table into a new raw version "sdss".

    Counts first, then pages by (objid, specobjid); refuses (and commits nothing) when the rows
    fetched differ from the rows counted, or when any reply is empty or an error page.
    """
    # Short replies are expected (the server's cap may be below the page size): pages are
    # asked for by size and a reply shorter than asked just means "continue after its last key".
    page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
    if limit is not None and limit < 1:
        raise SourceError(f"limit {limit!r} must be a positive number of rows")
    if not 1 <= page_size <= 10_000_000:
        raise SourceError(f"page size {page_size!r} out of range 1..10,000,000")
    server = _SkyServer(skyserver_url, data_release, timeout)
    _where(bounds)  # refuses unknown columns and non-numbers before any request
    bounds = {k: (float(lo), float(hi)) for k, (lo, hi) in bounds.items()}
    sources: list[dict[str, Any]] = []

    def record(sql: str, text: str, fetched_at: str, rows: int, file: str | None) -> None:
        entry: dict[str, Any] = {
            "uri": server.url,
            "skyserver_url": server.base,
            "data_release": server.data_release,
            "query": sql,
            "fetched_at": fetched_at,
            "rows": rows,
            "sha256": _sha256(text),
        }
        if file is not None:
            entry["file"] = file
        sources.append(entry)

    count_sql = build_count_sql(bounds)
    text, fetched_at = server.fetch(count_sql)
    reported = _count(parse_reply(text, where=server.url), server.url)
    record(count_sql, text, fetched_at, 1, None)
    if reported == 0:
        raise SourceError(f"{server.url}: SkyServer counts no rows for {count_sql!r}")
    target = reported if limit is None else min(reported, limit)
    progress(f"SkyServer counts {reported:,} rows; fetching {target:,} in pages of {page_size:,}")

    with catalog.stage("sdss", kind="raw") as stage:
        fetched = 0
        pages = 0
        after: tuple[int, int] | None = None
        file_rows: dict[str, int] = {}
        while fetched < target:
            ask = min(page_size, target - fetched)
            sql = build_page_sql(ask, after, bounds)
            text, fetched_at = server.fetch(sql)
            where = f"{server.url} (page {pages + 1})"
            columns = typed_columns(parse_reply(text, where=where), SCHEMA, where=where)
            n = len(columns["objid"])
            if n == 0:
                break
            if n > ask:
                raise SourceError(f"{where}: asked for {ask:,} rows, got {n:,}")
            keys = _keys(columns)
            previous = after
            for key in keys:
                if previous is not None and not key > previous:
                    raise SourceError(
                        f"{where}: rows not in (objid, specobjid) order after {previous}; "
                        "the server ignored 'order by'"
                    )
                previous = key
            pages += 1
            name = f"page-{pages:05d}.parquet"
            pq.write_table(_arrow_table(columns), stage.path / name)
            record(sql, text, fetched_at, n, name)
            file_rows[name] = n
            fetched += n
            after = keys[-1]
            if n < ask and fetched < target:
                progress(f"reply capped at {n:,} rows; continuing after objid {after[0]}")
            progress(f"page {pages}: {n:,} rows ({fetched:,} / {target:,})")
        if fetched != target:
            raise SourceError(
                f"{server.url}: SkyServer counted {reported:,} rows"
                + (f" (limit {limit:,})" if limit is not None else "")
                + f" but paging returned {fetched:,}; the table changed or replies were cut "
                "short, retry later"
            )
        if limit is None or limit > reported:
            probe = build_page_sql(1, after, bounds)
            text, fetched_at = server.fetch(probe)
            extra = parse_reply(text, where=f"{server.url} (final probe)")
            record(probe, text, fetched_at, len(extra.rows), None)
            if extra.rows:
                raise SourceError(
                    f"{server.url}: SkyServer counted {reported:,} rows but holds more; "
                    "the table changed while paging, retry later"
                )
        manifest: Manifest = stage.commit(
            sources=sources,
            parameters={
                "skyserver_url": server.base,
                "data_release": server.data_release,
                "limit": limit,
                "page_size": page_size,
                "bounds": {k: list(v) for k, v in sorted(bounds.items())},
            },
            schema={"format": "parquet", "columns": dict(SCHEMA)},
            statistics={"rows": fetched, "pages": pages, "count_reported": reported},
            rows=fetched,
            file_rows=file_rows,
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# CasJobs exports: CSV, FITS, VOTable files of the same table, one Parquet file out per input


# Columns an export may carry besides SCHEMA: synth.py marks its rows synthetic.
OPTIONAL: dict[str, str] = {"provenance": STRING}

_FORMATS = {
    ".csv": "csv",
    ".fits": "fits",
    ".fit": "fits",
    ".fts": "fits",
    ".vot": "votable",
    ".votable": "votable",
    ".xml": "votable",
}
_CSV_CHUNK = 100_000
# (schema of the file, typed columns) of a run of rows of one export file.
Chunk = tuple[dict[str, str], dict[str, npt.NDArray[Any] | list[str]]]


def _export_format(path: Path) -> str | None:
    return _FORMATS.get(path.suffix.lower())


def _export_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _export_format(p))
        if not files:
            raise SourceError(
                f"{source}: no CSV, FITS or VOTable files "
                f"({', '.join(sorted(_FORMATS))}) in this directory"
            )
        return files
    matches = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
    if not matches:
        raise SourceError(f"{source}: no such directory, and no file matches it as a glob")
    for match in matches:
        if _export_format(match) is None:
            raise SourceError(f"{match}: not a CSV, FITS or VOTable file (by its suffix)")
    return matches


def _match_columns(names: Sequence[str], where: str) -> tuple[dict[str, str], dict[str, str]]:
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


def _csv_chunks(path: Path) -> Iterator[Chunk]:
    """(schema, columns) chunks of a CasJobs CSV export (an optional "#Table1" line first)."""
    where = str(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            first = f.readline()
            if first.strip() != "#Table1":
                f.seek(0)
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            if header is None:
                raise SourceError(f"{where}: empty file, no header line")
            names = [h.strip() for h in header]
            mapping, schema = _match_columns(names, where)
            renamed = tuple(
                next((c for c, n in mapping.items() if n == name), name) for name in names
            )
            row_number = 1
            while True:
                chunk: list[tuple[str, ...]] = []
                for record in reader:
                    if len(record) != len(names):
                        raise SourceError(
                            f"{where}: row {row_number + len(chunk)} has {len(record)} fields, "
                            f"header has {len(names)}"
                        )
                    chunk.append(tuple(record))
                    if len(chunk) == _CSV_CHUNK:
                        break
                if not chunk:
                    return
                reply = Reply(columns=renamed, rows=tuple(chunk))
                yield schema, typed_columns(reply, schema, where=where, first_row=row_number)
                row_number += len(chunk)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{where}: unreadable CSV: {exc}") from exc


def _table_column(table: Any, name: str, kind: str, where: str) -> npt.NDArray[Any] | list[str]:
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


def _astropy_chunks(path: Path, fmt: str) -> Iterator[Chunk]:
    from astropy.table import Table

    where = str(path)
    try:
        if fmt == "fits":
            table = Table.read(path, format="fits", memmap=True, character_as_bytes=False)
        else:
            table = Table.read(path, format="votable")
    except SourceError:
        raise
    except Exception as exc:  # astropy raises many kinds for a corrupt file
        raise SourceError(f"{where}: unreadable {fmt.upper()}: {_one_line(str(exc))}") from exc
    mapping, schema = _match_columns(list(table.colnames), where)
    # FITS columns stay memory-mapped where astropy can (no scaling); converting a slice at a
    # time keeps the typed copies to one chunk.
    for start in range(0, len(table), _CSV_CHUNK):
        part = table[start : start + _CSV_CHUNK]
        columns: dict[str, npt.NDArray[Any] | list[str]] = {}
        for name, kind in schema.items():
            try:
                columns[name] = _table_column(part, mapping[name], kind, where)
            except (UnicodeError, ValueError, TypeError) as exc:
                raise SourceError(
                    f"{where}: column {mapping[name]}: {_one_line(str(exc))}"
                ) from exc
        yield schema, columns


def ingest_exports(
    catalog: Catalog,
    *,
    source: str,
    progress: Progress = lambda _msg: None,
) -> Manifest:
    """CasJobs exports (a directory or a glob of CSV, FITS, VOTable files) into raw "sdss".

    Each input is converted on its own into one Parquet file, so memory is bounded by the
    largest input (CSV by a chunk). Columns are matched case-insensitively against the expected
    schema; a missing, unexpected or mistyped column refuses the whole ingest.
    """
    files = _export_files(source)
    with catalog.stage("sdss", kind="raw") as stage:
        sources: list[dict[str, Any]] = []
        file_rows: dict[str, int] = {}
        total = 0
        synthetic = 0
        for number, path in enumerate(files, start=1):
            synthetic_before = synthetic
            fmt = _export_format(path)
            assert fmt is not None
            chunks = _csv_chunks(path) if fmt == "csv" else _astropy_chunks(path, fmt)
            out_name = f"{number:05d}-{path.stem}.parquet"
            writer: Any = None
            rows = 0
            try:
                for schema, columns in chunks:
                    table = _arrow_table(columns, schema)
                    if writer is None:
                        writer = pq.ParquetWriter(stage.path / out_name, table.schema)
                    writer.write_table(table)
                    rows += table.num_rows
                    if "provenance" in columns:
                        synthetic += sum(1 for v in columns["provenance"] if v == "synthetic")
            finally:
                if writer is not None:
                    writer.close()
            if writer is None or rows == 0:
                raise SourceError(f"{path}: no rows")
            digest, size = sha256_file(path)
            sources.append(
                {
                    "uri": path.resolve().as_uri(),
                    "file": out_name,
                    "format": fmt,
                    "sha256": digest,
                    "bytes": size,
                    "rows": rows,
                }
            )
            # synth.py's rows say so in a provenance column; CasJobs exports have none.
            marked = synthetic - synthetic_before
            if marked:
                sources[-1]["provenance"] = "synthetic" if marked == rows else "mixed"
            file_rows[out_name] = rows
            total += rows
            progress(f"{path.name}: {rows:,} rows ({fmt})")
        manifest: Manifest = stage.commit(
            sources=sources,
            parameters={"format": "casjobs-export"},
            schema={"format": "parquet", "columns": dict(SCHEMA), "optional": dict(OPTIONAL)},
            statistics={"rows": total, "files": len(files), "synthetic_rows": synthetic},
            rows=total,
            file_rows=file_rows,
        )
    return manifest
