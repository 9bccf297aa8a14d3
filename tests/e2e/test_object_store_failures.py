"""An object-store catalog that cannot be used, or stops being usable mid-run (issue #29 items
7, 11, 12, 14 and 22): one `shardflow: error:` line naming the store and what to do, exit 1, no
traceback, and before any work when the store can be checked first."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Result
from tests.data_catalog.test_s3 import CREDENTIALS, bucket, endpoint  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

SHARDFLOW = Path(sys.executable).parent / "shardflow"
# No credentials anywhere botocore looks: no file, no instance metadata.
NO_CREDENTIALS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def shardflow(home: Path, *args: str, env: dict[str, str], timeout: float = 300) -> Result:
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    full.update({"SHARDFLOW_HOME": str(home), **NO_CREDENTIALS, **env})
    done = subprocess.run(
        [str(SHARDFLOW), *args], capture_output=True, text=True, env=full, timeout=timeout
    )
    return Result(done.returncode, done.stdout, done.stderr)


def one_line_error(result: Result, *needles: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("shardflow: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _s3(endpoint_url: str, bucket_name: str, **extra: str) -> dict[str, str]:
    return {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": endpoint_url,
        "SHARDFLOW_CATALOG": f"s3://{bucket_name}/catalog",
        **extra,
    }


def _job_folders(home: Path) -> list[str]:
    work = home / "work"
    if not work.exists():
        return []
    return sorted(p.name for p in work.iterdir() if p.name not in (".locks", "downloads"))


# ---------------------------------------------------------------------------------------------
# Item 11: the bucket and the credentials are checked before any work


def test_a_missing_bucket_is_named_before_any_work(
    tmp_path: Path,
    endpoint: str,  # noqa: F811
    fashion_subset: Path,
) -> None:
    env = _s3(endpoint, "no-such-bucket")
    needles = ("bucket 'no-such-bucket'", "does not exist", "create it")
    for args in (("catalog", "list"), ("catalog", "verify")):
        one_line_error(shardflow(tmp_path / "home", *args, env=env), *needles)
    ingest = ("ingest", "fashion-mnist", "--source", str(fashion_subset), "--workers", "1")
    one_line_error(shardflow(tmp_path / "home", *ingest, env=env), *needles)
    assert _job_folders(tmp_path / "home") == []  # nothing was converted first


class _Refusing(threading.Thread):
    """An S3 stand-in that answers every request 403 InvalidAccessKeyId (keys it does not know)."""

    BODY = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
        b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message>"
        b"</Error>"
    )

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import http.server

        body = self.BODY

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _refuse

            def log_message(self, *_args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def run(self) -> None:
        self.server.serve_forever()


@pytest.fixture
def refusing() -> Iterator[str]:
    server = _Refusing()
    server.start()
    try:
        yield server.url
    finally:
        server.server.shutdown()
        server.server.server_close()


def test_wrong_keys_are_named(tmp_path: Path, refusing: str, fashion_subset: Path) -> None:
    env = _s3(refusing, "bucket")
    needles = ("refuses these credentials", "AWS_ACCESS_KEY_ID")
    for args in (
        ("catalog", "list"),
        ("catalog", "verify"),
        ("ingest", "fashion-mnist", "--source", str(fashion_subset), "--workers", "1"),
    ):
        one_line_error(shardflow(tmp_path / "home", *args, env=env), *needles)
    assert _job_folders(tmp_path / "home") == []


def test_no_credentials_are_named(
    tmp_path: Path,
    endpoint: str,  # noqa: F811
    bucket: str,  # noqa: F811
) -> None:
    env = {"AWS_ENDPOINT_URL": endpoint, "SHARDFLOW_CATALOG": f"s3://{bucket}/catalog"}
    for args in (("catalog", "list"), ("ingest", "sdss", "--source", str(tmp_path))):
        one_line_error(
            shardflow(tmp_path / "home", *args, env=env), "no credentials", "AWS_ACCESS_KEY_ID"
        )


# ---------------------------------------------------------------------------------------------
# Items 7 and 14: a store that stops answering, or goes away, mid-commit


class _Proxy(threading.Thread):
    """A TCP proxy in front of the store that, once a request to store an object passes it,
    fails as ``mode`` says: "silent" forwards nothing more and answers nothing (a SIGSTOPped
    server), "gone" closes every connection and stops listening (a killed server)."""

    TRIGGER = b"/objects/"

    def __init__(self, upstream: str, mode: str) -> None:
        super().__init__(daemon=True)
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.mode = mode
        self.tripped = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]

    def run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed: "gone"
            if self.tripped.is_set():
                self.sockets.append(client)  # held open, never answered
                continue
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, inspect: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if inspect and data.startswith(b"PUT ") and self.TRIGGER in data.split(b"\r\n")[0]:
                self._trip()
            if self.tripped.is_set():
                continue  # forwarded no more
            try:
                sink.sendall(data)
            except OSError:
                return

    def _trip(self) -> None:
        if self.tripped.is_set():
            return
        self.tripped.set()
        if self.mode == "gone":
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def stop(self) -> None:
        self.mode = "gone"
        self.tripped.clear()
        self._trip()


@pytest.mark.parametrize(
    ("mode", "needle"),
    [("silent", "did not answer within"), ("gone", "cannot reach the object store at")],
)
def test_a_store_lost_mid_commit_is_one_line_and_the_rerun_resumes(
    tmp_path: Path,
    endpoint: str,  # noqa: F811
    bucket: str,  # noqa: F811
    fashion_subset: Path,
    mode: str,
    needle: str,
) -> None:
    proxy = _Proxy(endpoint, mode)
    proxy.start()
    home = tmp_path / "home"
    ingest = ("ingest", "fashion-mnist", "--source", str(fashion_subset), "--workers", "1")
    short = {"SHARDFLOW_DEADLINE_REPLY": "3", "SHARDFLOW_DEADLINE_CONNECT": "3"}
    try:
        failed = shardflow(home, *ingest, env=_s3(proxy.url, bucket, **short), timeout=240)
    finally:
        proxy.stop()
    assert proxy.tripped.is_set() or mode == "gone"
    where = f"s3://{bucket}/catalog" if mode == "silent" else proxy.url
    one_line_error(failed, needle, where, "finished work is kept")
    # The store back: the rerun converts nothing again and commits.
    again = shardflow(home, *ingest, "--json", env=_s3(endpoint, bucket))
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.json["tasks"]["fetch"] == {"tasks": 4, "reused": 4}


# ---------------------------------------------------------------------------------------------
# Items 12 and 22: catalog URLs that cannot hold a catalog, or would not outlive the command


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("ftp://127.0.0.1:1/catalog", "cannot be opened"),
        ("http://127.0.0.1:1/catalog", "read-only"),
        ("https://example.invalid/catalog", "read-only"),
        ("hdfs://127.0.0.1:1/catalog", "cannot be opened"),
        ("memory://catalog", "would vanish when the command ends"),
    ],
)
def test_catalog_urls_that_cannot_serve_are_one_line(tmp_path: Path, url: str, needle: str) -> None:
    for args in (("catalog", "list"), ("ingest", "sdss", "--source", str(tmp_path))):
        one_line_error(shardflow(tmp_path / "home", *args, env={"SHARDFLOW_CATALOG": url}), needle)


# ---------------------------------------------------------------------------------------------
# Items 14 and 23: the catalog index


def test_an_index_url_without_its_driver_is_one_line(tmp_path: Path) -> None:
    env = {"SHARDFLOW_CATALOG_URL": "mysql://user@127.0.0.1:1/shardflow"}
    one_line_error(
        shardflow(tmp_path / "home", "catalog", "reindex", env=env),
        "needs the mysql database driver",
        "SHARDFLOW_CATALOG_URL",
    )


def test_an_index_path_that_is_a_directory_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "index.sqlite"
    folder.mkdir()
    env = {"SHARDFLOW_CATALOG_URL": f"sqlite:///{folder}"}
    line = one_line_error(
        shardflow(tmp_path / "home", "catalog", "reindex", env=env), f"{folder} is a directory"
    )
    assert "run `shardflow catalog reindex`" not in line
