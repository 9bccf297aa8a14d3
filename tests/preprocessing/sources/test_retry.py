"""The sources' one retry policy: SkyServer's 429 with Retry-After is obeyed (the next request
comes at least that late, measured at the stand-in), a fetch's 503 with Retry-After too while
the Range resume still works, jitter spreads the waits, and a server asking too long is
given up on at once."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from data_catalog import Catalog
from preprocessing.sources import sdss
from preprocessing.sources.fetch import fetch
from preprocessing.sources.retry import RetryPolicy, Transient, retry_after_seconds
from tests.preprocessing.sources.skyserver_standin import StandIn, serve, synthetic_rows


def test_skyserver_answering_429_with_retry_after_2_is_asked_again_2_s_later(
    tmp_path: Path,
) -> None:
    messages: list[str] = []
    with serve(StandIn(synthetic_rows(300), busy_replies=1, retry_after="2")) as server:
        manifest = sdss.ingest_skyserver(
            Catalog(tmp_path / "catalog"), skyserver_url=server.url, progress=messages.append
        )
    assert manifest.rows == 300
    first, second = server.asked_at[:2]
    assert second - first >= 2.0
    (retry,) = [m for m in messages if "retrying in" in m]
    assert "HTTP 429: Too Many Requests: slow down (attempt 1/3); retrying in" in retry


def test_a_server_asking_for_longer_than_the_policy_waits_is_given_up_on(tmp_path: Path) -> None:
    standin = StandIn(synthetic_rows(10), busy_replies=1, retry_after="3600")
    started = time.monotonic()
    with serve(standin) as server, pytest.raises(sdss.SourceError) as info:
        sdss.ingest_skyserver(Catalog(tmp_path / "catalog"), skyserver_url=server.url)
    assert time.monotonic() - started < 30
    assert "retry after 3600 s" in str(info.value) and "\n" not in str(info.value)
    assert len(standin.queries) == 1


class _Busy(http.server.SimpleHTTPRequestHandler):
    """Cuts the first answer short, then answers 503 with Retry-After once, then serves
    (Range included: SimpleHTTPRequestHandler has none, so ranges are served here)."""

    state: dict[str, list[float] | int]

    def do_GET(self) -> None:
        asked = self.state["asked_at"]
        assert isinstance(asked, list)
        asked.append(time.monotonic())
        data = (Path(self.directory) / "blob.bin").read_bytes()
        start = int(self.headers.get("Range", "bytes=0-")[6:].rstrip("-") or 0)
        if len(asked) == 2:
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        self.wfile.write(body[: len(body) // 2] if len(asked) == 1 else body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def busy_server(tmp_path: Path) -> Iterator[tuple[str, list[float], bytes]]:
    data = bytes(range(256)) * 4096
    (tmp_path / "blob.bin").write_bytes(data)
    asked: list[float] = []
    handler = type("Handler", (_Busy,), {"state": {"asked_at": asked}})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/blob.bin", asked, data
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_obeys_retry_after_and_still_resumes_by_range(
    busy_server: tuple[str, list[float], bytes], tmp_path: Path
) -> None:
    url, asked, data = busy_server
    messages: list[str] = []
    fetched = fetch(url, tmp_path / "out.bin", backoff=0.01, progress=messages.append)
    assert (tmp_path / "out.bin").read_bytes() == data and fetched.size == len(data)
    assert len(asked) == 3
    assert asked[2] - asked[1] >= 1.0  # the 503's Retry-After: 1, not the 0.01 s backoff
    retries = [m for m in messages if "retrying in" in m]
    assert len(retries) == 2 and retries[1].endswith(f"resuming at byte {len(data) // 2:,}")


def test_waits_double_with_jitter_and_stop_after_the_attempts() -> None:
    waits: list[float] = []
    policy = RetryPolicy(attempts=4, backoff=2.0, jitter=1.0)

    def always_busy(_n: int) -> None:
        raise Transient("busy")

    with pytest.raises(Transient, match="busy"):
        policy.call(always_busy, on_retry=lambda _n, _f, _w: None, sleep=waits.append)
    assert len(waits) == 3
    assert [int(w) for w in waits] == [2, 4, 8]
    assert all(0 <= w - base < 1.0 for w, base in zip(waits, (2, 4, 8), strict=True))
    again: list[float] = []
    with pytest.raises(Transient):
        policy.call(always_busy, on_retry=lambda _n, _f, _w: None, sleep=again.append)
    assert again != waits  # jittered: two clients that failed together come back apart


def test_retry_after_forms() -> None:
    now = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    assert retry_after_seconds("2") == 2.0
    assert (
        retry_after_seconds(format_datetime(now + timedelta(seconds=30), usegmt=True), now=now)
        == 30.0
    )
    assert (
        retry_after_seconds(format_datetime(now - timedelta(seconds=30), usegmt=True), now=now)
        == 0.0
    )
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
