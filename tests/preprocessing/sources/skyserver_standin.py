"""A local stand-in for SkyServer's SQL endpoint, answering the queries sdss.py sends."""

from __future__ import annotations

import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from preprocessing.sources import sdss
from tests.conftest import serving

PATH = "/dr17/en/tools/search/x_results.aspx"
HEADER = ",".join(name for name, _t, _c, _k in sdss.COLUMNS)
BIG_SPECOBJID = 2**64 - 12345  # far above 2^63: must survive exactly

_TOP = re.compile(r"select top (\d+) ")
_AFTER = re.compile(r"p\.objid > (\d+) or \(p\.objid = (\d+) and s\.specobjid > (\d+)\)")
_LOW = re.compile(r"p\.objid >= (\d+)")
_HIGH = re.compile(r"p\.objid <= (\d+)")


def synthetic_rows(n: int, seed: int = 0) -> list[tuple[int, int, str]]:
    """(objid, specobjid, CSV line) sorted by key, with a sentinel and a huge specobjid."""
    rng = np.random.default_rng(seed)
    classes = ["STAR", "GALAXY", "QSO"]
    rows = []
    for i in range(n):
        objid = 1237645876861272064 + 17 * i
        specobjid = BIG_SPECOBJID if i == n // 2 else 299489677444933632 + 1000 * i
        mags = rng.uniform(14.0, 19.5, 5)
        petro = mags + rng.normal(0, 0.1, 5)
        rad = rng.uniform(1.0, 6.0, 5)
        if i % 97 == 0:
            rad[0] = -9999.0
        values = [
            str(objid),
            repr(float(rng.uniform(0, 360))),
            repr(float(rng.uniform(-10, 70))),
            *(repr(float(x)) for x in mags),
            *(repr(float(x)) for x in petro),
            *(repr(float(x)) for x in rad),
            str(specobjid),
            classes[i % 3],
            repr(float(rng.uniform(0, 2))),
        ]
        rows.append((objid, specobjid, ",".join(values)))
    return rows


@dataclass
class StandIn:
    rows: list[tuple[int, int, str]]
    cap: int = 10_000
    count_extra: int = 0  # counted rows the server never returns
    mode: str = "ok"  # ok | empty | error | http500 | endless (pages never end)
    fail_after_pages: int | None = None  # page queries past this many get HTTP 503
    delay: float = 0.0  # seconds before each reply
    busy_replies: int = 0  # the first requests this many get HTTP 429 with Retry-After
    retry_after: str = "2"
    asked_at: list[float] = field(default_factory=list)  # time.monotonic() of each request
    endless_bytes: int = 600_000_000  # where an "endless" reply stops, should a client read on
    queries: list[str] = field(default_factory=list)
    url: str = ""
    endless_sent: int = 0  # bytes of "endless" replies handed to the socket
    in_flight: int = 0
    max_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def page_queries(self) -> list[str]:
        return [q for q in self.queries if "count(*)" not in q]

    def answer(self, cmd: str) -> str:
        self.queries.append(cmd)
        if self.mode == "empty":
            return ""
        if self.mode == "error":
            return (
                "<html><body><h3>SQL returned the following error:</h3>"
                "<p>Invalid column name 'petroMag_q'.</p></body></html>"
            )
        if "count(*)" in cmd:
            n = len(self.rows) + self.count_extra
            if "min(p.objid)" in cmd:
                low, high = (min(r[0] for r in self.rows), max(r[0] for r in self.rows))
                return f"#Table1\nn,min_objid,max_objid\n{n},{low},{high}\n"
            return f"#Table1\nn\n{n}\n"
        top = _TOP.search(cmd)
        assert top is not None, cmd
        after = _AFTER.search(cmd)
        low, high = _LOW.search(cmd), _HIGH.search(cmd)
        chosen = [
            r
            for r in self.rows
            if (low is None or r[0] >= int(low.group(1)))
            and (high is None or r[0] <= int(high.group(1)))
        ]
        if after is not None:
            key = (int(after.group(1)), int(after.group(3)))
            chosen = [r for r in chosen if (r[0], r[1]) > key]
        chosen = chosen[: min(int(top.group(1)), self.cap)]
        return "#Table1\n" + HEADER + "\n" + "".join(r[2] + "\n" for r in chosen)

    def respond(self, cmd: str) -> tuple[int, bytes | Iterator[bytes]]:
        """(HTTP status, body: whole, or a stream of unknown length)."""
        page = "count(*)" not in cmd
        if self.busy_replies > 0:
            self.busy_replies -= 1
            self.queries.append(cmd)
            return 429, b"Too Many Requests: slow down"
        if self.mode == "endless" and page:
            self.queries.append(cmd)
            return 200, self._endless()
        if (
            page
            and self.fail_after_pages is not None
            and len(self.page_queries) >= self.fail_after_pages
        ):
            self.queries.append(cmd)
            return 503, b"Service Unavailable: the server is busy"
        status = 500 if self.mode == "http500" else 200
        return status, self.answer(cmd).encode()

    def _endless(self) -> Iterator[bytes]:
        rows = "".join(r[2] + "\n" for r in self.rows[:100]).encode()
        yield ("#Table1\n" + HEADER + "\n").encode()
        while self.endless_sent < self.endless_bytes:
            yield rows
            self.endless_sent += len(rows)


@contextmanager
def serve(standin: StandIn) -> Iterator[StandIn]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            if parsed.path != PATH:
                self.send_error(404)
                return
            query = urllib.parse.parse_qs(parsed.query)
            if query.get("format") != ["csv"] or "cmd" not in query:
                self.send_error(400)
                return
            with standin._lock:
                standin.asked_at.append(time.monotonic())
                standin.in_flight += 1
                standin.max_in_flight = max(standin.max_in_flight, standin.in_flight)
            try:
                if standin.delay:
                    time.sleep(standin.delay)
                status, body = standin.respond(query["cmd"][0])
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                if status == 429:
                    self.send_header("Retry-After", standin.retry_after)
                if isinstance(body, bytes):
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.end_headers()  # no length: the body ends when the connection closes
                try:
                    for chunk in body:
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading, as it should
            finally:
                with standin._lock:
                    standin.in_flight -= 1

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with serving(server) as standin.url:
        yield standin
