"""A local stand-in for SkyServer's SQL endpoint, answering the queries sdss.py sends."""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from preprocessing.sources import sdss

PATH = "/dr17/en/tools/search/x_results.aspx"
HEADER = ",".join(name for name, _t, _c, _k in sdss.COLUMNS)
BIG_SPECOBJID = 2**64 - 12345  # far above 2^63: must survive exactly

_TOP = re.compile(r"select top (\d+) ")
_AFTER = re.compile(r"p\.objid > (\d+) or \(p\.objid = (\d+) and s\.specobjid > (\d+)\)")


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
    mode: str = "ok"  # ok | empty | error | http500
    queries: list[str] = field(default_factory=list)
    url: str = ""

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
            return f"#Table1\nn\n{len(self.rows) + self.count_extra}\n"
        top = _TOP.search(cmd)
        assert top is not None, cmd
        after = _AFTER.search(cmd)
        chosen = self.rows
        if after is not None:
            key = (int(after.group(1)), int(after.group(3)))
            chosen = [r for r in self.rows if (r[0], r[1]) > key]
        chosen = chosen[: min(int(top.group(1)), self.cap)]
        return "#Table1\n" + HEADER + "\n" + "".join(r[2] + "\n" for r in chosen)


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
            status = 500 if standin.mode == "http500" else 200
            body = standin.answer(query["cmd"][0]).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    standin.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield standin
    finally:
        server.shutdown()
        server.server_close()
