"""SDSS ingest on the cluster, as a user runs it: killed and rerun (it converts only what is
left and commits what a clean run commits), a worker killed mid-run, and the same exports read
from S3 (moto's server on loopback) and over HTTP."""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from data_catalog import Catalog, Manifest
from preprocessing.sources.synth import write_sdss_exports
from tests.conftest import Result, serving
from tests.data_catalog.test_s3 import CREDENTIALS, bucket, endpoint  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

FILES, ROWS = 8, 80_000
SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports")
    write_sdss_exports(out, rows=ROWS, files=FILES, fmt="csv", seed=11)
    return out


@pytest.fixture(scope="module")
def clean(exports: Path, tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    """The raw version an uninterrupted ingest of the exports commits."""
    home = tmp_path_factory.mktemp("clean-home")
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "shardflow"),
            "ingest",
            "sdss",
            "--source",
            str(exports),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "SHARDFLOW_HOME": str(home)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return Catalog(home / "catalog").get("sdss")


def _descendants_gone(pid_tree: list[psutil.Process], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in pid_tree):
            return True
        time.sleep(0.5)
    return False


def test_a_killed_ingest_reruns_only_what_is_left(
    shardflow: Callable[..., Result], shardflow_home: Path, exports: Path, clean: Manifest
) -> None:
    command = subprocess.Popen(
        [
            SHARDFLOW,
            *("ingest", "sdss", "--source", str(exports), "--workers", "1"),
        ],
        env={**os.environ, "SHARDFLOW_HOME": str(shardflow_home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    work = shardflow_home / "work"
    deadline = time.monotonic() + 300
    finished: list[Path] = []
    while len(finished) < 3 and time.monotonic() < deadline and command.poll() is None:
        time.sleep(0.05)
        finished = list(work.glob("sdss-exports-*/*.result.json"))
    assert command.poll() is None, "the ingest ended before it could be killed"
    tree = psutil.Process(command.pid).children(recursive=True)
    command.send_signal(signal.SIGKILL)
    command.wait()
    assert _descendants_gone(tree), "Dask processes outlived the killed ingest"
    done_before = len(list(work.glob("sdss-exports-*/*.result.json")))
    assert 3 <= done_before < FILES
    assert Catalog(shardflow_home / "catalog").names() == []

    rerun = shardflow("ingest", "sdss", "--source", str(exports), "--json")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert rerun.json["tasks"]["convert"] == {"tasks": FILES, "reused": done_before}
    resumed = Catalog(shardflow_home / "catalog").get("sdss")
    assert resumed.version == clean.version
    assert resumed.content_digest() == clean.content_digest()
    assert not list(work.glob("sdss-exports-*"))  # the job's folder goes with the commit


def test_a_worker_killed_mid_ingest_changes_nothing(
    shardflow_home: Path, exports: Path, clean: Manifest
) -> None:
    # The worker converting the job's 3rd file dies by SIGKILL right after writing it; the
    # nanny starts another and the scheduler reruns the lost task, which finds the file whole.
    # (--in-process-below 0: a cluster even for these small files, which would otherwise be
    # converted in the command's own process.)
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "shardflow"),
            "ingest",
            "sdss",
            "--source",
            str(exports),
            "--in-process-below",
            "0",
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "SHARDFLOW_HOME": str(shardflow_home),
            "SHARDFLOW_CRASH_AT": "after-file:3",
        },
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    crashed = Catalog(shardflow_home / "catalog").get("sdss")
    assert crashed.content_digest() == clean.content_digest()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_exports(exports: Path) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(exports))
    )
    with serving(server) as url:
        yield url + "/"


def _data(manifest: Manifest) -> tuple[object, ...]:
    """What the version holds, whatever the source's address: the files and the input digests."""
    return (
        [(f.path, f.sha256, f.rows, f.row_groups) for f in manifest.files],
        [(s["file"], s["sha256"], s["bytes"], s["rows"]) for s in manifest.sources],
        manifest.rows,
    )


def test_s3_and_http_sources_give_the_same_data(
    shardflow: Callable[..., Result],
    shardflow_home: Path,
    tmp_path: Path,
    exports: Path,
    clean: Manifest,
    http_exports: str,
    endpoint: str,  # noqa: F811
    bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import boto3

    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(exports.glob("*.csv")):
        s3.upload_file(str(path), bucket, f"exports/{path.name}")

    from_s3 = shardflow("ingest", "sdss", "--source", f"s3://{bucket}/exports/", "--json")
    assert from_s3.returncode == 0, from_s3.stderr[-2000:]
    s3_version = Catalog(shardflow_home / "catalog").get("sdss", from_s3.json["version"])
    assert _data(s3_version) == _data(clean)
    assert s3_version.sources[0]["uri"].startswith(f"s3://{bucket}/exports/")

    over_http = shardflow(
        "ingest", "sdss", "--source", http_exports, "--json", home=tmp_path / "http-home"
    )
    assert over_http.returncode == 0, over_http.stderr[-2000:]
    http_version = Catalog(tmp_path / "http-home" / "catalog").get("sdss")
    assert _data(http_version) == _data(clean)
    assert http_version.sources[0]["uri"].startswith(http_exports)
