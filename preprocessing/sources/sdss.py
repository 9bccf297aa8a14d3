"""SDSS photometry + spectroscopic class from SkyServer SQL, and the table's schema.

plan_skyserver_ingest (pure: checks URL, bounds, page size) ─▶ SkyServerJob
    │  pass "count": one query, select count(*) with the query's WHERE (with concurrency > 1
    │      also min/max objid); its answer kept in the job's folder (count.json)
    │  pass "pages": one task per objid range (one range, or `concurrency` cut from min..max),
    │      each paging its range in order, one query at a time:
    │      select top N ... and (objid, specobjid) > last order by objid, specobjid
    │      (SkyServer caps rows per reply silently: a short page just means "ask again");
    │      every reply streamed under a byte cap set by the rows asked for; every page
    │      written whole, with its source record beside it: a rerun continues after the last
    │  commit: total fetched == count reported (no row past the last, for an unlimited run),
    │      or refuse
    ▼
raw catalog version "sdss" ── one Parquet file per page; objid/specobjid exact uint64
    (sources: each query, its reply's sha256, fetch time)

The SQL is assembled from an allowlist of tables, columns and numeric bounds; no user string is
ever pasted into it. Replies are parsed here, not by astropy: 64-bit ids (specObjID passes 2^63)
must never go through float. CasJobs exports are read by ``exports.py``.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, FileEntry, Manifest, Staging
from data_catalog.layout import SkyServerLayout
from preprocessing.driver import Results, TaskSpec, run_job, serial_runner
from preprocessing.fingerprint import stage_code
from preprocessing.shard_files import crash_point, partial_path, record_result, recorded_result
from preprocessing.sources import task_progress
from preprocessing.sources.errors import SourceError
from preprocessing.sources.fetch import sha256_file
from preprocessing.sources.retry import (
    RetryPolicy,
    ServerAsksTooLong,
    Transient,
    is_transient_status,
    retry_after_seconds,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_BOUNDS",
    "PageRange",
    "Reply",
    "SkyServerJob",
    "SkyServerQuery",
    "build_count_sql",
    "build_page_sql",
    "ingest_skyserver",
    "objid_ranges",
    "parse_reply",
    "plan_skyserver_ingest",
    "reply_cap",
    "typed_columns",
]

Progress = Callable[[str], None]

DEFAULT_SKYSERVER_URL = "https://skyserver.sdss.org"
DEFAULT_DATA_RELEASE = 17
DEFAULT_PAGE_SIZE = 10_000
UINT64_MAX = 2**64 - 1


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


def build_count_sql(
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS, *, objid_range: bool = False
) -> str:
    """The ``select count(*)`` with the same join and WHERE as the pages; with ``objid_range``
    also the least and greatest objid (columns n, min_objid, max_objid)."""
    extent = ", min(p.objid) as min_objid, max(p.objid) as max_objid" if objid_range else ""
    return f"select count(*) as n{extent} {_from()} where {_where(bounds)}"


ObjidRange = tuple[int | None, int | None]
"""objids low..high, both included; None: open on that side."""


def _uint64(value: int, what: str) -> int:
    number = int(value)
    if not 0 <= number <= UINT64_MAX:
        raise SourceError(f"{what} {value!r} is not a uint64")
    return number


def build_page_sql(
    top: int,
    after: tuple[int, int] | None,
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS,
    objids: ObjidRange = (None, None),
) -> str:
    """One keyset page: the next ``top`` rows after (objid, specobjid) ``after``, among the
    objids of ``objids``.

    The key is (objid, specobjid), not objid alone: one photometric object can be the best match
    of several spectra, and a page boundary inside such a group must not lose rows.
    """
    if not 1 <= int(top) <= 10_000_000:
        raise SourceError(f"page size {top!r} out of range 1..10,000,000")
    select = ", ".join(
        f"{t}.{c}" if c == name else f"{t}.{c} as {name}" for name, t, c, _k in COLUMNS
    )
    where = _where(bounds)
    low, high = objids
    if low is not None:
        where += f" and p.objid >= {_uint64(low, 'objid range start')}"
    if high is not None:
        where += f" and p.objid <= {_uint64(high, 'objid range end')}"
    if after is not None:
        try:
            objid, specobjid = (_uint64(after[0], "objid"), _uint64(after[1], "specobjid"))
        except SourceError:
            raise SourceError(f"keyset position {after!r} is not a pair of uint64") from None
        where += f" and (p.objid > {objid} or (p.objid = {objid} and s.specobjid > {specobjid}))"
    return f"select top {int(top)} {select} {_from()} where {where} order by p.objid, s.specobjid"


def objid_ranges(low: int, high: int, parts: int) -> list[ObjidRange]:
    """At most ``parts`` contiguous objid ranges, in order, cut evenly from ``low..high``,
    that together hold every uint64 exactly once: the first is open below and the last open
    above, so that rows the count did not see are still paged (and the totals check refuses
    them). Fewer ranges when ``low..high`` holds fewer than ``parts`` ids."""
    if not 0 <= low <= high <= UINT64_MAX or parts < 1:
        raise ValueError(f"cannot cut {low}..{high} into {parts} ranges")
    span = high - low + 1
    # The first objid of every range but the first; each in low+1..high, so none is empty.
    starts = sorted({low + span * k // parts for k in range(1, parts)} - {low})
    return list(zip([None, *starts], [start - 1 for start in starts] + [None], strict=True))


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
    columns: Mapping[str, npt.NDArray[Any] | list[str]], kinds: Mapping[str, str] = SCHEMA
) -> Any:
    arrays = []
    fields = []
    for name, values in columns.items():
        kind = kinds[name]
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

# A page row is about 600 bytes of CSV: a reply far longer than the rows asked for can fill is
# no answer to the query (an endless or runaway reply) and is refused before it fills memory.
_BYTES_PER_ROW = 4096
_REPLY_MARGIN = 1 << 20
"""Room for the header line, or for SkyServer's HTML error page."""
_READ_CHUNK = 1 << 16
# The slowest rate a reply may arrive at, past the reply deadline (a reply may take the
# deadline plus its bytes at this rate).
_SLOWEST_BYTES_PER_SECOND = 64 << 10
_ATTEMPTS = 3
# The sources' one policy (sources/retry.py): 2 s, then 4 s, each plus up to 1 s of jitter, or
# longer when SkyServer's 429/503 says Retry-After.
_POLICY = RetryPolicy(attempts=_ATTEMPTS, backoff=2.0, jitter=1.0)
_CHARSET = re.compile(r"charset=\"?([A-Za-z0-9_.:-]+)", re.IGNORECASE)


def reply_cap(rows: int) -> int:
    """The most bytes a reply to a query for ``rows`` rows may take."""
    return _BYTES_PER_ROW * rows + _REPLY_MARGIN


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


@dataclass(frozen=True, kw_only=True)
class _Answer:
    """One whole reply: its text, the sha256 of its bytes, and when it was asked for."""

    text: str
    sha256: str
    fetched_at: str


class _SkyServer:
    """SkyServer's SQL endpoint at one base URL. The request is astroquery's; the reply is
    streamed here, its size checked as it arrives."""

    def __init__(
        self, skyserver_url: str, data_release: int, timeout: float, progress: Progress
    ) -> None:
        import requests
        from astroquery.sdss import SDSSClass

        self.base = skyserver_url.rstrip("/")
        self.data_release = int(data_release)
        self.url = query_url(skyserver_url, data_release)
        self.timeout = timeout
        self.progress = progress
        self.client = SDSSClass()
        self.session = requests.Session()
        # Compressed replies would be decoded past the size check unseen: ask for plain bytes.
        self.session.headers.update(
            {"User-Agent": "shardflow (astroquery payload)", "Accept-Encoding": "identity"}
        )

    def close(self) -> None:
        self.session.close()

    def source(self, sql: str, answer: _Answer, rows: int) -> dict[str, Any]:
        """The manifest's record of one query."""
        return {
            "uri": self.url,
            "skyserver_url": self.base,
            "data_release": self.data_release,
            "query": sql,
            "fetched_at": answer.fetched_at,
            "rows": rows,
            "sha256": answer.sha256,
        }

    def fetch(self, sql: str, *, rows: int, what: str) -> _Answer:
        """The reply to ``sql``, which asks for at most ``rows`` rows (``what`` names it in
        errors). Retries transport errors and busy servers, reporting each wait; never a reply
        that is bad or too long."""
        payload = self.client.query_sql_async(
            sql, data_release=self.data_release, get_query_payload=True
        )

        def attempt(_number: int) -> _Answer:
            fetched_at = datetime.now(UTC).isoformat(timespec="seconds")
            body, charset = self._get(payload, reply_cap(rows), what)
            return _Answer(
                text=body.decode(charset, errors="replace"),
                sha256=hashlib.sha256(body).hexdigest(),
                fetched_at=fetched_at,
            )

        def on_retry(number: int, failure: Transient, wait: float) -> None:
            self.progress(
                f"{self.url}: {failure} (attempt {number}/{_ATTEMPTS}); retrying in {wait:.1f} s"
            )

        try:
            return _POLICY.call(attempt, on_retry=on_retry)
        except ServerAsksTooLong as exc:
            raise SourceError(f"{self.url}: {exc}; retry later") from exc
        except Transient as exc:
            raise SourceError(f"{self.url}: {exc} ({_ATTEMPTS} attempts); retry later") from exc

    def _get(self, payload: Mapping[str, Any], cap: int, what: str) -> tuple[bytes, str]:
        """One GET: (the reply's bytes, its charset); raises Transient."""
        import requests

        from data_catalog import deadlines

        # The whole reply, first byte to last, within the reply deadline plus the time what
        # arrived takes at _SLOWEST_BYTES_PER_SECOND: a server sending a byte every few
        # seconds never trips a per-read timeout.
        limit = deadlines.REPLY.seconds()
        timeouts = (deadlines.CONNECT.seconds(), min(self.timeout, limit))
        until = _Until(time.monotonic() + limit)
        try:
            with self.session.get(
                self.url, params=payload, timeout=timeouts, stream=True
            ) as response:
                status = response.status_code
                if status != 200:
                    gist = _one_line(
                        _read_capped(response, _REPLY_MARGIN, "", cut=True, until=until).decode(
                            errors="replace"
                        )
                    )
                    if is_transient_status(status):
                        raise Transient(
                            f"HTTP {status}: {gist}",
                            retry_after=retry_after_seconds(response.headers.get("Retry-After")),
                        )
                    raise SourceError(f"{self.url}: HTTP {status}: {gist}")
                body = _read_capped(
                    response, cap, f"{self.url}: reply exceeds {cap:,} bytes {what}", until=until
                )
                return body, _charset(response.headers.get("Content-Type", ""))
        except _Late:
            raise Transient(
                f"the reply was not whole within {limit:.0f} s and arrived slower than "
                f"{_SLOWEST_BYTES_PER_SECOND >> 10} KiB/s (the limit is {deadlines.REPLY.variable})"
            ) from None
        except (requests.RequestException, OSError) as exc:
            raise Transient(f"cannot query SkyServer: {_one_line(str(exc))}") from exc


class _Late(Exception):
    """A reply still arriving when its time is up."""


@dataclass(frozen=True)
class _Until:
    """When a reply must be whole: ``base`` (a ``time.monotonic()``: its start plus the reply
    deadline) plus the time its bytes so far take at the slowest rate allowed."""

    base: float

    def passed(self, received: int) -> bool:
        return time.monotonic() > self.base + received / _SLOWEST_BYTES_PER_SECOND


def _read_capped(
    response: Any, cap: int, refusal: str, *, cut: bool = False, until: _Until | None = None
) -> bytes:
    """The body of a streamed ``requests`` response, read until ``cap`` bytes: past it,
    refused with ``refusal`` (or, with ``cut``, cut there), never held whole first. Read as
    it arrives (one socket read at a time), so that a reply still coming when ``until`` has
    passed is :class:`_Late`."""
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise SourceError(f"{response.url}: reply is {encoding}-encoded though asked for plain")
    length = response.headers.get("Content-Length", "").strip()
    if not cut and length.isdigit() and int(length) > cap:
        raise SourceError(refusal)
    body = bytearray()
    while chunk := response.raw.read1(_READ_CHUNK):
        body += chunk
        if len(body) > cap:
            if cut:
                return bytes(body[:cap])
            raise SourceError(refusal)
        if until is not None and until.passed(len(body)):
            raise _Late
    return bytes(body)


def _charset(content_type: str) -> str:
    """The reply's declared charset when Python knows it, else UTF-8 (SkyServer's)."""
    match = _CHARSET.search(content_type)
    if match is None:
        return "utf-8"
    try:
        return codecs.lookup(match.group(1)).name
    except LookupError:
        return "utf-8"


def _count(reply: Reply, where: str, *, columns: int) -> int:
    if len(reply.rows) != 1 or len(reply.columns) != columns:
        raise SourceError(
            f"{where}: count reply has {len(reply.rows)} rows of {len(reply.columns)} columns, "
            f"expected one row of {columns}"
        )
    return _parse_uint64(reply.rows[0][0], where, reply.columns[0], 1)


def _keys(columns: Mapping[str, Any]) -> list[tuple[int, int]]:
    return list(zip(columns["objid"].tolist(), columns["specobjid"].tolist(), strict=True))


# ---------------------------------------------------------------------------------------------
# The ingest job: count, then page (one range, or `concurrency` ranges at once), then commit

# Bumped when the files a task leaves in the job's folder change meaning.
_WORK_LAYOUT = 1
# In the job's folder: why a task refused. Refusals are results, not task failures: the driver
# raises them in its own process, in one line, where a Dask worker would log a failed task's
# traceback on the terminal too.
_REFUSED = "refused.txt"


@dataclass(frozen=True, kw_only=True)
class SkyServerQuery:
    """What every task of one ingest asks SkyServer (plain and picklable)."""

    skyserver_url: str
    data_release: int
    bounds: tuple[tuple[str, tuple[float, float]], ...]
    """Sorted by column."""
    timeout: float
    """Seconds to connect and between bytes of a reply (not for the whole reply)."""

    def server(self, progress: Progress) -> _SkyServer:
        return _SkyServer(self.skyserver_url, self.data_release, self.timeout, progress)

    @property
    def where(self) -> dict[str, tuple[float, float]]:
        return dict(self.bounds)


@dataclass(frozen=True, kw_only=True)
class PageRange:
    """One paging task's share of the rows."""

    number: int
    """1-based; its pages wait in ``range-<number>/`` of the job's folder."""
    of: int
    objids: ObjidRange
    target: int | None
    """Stop after this many rows (a single range); None: page until a reply holds none."""
    probe: bool
    """Once ``target`` rows are in, ask for one more: SkyServer must have none."""


def _page_path(work: Path, number: int, page: int) -> Path:
    # Two levels below the job's folder, as crash_point counts the job's files.
    return work / f"range-{number:02d}" / f"page-{page:05d}.parquet"


def _write_text(path: Path, text: str) -> None:
    partial = partial_path(path)
    try:
        partial.write_text(text)
        os.replace(partial, path)  # whole or absent
    finally:
        partial.unlink(missing_ok=True)


def _write_page(table: Any, path: Path) -> dict[str, Any]:
    """Write one page whole or not at all; its digest and counts, for the commit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        pq.write_table(table, partial)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        sha256, size = sha256_file(partial)
        row_groups = pq.read_metadata(partial).num_row_groups
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return {"bytes": size, "sha256": sha256, "rows": table.num_rows, "row_groups": row_groups}


def _refused(work: Path) -> str | None:
    try:
        return (work / _REFUSED).read_text()
    except OSError:
        return None


def count_task(
    query: SkyServerQuery, objid_range: bool, work: str, progress: Progress
) -> dict[str, Any]:
    """Count the rows the pages will fetch (with ``objid_range``, their least and greatest
    objid too), unless an interrupted run of the job already did: the ranges cut from its
    answer must stay those its pages were fetched in.

    A refusal (a SourceError) is returned as ``{"refused": message}``, for the driver to raise.
    """
    # The first task of every run: a refusal of an earlier run stops none of this one's pages.
    (Path(work) / _REFUSED).unlink(missing_ok=True)
    try:
        return _count_rows(query, objid_range, Path(work), progress)
    except SourceError as exc:
        return {"refused": str(exc)}


def _count_rows(
    query: SkyServerQuery, objid_range: bool, work: Path, progress: Progress
) -> dict[str, Any]:
    record = work / "count.json"
    try:
        kept: dict[str, Any] = json.loads(record.read_text())
    except (OSError, ValueError):
        pass
    else:
        progress(f"SkyServer count kept from an interrupted run: {int(kept['count']):,} rows")
        return {**kept, "reused": True}
    server = query.server(progress)
    try:
        sql = build_count_sql(query.where, objid_range=objid_range)
        answer = server.fetch(sql, rows=1, what="for a count")
    finally:
        server.close()
    reply = parse_reply(answer.text, where=server.url)
    reported = _count(reply, server.url, columns=3 if objid_range else 1)
    if reported == 0:
        raise SourceError(f"{server.url}: SkyServer counts no rows for {sql!r}")
    result: dict[str, Any] = {
        "count": reported,
        "source": server.source(sql, answer, 1),
        "objids": None,
    }
    if objid_range:
        typed = typed_columns(
            reply, {"min_objid": UINT64, "max_objid": UINT64}, where=f"{server.url} (count)"
        )
        low, high = int(typed["min_objid"][0]), int(typed["max_objid"][0])
        if low > high:
            raise SourceError(f"{server.url}: least objid {low} exceeds greatest {high}")
        result["objids"] = [low, high]
    _write_text(record, json.dumps(result, sort_keys=True))
    progress(f"SkyServer counts {reported:,} rows")
    return result


def _ask(part: PageRange, page_size: int, fetched: int) -> int:
    return page_size if part.target is None else min(page_size, part.target - fetched)


def _check_keys(
    keys: list[tuple[int, int]], after: tuple[int, int] | None, objids: ObjidRange, where: str
) -> None:
    low, high = objids
    previous = after
    for key in keys:
        if previous is not None and not key > previous:
            raise SourceError(
                f"{where}: rows not in (objid, specobjid) order after {previous}; "
                "the server ignored 'order by'"
            )
        if (low is not None and key[0] < low) or (high is not None and key[0] > high):
            raise SourceError(
                f"{where}: objid {key[0]} is outside the range asked for "
                f"({low if low is not None else 0}..{high if high is not None else UINT64_MAX})"
            )
        previous = key


def page_task(
    query: SkyServerQuery, page_size: int, part: PageRange, work: str, progress: Progress
) -> dict[str, Any]:
    """Page through ``part`` by (objid, specobjid) keyset, one query at a time, each page
    written whole into the job's folder with its source record beside it (after it).

    Continues after the last page an interrupted run of the job finished whole (asked for as
    this run would ask): those pages are not asked for again. Returns the rows and pages of
    the range and the reply that ended it (an empty page, or the final probe); the commit
    reads the pages' records.

    A refusal (a SourceError) is returned as ``{"refused": message}``, for the commit to
    raise, and left in the job's folder: the other ranges stop before their next query.
    """
    root = Path(work)
    try:
        return _page_range(query, page_size, part, root, progress)
    except SourceError as exc:
        _write_text(root / _REFUSED, str(exc))
        return {"number": part.number, "refused": str(exc)}


def _page_range(
    query: SkyServerQuery, page_size: int, part: PageRange, root: Path, progress: Progress
) -> dict[str, Any]:
    label = "" if part.of == 1 else f"range {part.number}/{part.of}, "
    fetched = pages = 0
    after: tuple[int, int] | None = None
    while part.target is None or fetched < part.target:
        path = _page_path(root, part.number, pages + 1)
        record = recorded_result(path)
        sql = build_page_sql(_ask(part, page_size, fetched), after, query.where, part.objids)
        if record is None or record["source"]["query"] != sql:
            break
        pages += 1
        fetched += int(record["output"]["rows"])
        objid, specobjid = record["last_key"]
        after = (int(objid), int(specobjid))
    kept = pages
    if after is not None:
        progress(
            f"{label}kept {kept} pages ({fetched:,} rows) from an interrupted run; "
            f"continuing after objid {after[0]}"
        )
    elif part.target is not None:
        progress(f"fetching {part.target:,} rows in pages of {page_size:,}")
    of = "" if part.target is None else f" / {part.target:,}"
    end: dict[str, Any] | None = None
    extra_rows = 0
    server = query.server(progress)
    try:
        while part.target is None or fetched < part.target:
            refusal = _refused(root)
            if refusal is not None:
                return {"number": part.number, "refused": refusal}
            ask = _ask(part, page_size, fetched)
            sql = build_page_sql(ask, after, query.where, part.objids)
            answer = server.fetch(sql, rows=ask, what=f"for a page of {ask:,} rows")
            where = f"{server.url} ({label}page {pages + 1})"
            columns = typed_columns(parse_reply(answer.text, where=where), SCHEMA, where=where)
            n = len(columns["objid"])
            if n == 0:
                end = server.source(sql, answer, 0)
                break
            if n > ask:
                raise SourceError(f"{where}: asked for {ask:,} rows, got {n:,}")
            keys = _keys(columns)
            _check_keys(keys, after, part.objids, where)
            pages += 1
            path = _page_path(root, part.number, pages)
            output = _write_page(_arrow_table(columns), path)
            source = server.source(sql, answer, n)
            record_result(path, {"output": output, "source": source, "last_key": list(keys[-1])})
            crash_point("after-file", path)
            fetched += n
            after = keys[-1]
            if n < ask and (part.target is None or fetched < part.target):
                progress(f"{label}reply capped at {n:,} rows; continuing after objid {after[0]}")
            progress(f"{label}page {pages}: {n:,} rows ({fetched:,}{of})")
        if part.probe and fetched == part.target:
            sql = build_page_sql(1, after, query.where, part.objids)
            answer = server.fetch(sql, rows=1, what="for the final probe")
            extra = parse_reply(answer.text, where=f"{server.url} (final probe)")
            extra_rows = len(extra.rows)
            end = server.source(sql, answer, extra_rows)
    finally:
        server.close()
    return {
        "number": part.number,
        "rows": fetched,
        "pages": pages,
        "kept_pages": kept,
        "reused": kept == pages > 0,
        "end": end,
        "extra_rows": extra_rows,
    }


@dataclass(frozen=True, kw_only=True)
class SkyServerJob:
    """The SkyServer query into a new raw "sdss" version (a :class:`preprocessing.driver.Job`).

    Passes: "count" (one task), then "pages" (one task per objid range); the commit checks the
    rows fetched against the rows counted. The job's folder::

        count.json                          the count's answer and source record
        range-01/page-00001.parquet         one page, written whole
        range-01/page-00001.parquet.result.json
                                            its digest, source record and last key (after it)
        refused.txt                         a task's refusal: the other ranges stop

    A rerun of the same job (same ``work_key``) keeps the count and, in each range, every
    page up to the first one missing, cut short or asked for differently.
    """

    query: SkyServerQuery
    limit: int | None
    page_size: int
    concurrency: int
    progress: Progress | None = field(default=None, compare=False, repr=False)
    """Where tasks report (pages, a rerun's kept pages, capped replies, retries with their
    waits); None: this module's log. A function of this process, for tasks that run in it
    (``serial_runner``); it is pickled with the tasks sent to Dask workers."""
    name: str = "sdss"
    kind: str = "raw"
    passes: tuple[str, ...] = ("count", "pages")
    version: None = None
    """Known at the commit: the version derives from the replies' digests and fetch times."""

    @property
    def ranges(self) -> int:
        """Ranges paged at once. With a limit, one: the first ``limit`` rows in key order are
        known only by paging them in order."""
        return 1 if self.limit is not None else self.concurrency

    @property
    def work_key(self) -> str:
        identity = [
            stage_code(__name__),
            _WORK_LAYOUT,
            self.query.skyserver_url,
            self.query.data_release,
            self.query.bounds,
            self.limit,
            self.page_size,
            self.ranges,
        ]
        return f"{self.name}-skyserver-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}"

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        # On a Dask worker, task_progress carries the lines back to the command.
        progress = self.progress or task_progress.report
        if pass_name == "count":
            return [
                TaskSpec(
                    key="count",
                    fn=count_task,
                    args=(self.query, self.ranges > 1, str(work), progress),
                )
            ]
        counted = done["count"][0]
        if "refused" in counted:
            raise SourceError(counted["refused"])
        reported = int(counted["count"])
        if self.ranges == 1:
            target = reported if self.limit is None else min(reported, self.limit)
            parts = [
                PageRange(
                    number=1,
                    of=1,
                    objids=(None, None),
                    target=target,
                    probe=self.limit is None or self.limit > reported,
                )
            ]
        else:
            low, high = (int(x) for x in counted["objids"])
            cuts = objid_ranges(low, high, self.ranges)
            parts = [
                PageRange(number=n, of=len(cuts), objids=objids, target=None, probe=False)
                for n, objids in enumerate(cuts, start=1)
            ]
        return [
            TaskSpec(
                key=f"pages-{part.number:02d}",
                fn=page_task,
                args=(self.query, self.page_size, part, str(work), progress),
                rows=part.target or 0,
            )
            for part in parts
        ]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        for result in done["pages"]:
            if "refused" in result:
                # The pages fetched stay in the job's folder for a rerun.
                raise SourceError(result["refused"])
        counted = done["count"][0]
        reported = int(counted["count"])
        target = reported if self.limit is None else min(reported, self.limit)
        url = str(counted["source"]["uri"])
        fetched = sum(int(result["rows"]) for result in done["pages"])
        holds_more = fetched > target or any(r["extra_rows"] for r in done["pages"])
        if fetched < target or holds_more:
            # The count and the pages no longer fit together: a rerun must ask again, not keep
            # them, or it would refuse the same way forever.
            shutil.rmtree(work, ignore_errors=True)
        if fetched < target:
            raise SourceError(
                f"{url}: SkyServer counted {reported:,} rows"
                + (f" (limit {self.limit:,})" if self.limit is not None else "")
                + f" but paging returned {fetched:,}; the table changed or replies were cut "
                "short, retry later"
            )
        if holds_more:
            raise SourceError(
                f"{url}: SkyServer counted {reported:,} rows but holds more; "
                "the table changed while paging, retry later"
            )
        sources: list[dict[str, Any]] = [counted["source"]]
        described: dict[str, FileEntry] = {}
        for result in done["pages"]:
            for page in range(1, int(result["pages"]) + 1):
                path = _page_path(work, int(result["number"]), page)
                record = recorded_result(path)
                if record is None:
                    raise SourceError(f"{path}: page missing or cut short; run the ingest again")
                # Named in key order across ranges, as one range names them.
                name = f"page-{len(described) + 1:05d}.parquet"
                stage.adopt(path, name)
                out = record["output"]
                described[name] = FileEntry(
                    path=name,
                    bytes=int(out["bytes"]),
                    sha256=str(out["sha256"]),
                    rows=int(out["rows"]),
                    row_groups=int(out["row_groups"]),
                )
                sources.append({**record["source"], "file": name})
            if result["end"] is not None:
                sources.append(result["end"])
        manifest: Manifest = stage.commit(
            code_version=stage_code(__name__),
            sources=sources,
            parameters={
                "skyserver_url": self.query.skyserver_url,
                "data_release": self.query.data_release,
                "limit": self.limit,
                "page_size": self.page_size,
                "bounds": {k: list(v) for k, v in self.query.bounds},
            },
            **SkyServerLayout(
                columns=dict(SCHEMA),
                rows=fetched,
                num_pages=len(described),
                count_reported=reported,
            ).to_manifest(),
            rows=fetched,
            described=described,
        )
        return manifest


def plan_skyserver_ingest(
    *,
    skyserver_url: str = DEFAULT_SKYSERVER_URL,
    data_release: int = DEFAULT_DATA_RELEASE,
    limit: int | None = None,
    concurrency: int = 1,
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS,
    page_size: int | None = None,
    timeout: float = 120.0,
) -> SkyServerJob:
    """The ingest of the SkyServer query (asks nothing yet; refuses bad arguments).

    At most ``concurrency`` queries in flight: with more than one, the objids the count finds
    are cut into that many ranges, each paged by its own task; with a ``limit``, one range.
    """
    # Short replies are expected (the server's cap may be below the page size): pages are
    # asked for by size and a reply shorter than asked just means "continue after its last key".
    page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
    if limit is not None and limit < 1:
        raise SourceError(f"limit {limit!r} must be a positive number of rows")
    if not 1 <= page_size <= 10_000_000:
        raise SourceError(f"page size {page_size!r} out of range 1..10,000,000")
    if data_release < 1:
        raise SourceError(f"data release {data_release!r} must be a positive number")
    if concurrency < 1:
        raise SourceError(f"concurrency {concurrency!r} must be at least 1 query in flight")
    if not timeout > 0:
        raise SourceError(f"timeout {timeout!r} must be a positive number of seconds")
    query_url(skyserver_url, data_release)  # refuses a URL that is not http(s)
    _where(bounds)  # refuses unknown columns and non-numbers
    return SkyServerJob(
        query=SkyServerQuery(
            skyserver_url=skyserver_url.rstrip("/"),
            data_release=int(data_release),
            bounds=tuple(sorted((k, (float(lo), float(hi))) for k, (lo, hi) in bounds.items())),
            timeout=float(timeout),
        ),
        limit=limit,
        page_size=page_size,
        concurrency=concurrency,
    )


def ingest_skyserver(
    catalog: Catalog,
    *,
    skyserver_url: str = DEFAULT_SKYSERVER_URL,
    data_release: int = DEFAULT_DATA_RELEASE,
    limit: int | None = None,
    page_size: int | None = None,
    bounds: Mapping[str, tuple[float, float]] = DEFAULT_BOUNDS,
    timeout: float = 120.0,
    concurrency: int = 1,
    work_root: Path | None = None,
    progress: Progress = lambda _msg: None,
) -> Manifest:
    """Query SkyServer for the photometry + class table into a new raw version "sdss", every
    task in this process (see :func:`plan_skyserver_ingest`).

    Counts first, then pages by (objid, specobjid); refuses (and commits nothing) when the rows
    fetched differ from the rows counted, or when any reply is empty, an error page or longer
    than its rows can fill. With ``work_root``, a rerun after a crash keeps the pages fetched.
    """
    job = plan_skyserver_ingest(
        skyserver_url=skyserver_url,
        data_release=data_release,
        limit=limit,
        concurrency=concurrency,
        bounds=bounds,
        page_size=page_size,
        timeout=timeout,
    )
    return run_job(
        catalog,
        replace(job, progress=progress),
        runner=serial_runner,
        work_root=work_root,
        progress=progress,
    )


# Columns an export may carry besides SCHEMA: synth.py marks its rows synthetic.
OPTIONAL: dict[str, str] = {"provenance": STRING}
