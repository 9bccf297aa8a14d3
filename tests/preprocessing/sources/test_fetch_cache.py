"""fetch() through a download cache: reuse, change, forget, failures, concurrent processes."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from preprocessing.sources.fetch import DownloadError, fetch, forget

PAYLOAD = random.Random(11).randbytes(1024 * 1024 + 17)
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


@dataclass
class Source:
    """What the stand-in serves at /data.bin, and what it saw."""

    body: bytes = PAYLOAD
    etag: str = '"v1"'
    # One behaviour per GET ("500", "drop"), then "ok" forever.
    plan: list[str] = field(default_factory=list)
    # Answers HEAD with 405 and GET without a length: fsspec learns nothing of the state.
    stateless: bool = False
    # Every GET waits here before sending its body, so that they overlap.
    gate: threading.Barrier | None = None
    # Seconds between the 16 pieces of each body.
    pace: float = 0.0
    gets: Counter[str] = field(default_factory=Counter)


def _handler(source: Source) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _headers(self, length: bool) -> None:
            self.send_response(200)
            if not source.stateless:
                self.send_header("ETag", source.etag)
            if length:
                self.send_header("Content-Length", str(len(source.body)))
            self.end_headers()

        def do_HEAD(self) -> None:
            if self.path != "/data.bin":
                self.send_error(404, "Not Found")
            elif source.stateless:
                self.send_error(405, "Method Not Allowed")
            else:
                self._headers(length=True)

        def do_GET(self) -> None:
            source.gets[self.path] += 1
            behaviour = source.plan.pop(0) if source.plan else "ok"
            if self.path != "/data.bin":
                self.send_error(404, "Not Found")
                return
            if behaviour == "500":
                self.send_error(500, "Internal Server Error")
                return
            if source.gate is not None:
                try:
                    source.gate.wait()
                except threading.BrokenBarrierError:
                    self.send_error(503, "the other fetch never came")
                    return
            self._headers(length=not source.stateless)
            body = source.body[: len(source.body) // 3] if behaviour == "drop" else source.body
            piece = len(body) // 16 + 1
            # fsspec's probe and a killed fetch hang up early.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for start in range(0, len(body), piece):
                    self.wfile.write(body[start : start + piece])
                    self.wfile.flush()
                    time.sleep(source.pace)
            self.close_connection = True

    return Handler


@pytest.fixture
def serve() -> Iterator[Callable[[Source], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(source: Source) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(source))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/data.bin"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _names(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_unchanged_source_is_reused_from_the_cache(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    source = Source()
    url = serve(source)
    cache = tmp_path / "cache"
    messages: list[str] = []
    first = fetch(url, tmp_path / "a.bin", cache=cache, progress=messages.append)
    second = fetch(url, tmp_path / "b.bin", cache=cache, progress=messages.append)
    assert first == second == (DIGEST, len(PAYLOAD))
    assert (tmp_path / "b.bin").read_bytes() == PAYLOAD
    assert source.gets["/data.bin"] == 1
    assert messages[-1] == f"reused {url} from the download cache"
    [entry, record] = _names(cache)  # no partial file among them
    assert record == entry + ".sha256"
    assert (cache / record).read_text() == DIGEST + "\n"


def test_changed_source_is_fetched_again(tmp_path: Path, serve: Callable[[Source], str]) -> None:
    source = Source()
    url = serve(source)
    cache = tmp_path / "cache"
    fetch(url, tmp_path / "a.bin", cache=cache)
    source.body, source.etag = PAYLOAD[::-1], '"v2"'
    fetched = fetch(url, tmp_path / "b.bin", cache=cache)
    assert fetched == (hashlib.sha256(PAYLOAD[::-1]).hexdigest(), len(PAYLOAD))
    assert (tmp_path / "b.bin").read_bytes() == PAYLOAD[::-1]
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD  # the first copy is not touched
    assert source.gets["/data.bin"] == 2


def test_forget_drops_every_entry_of_the_url(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    source = Source()
    url = serve(source)
    cache = tmp_path / "cache"
    fetch(url, tmp_path / "a.bin", cache=cache)
    source.etag = '"v2"'
    fetch(url, tmp_path / "b.bin", cache=cache)
    assert len(_names(cache)) == 4  # two states, each an entry and its digest
    forget(["http://elsewhere/data.bin"], cache=cache)
    assert len(_names(cache)) == 4
    forget([url], cache=cache)
    assert _names(cache) == []
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD  # placed files are kept
    fetch(url, tmp_path / "c.bin", cache=cache)
    assert source.gets["/data.bin"] == 3


def test_damaged_entry_is_fetched_again(tmp_path: Path, serve: Callable[[Source], str]) -> None:
    source = Source()
    url = serve(source)
    cache = tmp_path / "cache"
    fetch(url, tmp_path / "a.bin", cache=cache)
    [entry, _record] = _names(cache)
    damaged = tmp_path / "damaged"
    damaged.write_bytes(PAYLOAD[:-1] + b"\x00")
    os.replace(damaged, cache / entry)
    assert fetch(url, tmp_path / "b.bin", cache=cache) == (DIGEST, len(PAYLOAD))
    assert (tmp_path / "b.bin").read_bytes() == PAYLOAD
    assert source.gets["/data.bin"] == 2


def test_failed_fetch_leaves_no_partial_in_the_cache(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    source = Source(plan=["drop", "500", "500"])
    url = serve(source)
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match=re.escape(url) + ": failed 3 times, last: HTTP 500"):
        fetch(url, tmp_path / "a.bin", cache=cache, attempts=3, backoff=0.01)
    assert source.gets["/data.bin"] == 3
    assert _names(cache) == []
    assert _names(tmp_path) == ["cache"]


def test_source_that_tells_no_state_is_not_cached(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    source = Source(stateless=True)
    url = serve(source)
    cache = tmp_path / "cache"
    assert fetch(url, tmp_path / "a.bin", cache=cache) == (DIGEST, len(PAYLOAD))
    assert fetch(url, tmp_path / "b.bin", cache=cache) == (DIGEST, len(PAYLOAD))
    assert not cache.exists()
    # fsspec's probe GETs once per fetch when HEAD is refused, then the fetch itself.
    assert source.gets["/data.bin"] == 4


def test_local_file_is_cached_until_it_changes(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(PAYLOAD)
    cache = tmp_path / "cache"
    messages: list[str] = []
    fetch(src.as_uri(), tmp_path / "a.bin", cache=cache)
    assert fetch(src.as_uri(), tmp_path / "b.bin", cache=cache, progress=messages.append) == (
        DIGEST,
        len(PAYLOAD),
    )
    assert messages == [f"reused {src.as_uri()} from the download cache"]
    src.write_bytes(PAYLOAD[1:])
    assert fetch(src.as_uri(), tmp_path / "c.bin", cache=cache).size == len(PAYLOAD) - 1
    assert (tmp_path / "c.bin").read_bytes() == PAYLOAD[1:]


def test_partial_of_a_killed_fetch_is_removed_by_the_next(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    source = Source(pace=0.5)
    url = serve(source)
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_fetch_in_child, args=(url, tmp_path / "a.bin", cache, results))
    child.start()
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size for p in cache.glob("*.part")) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    child.join()
    assert len(list(cache.glob("*.part"))) == 1  # what a crash leaves
    source.pace = 0.0
    assert fetch(url, tmp_path / "b.bin", cache=cache) == (DIGEST, len(PAYLOAD))
    [entry, record] = _names(cache)
    assert record == entry + ".sha256"
    assert not (tmp_path / "a.bin").exists()


def _fetch_in_child(url: str, dest: Path, cache: Path, results: Any) -> None:
    try:
        results.put((str(dest), tuple(fetch(url, dest, cache=cache, attempts=1))))
    except Exception as exc:
        results.put((str(dest), f"{type(exc).__name__}: {exc}"))


def test_two_processes_fetch_one_url_into_one_cache(
    tmp_path: Path, serve: Callable[[Source], str]
) -> None:
    # Both GETs are held until the other arrives, then sent slowly: the transfers overlap.
    source = Source(gate=threading.Barrier(2, timeout=60), pace=0.02)
    url = serve(source)
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    dests = [tmp_path / "a.bin", tmp_path / "b.bin"]
    children = [
        context.Process(target=_fetch_in_child, args=(url, dest, cache, results)) for dest in dests
    ]
    for child in children:
        child.start()
    outcomes = dict(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(timeout=30)
    assert outcomes == {str(dest): (DIGEST, len(PAYLOAD)) for dest in dests}
    assert all(dest.read_bytes() == PAYLOAD for dest in dests)
    assert source.gets["/data.bin"] == 2
    [entry, record] = _names(cache)
    assert record == entry + ".sha256"
    assert (cache / entry).read_bytes() == PAYLOAD
