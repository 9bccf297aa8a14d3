"""The CIFAR-10 ingest as a driver job: what it plans, the same version on a Dask LocalCluster
as in one process, a rerun after a crash keeping what was finished, digests as hashlib's."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog, Manifest
from preprocessing.cluster import dask_runner
from preprocessing.config import ClusterConfig
from preprocessing.driver import (
    PassProgress,
    Result,
    TaskSpec,
    job_dir,
    run_job,
    serial_runner,
)
from preprocessing.sources import cifar10
from preprocessing.sources.errors import SourceError
from tests.preprocessing.sources.test_cifar10 import tar_of, write_binary, write_python


class Served:
    """A folder served over HTTP on 127.0.0.1, counting the GET requests (whole transfers)."""

    def __init__(self, folder: Path) -> None:
        self.gets = 0
        served = self

        class Counting(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                served.gets += 1
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Counting, directory=folder)
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"


@dataclass(frozen=True)
class Source:
    url: str
    """What the ingest is given."""
    folder: Path
    """The batch files it holds."""
    archive: Path | None = None
    served: Served | None = None


@pytest.fixture
def source(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Source]:
    """Python batches in a directory, binary batches in a local .tar.gz, or that archive's
    URL."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 10, 20, dtype=np.uint8)
    images = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    if request.param == "directory":
        folder = write_python(tmp_path / "in" / "cifar-10-batches-py", labels, images)
        yield Source(url=str(folder.parent), folder=folder)
        return
    folder = write_binary(tmp_path / "in" / "cifar-10-batches-bin", labels, images)
    (tmp_path / "www").mkdir()
    archive = tar_of(folder, tmp_path / "www" / "cifar-10-binary.tar.gz")
    if request.param == "archive":
        yield Source(url=str(archive), folder=folder, archive=archive)
        return
    served = Served(tmp_path / "www")
    try:
        yield Source(url=served.url(archive.name), folder=folder, archive=archive, served=served)
    finally:
        served.server.shutdown()
        served.server.server_close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_digests_are_hashlibs(catalog: Catalog, manifest: Manifest, source: Source) -> None:
    """Every digest the tasks computed while reading equals hashlib's of the whole file."""
    folder = source.folder
    assert sorted(e.path for e in manifest.files) == sorted(p.name for p in folder.iterdir())
    for entry in manifest.files:
        assert entry.sha256 == _sha256(catalog.file_path(manifest, entry))
        assert entry.sha256 == _sha256(folder / entry.path)
        assert entry.bytes == (folder / entry.path).stat().st_size
    for recorded in manifest.sources:
        assert recorded["sha256"] == _sha256(folder / recorded["file"])
    if source.archive is not None:
        assert {s["archive_sha256"] for s in manifest.sources} == {_sha256(source.archive)}
    else:
        assert not any("archive_sha256" in s for s in manifest.sources)
    assert catalog.verify() == []


# ---------------------------------------------------------------------------------------------
# The plan


def test_the_plan_reads_no_data(tmp_path: Path) -> None:
    folder = write_binary(
        tmp_path / "cifar-10-batches-bin",
        np.zeros(20, dtype=np.uint8),
        np.zeros((20, 32, 32, 3), dtype=np.uint8),
    )
    job = cifar10.plan_ingest(str(tmp_path))
    assert job.passes == ("copy",)
    assert job.fmt == "binary"
    tasks = job.tasks("copy", {}, tmp_path / "work")
    assert sorted(t.key for t in tasks) == sorted(f"copy-{p.name}" for p in folder.iterdir())
    assert sum(t.bytes for t in tasks) == sum(p.stat().st_size for p in folder.iterdir())

    # An archive that is not one, a URL where nothing listens: planned, not opened.
    (tmp_path / "x.tar.gz").write_bytes(b"not gzip")
    broken = cifar10.plan_ingest(str(tmp_path / "x.tar.gz"))
    assert broken.passes == ("extract", "check")
    assert cifar10.plan_ingest("http://127.0.0.1:9/cifar.tar.gz").passes == ("extract", "check")
    with pytest.raises(SourceError, match="unreadable archive"):
        run_job(Catalog(tmp_path / "catalog"), broken, runner=serial_runner)
    with pytest.raises(SourceError, match="no such file or directory"):
        cifar10.plan_ingest(str(tmp_path / "nope"))


# ---------------------------------------------------------------------------------------------
# On a Dask LocalCluster


@pytest.mark.parametrize("source", ["directory", "url"], indirect=True)
def test_a_local_cluster_commits_what_one_process_commits(source: Source, tmp_path: Path) -> None:
    url = source.url
    serial_catalog = Catalog(tmp_path / "serial")
    serial = run_job(
        serial_catalog, cifar10.plan_ingest(url), runner=serial_runner, work_root=tmp_path / "w1"
    )
    catalog = Catalog(tmp_path / "cluster")
    job = cifar10.plan_ingest(url, cache=tmp_path / "downloads")
    seen: list[PassProgress] = []
    manifest = run_job(
        catalog,
        job,
        runner=lambda: dask_runner(ClusterConfig(workers=2)),
        work_root=tmp_path / "w2",
        on_progress=seen.append,
    )
    assert manifest.content_digest() == serial.content_digest()
    assert manifest.rows == 20
    assert [(p.pass_name, p.tasks_total) for p in seen if p.tasks_done == p.tasks_total] == (
        [("copy", 7)] if job.archive is None else [("extract", 1), ("check", 7)]
    )
    assert not job_dir(tmp_path / "w2", job).exists()  # committed: the work folder is gone
    assert not list((tmp_path / "downloads").glob("*"))  # and the URL forgotten
    _assert_digests_are_hashlibs(catalog, manifest, source)
    _assert_digests_are_hashlibs(serial_catalog, serial, source)


@pytest.mark.parametrize("source", ["directory"], indirect=True)
def test_a_worker_killed_after_its_file_loses_nothing(source: Source, tmp_path: Path) -> None:
    url = source.url
    serial = run_job(Catalog(tmp_path / "serial"), cifar10.plan_ingest(url), runner=serial_runner)
    seen: list[PassProgress] = []
    # The worker that finishes the job's 2nd file dies by SIGKILL right after; the scheduler
    # runs its task again elsewhere, which finds the file whole.
    crash = {"SHARDFLOW_CRASH_AT": "after-file:2"}
    manifest = run_job(
        Catalog(tmp_path / "cluster"),
        cifar10.plan_ingest(url),
        runner=lambda: dask_runner(ClusterConfig(workers=2), env=crash),
        work_root=tmp_path / "work",
        on_progress=seen.append,
    )
    # The killed task, and any result the dead worker held but had not handed over yet.
    assert 1 <= seen[-1].reused <= 2
    assert seen[-1].tasks_done == 7
    assert manifest.content_digest() == serial.content_digest()


# ---------------------------------------------------------------------------------------------
# A rerun after a crash


class Crashed(Exception):
    pass


class CrashAfter:
    """Runs tasks in this process and raises after ``count`` of them (across passes)."""

    def __init__(self, count: int) -> None:
        self.left = count

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        results = []
        for index, spec in enumerate(tasks):
            if self.left == 0:
                raise Crashed
            self.left -= 1
            results.append(spec.fn(*spec.args))
            on_done(index, results[-1])
        return results


@pytest.mark.parametrize("source", ["directory", "archive", "url"], indirect=True)
def test_a_rerun_keeps_what_the_crashed_run_finished(source: Source, tmp_path: Path) -> None:
    url = source.url
    clean = run_job(Catalog(tmp_path / "clean"), cifar10.plan_ingest(url), runner=serial_runner)
    catalog, work, cache = Catalog(tmp_path / "catalog"), tmp_path / "work", tmp_path / "cache"
    job = cifar10.plan_ingest(url, cache=cache)
    # A directory: 3 of 7 files copied. An archive: extracted, 2 of its 7 files (6 batches and
    # the meta file) checked.
    with pytest.raises(Crashed):
        run_job(catalog, job, runner=lambda: nullcontext(CrashAfter(3)), work_root=work)
    assert catalog.names() == []
    assert not list(job_dir(work, job).rglob("*.partial"))
    gets = source.served.gets if source.served else 0

    results: list[Any] = []
    manifest = run_job(
        catalog,
        cifar10.plan_ingest(url, cache=cache),  # planned again, as a rerun does
        runner=serial_runner,
        work_root=work,
        on_progress=lambda p: results.append((p.pass_name, p.result)),
    )
    reused = [name for name, result in results if result.get("reused")]
    if job.archive is None:
        assert reused == ["copy"] * 3
    else:
        assert reused == ["extract", "check", "check"]
    # The rest done now, once each (an archive's extraction and 7 checks, a folder's 7 copies).
    assert len(results) - len(reused) == (4 if job.archive is None else 5)
    if source.served:
        assert source.served.gets == gets  # the archive is not fetched again
    assert manifest.version == clean.version
    assert manifest.content_digest() == clean.content_digest()
    assert not job_dir(work, job).exists()
    assert not list(cache.glob("*"))
    _assert_digests_are_hashlibs(catalog, manifest, source)
