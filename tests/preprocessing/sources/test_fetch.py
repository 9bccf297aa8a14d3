"""fetch() against misbehaving HTTP servers on 127.0.0.1."""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from preprocessing.sources.errors import SourceError
from preprocessing.sources.fetch import DownloadError, fetch

PAYLOAD = np.random.default_rng(7).integers(0, 256, 3 * 1024 * 1024 + 123, np.uint8).tobytes()
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


@dataclass
class Script:
    """How the stand-in answers: a list of behaviours, one per request, then "ok" forever."""

    plan: list[str]
    ranges: bool = True
    requests: list[str | None] = field(default_factory=list)  # the Range header of each GET

    def next(self) -> str:
        return self.plan.pop(0) if self.plan else "ok"


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            script.requests.append(self.headers.get("Range"))
            behaviour = script.next()
            if self.path != "/data.bin":
                self.send_error(404, "Not Found")
                return
            if behaviour == "500":
                self.send_error(500, "Internal Server Error")
                return
            if behaviour == "stall":
                time.sleep(1.5)
            start = 0
            match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if script.ranges and match:
                start = int(match.group(1))
                self.send_response(206)
                self.send_header(
                    "Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}"
                )
            else:
                self.send_response(200)
            body = PAYLOAD[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if behaviour in ("drop", "reset"):
                self.wfile.write(body[: len(body) // 3])
                self.wfile.flush()
                self.close_connection = True
                if behaviour == "reset":  # RST instead of FIN: the client sees a reset
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.connection.close()
                else:
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def serve() -> Iterator[Callable[[Script], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(script: Script) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _fetch(url: str, dest: Path, **kwargs: object) -> tuple[tuple[str, int], list[str]]:
    messages: list[str] = []
    result = fetch(url, dest, backoff=0.01, progress=messages.append, **kwargs)  # type: ignore[arg-type]
    return result, messages


@pytest.mark.parametrize("how", ["drop", "reset"])
def test_cut_transfer_resumes_with_range(
    tmp_path: Path, serve: Callable[[Script], str], how: str
) -> None:
    script = Script(plan=[how])
    dest = tmp_path / "data.bin"
    (digest, size), messages = _fetch(serve(script) + "/data.bin", dest)
    assert (digest, size) == (DIGEST, len(PAYLOAD))
    assert dest.read_bytes() == PAYLOAD
    assert sorted(tmp_path.iterdir()) == [dest]  # no partial file left beside it
    # The second GET asked only for the rest (a reset may discard bytes still in flight).
    assert script.requests[0] is None
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", script.requests[1] or "")[1])  # type: ignore[index]
    assert 0 < resumed_at <= len(PAYLOAD) // 3
    if how == "drop":
        assert resumed_at == len(PAYLOAD) // 3
    assert len(script.requests) == 2
    assert any("resuming at byte" in m for m in messages)


def test_server_without_range_support_restarts(
    tmp_path: Path, serve: Callable[[Script], str]
) -> None:
    script = Script(plan=["drop", "drop"], ranges=False)
    dest = tmp_path / "data.bin"
    (digest, size), _ = _fetch(serve(script) + "/data.bin", dest)
    assert (digest, size) == (DIGEST, len(PAYLOAD))
    assert dest.read_bytes() == PAYLOAD
    assert len(script.requests) == 3


def test_500_twice_then_200(tmp_path: Path, serve: Callable[[Script], str]) -> None:
    script = Script(plan=["500", "500"])
    dest = tmp_path / "data.bin"
    (digest, _size), messages = _fetch(serve(script) + "/data.bin", dest)
    assert digest == DIGEST
    assert len(script.requests) == 3
    assert sum("HTTP 500" in m for m in messages) == 2


def test_too_many_500s_give_up_naming_the_url(
    tmp_path: Path, serve: Callable[[Script], str]
) -> None:
    url = serve(Script(plan=["500"] * 3)) + "/data.bin"
    dest = tmp_path / "data.bin"
    with pytest.raises(DownloadError, match=re.escape(url) + r": failed 3 times, last: HTTP 500"):
        _fetch(url, dest, attempts=3)
    assert list(tmp_path.iterdir()) == []


def test_404_is_refused_at_once_and_leaves_nothing(
    tmp_path: Path, serve: Callable[[Script], str]
) -> None:
    script = Script(plan=[])
    url = serve(script) + "/missing.bin"
    with pytest.raises(SourceError) as info:
        _fetch(url, tmp_path / "missing.bin")
    assert str(info.value) == f"{url}: HTTP 404 Not Found"
    assert "\n" not in str(info.value)
    assert len(script.requests) == 1  # a 404 is not retried
    assert list(tmp_path.iterdir()) == []


def test_timeout_is_retried(tmp_path: Path, serve: Callable[[Script], str]) -> None:
    script = Script(plan=["stall"])
    (digest, _size), messages = _fetch(serve(script) + "/data.bin", tmp_path / "d", timeout=0.5)
    assert digest == DIGEST
    assert any("timed out" in m for m in messages)


def test_connection_refused_gives_up(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x"
    with pytest.raises(DownloadError, match=re.escape(url) + ": failed 2 times"):
        _fetch(url, tmp_path / "x", attempts=2)
    assert list(tmp_path.iterdir()) == []


def test_progress_about_every_tenth(tmp_path: Path, serve: Callable[[Script], str]) -> None:
    _, messages = _fetch(serve(Script(plan=[])) + "/data.bin", tmp_path / "d")
    percents = [int(m.rsplit("(", 1)[1].rstrip("%)")) for m in messages if m.endswith("%)")]
    assert percents == sorted(percents)
    assert 9 <= len(percents) <= 11
    assert percents[-1] == 100


def test_local_files_through_fsspec(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(PAYLOAD)
    (digest, size), _ = _fetch(src.as_uri(), tmp_path / "out.bin")
    assert (digest, size) == (DIGEST, len(PAYLOAD))
    with pytest.raises(DownloadError, match="no such file"):
        _fetch((tmp_path / "nope.bin").as_uri(), tmp_path / "nope-out.bin")
    assert not (tmp_path / "nope-out.bin").exists()
