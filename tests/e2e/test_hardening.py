"""Issue #13, items 5-9, as a hostile or unlucky user meets them: real `shardflow` processes,
two commands at once, signals, local servers that misbehave, damaged files and folders."""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from data_catalog import Catalog
from preprocessing.sources import mnist
from preprocessing.sources.fetch import _url_key
from tests.conftest import FASHION_MNIST_DIR, Result, serving, write_idx_set
from tests.preprocessing.sources.skyserver_standin import StandIn, serve, synthetic_rows

pytestmark = pytest.mark.e2e

SHARDFLOW = Path(sys.executable).parent / "shardflow"
# Peak RSS allowed to any process of an ingest refusing an endless reply; the stand-in would
# send 2 GB, which a reply read whole holds (SkyServer's real one grew to 3.9 GB in 6 s).
RSS_BOUND = 600 * 2**20


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "SHARDFLOW_HOME": str(home)}


def start(home: Path, *args: str, new_session: bool = False) -> subprocess.Popen[str]:
    """`shardflow ARGS` started, not waited for (``new_session``: in its own process group,
    as a terminal's foreground job)."""
    return subprocess.Popen(
        [str(SHARDFLOW), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(home),
        start_new_session=new_session,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> Result:
    stdout, stderr = proc.communicate(timeout=timeout)
    return Result(proc.returncode, stdout, stderr)


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_line_error(result: Result, *needles: str) -> str:
    """The one line a user error leaves on stderr, after exit 1; it contains ``needles``."""
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith("shardflow"), line
    assert "internal error" not in line and "Traceback" not in line, line
    for needle in needles:
        assert needle in line, line
    return line


def catalog_names(home: Path) -> dict[str, list[str]]:
    catalog = Catalog(str(home / "catalog"))
    return {name: [m.version for m in catalog.versions(name)] for name in catalog.names()}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def ingested_subset(home: Path, fashion_subset: Path) -> Path:
    """``home`` holding the 3,000-image Fashion-MNIST subset as a raw version (ingested in
    this process, one file after the other: the commands under test come after)."""
    home.mkdir(parents=True)
    mnist.ingest(Catalog(str(home / "catalog")), "fashion-mnist", source=str(fashion_subset))
    return home


@pytest.fixture
def http_subset(fashion_subset: Path) -> Iterator[str]:
    """The subset's four IDX files over HTTP on loopback (size and Last-Modified known, so
    that ingests go through the download cache)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=fashion_subset)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    with serving(server) as url:
        yield url + "/"


# ---------------------------------------------------------------------------------------------
# Item 5: the same work twice at once


def test_two_preprocess_of_one_dataset_at_once_make_one_version(ingested_subset: Path) -> None:
    """A schedule meeting a manual run: both exit 0 with the same version (one waits for the
    other's lock, then finds its version committed); before, one failed in a `.partial`."""
    args = ("preprocess", "fashion-mnist", "--workers", "1", "--json")
    runs = [start(ingested_subset, *args) for _ in range(2)]
    results = [ok(finish(proc)) for proc in runs]
    versions = {r.json["version"] for r in results}
    assert len(versions) == 1
    assert all("Traceback" not in r.stderr for r in results)
    assert catalog_names(ingested_subset)["fashion-mnist-processed"] == sorted(versions)
    work = ingested_subset / "work"
    assert sorted(p.name for p in work.iterdir() if p.name != ".locks") == []


def test_three_ingests_of_one_http_source_at_once_agree(home: Path, http_subset: str) -> None:
    """Three ingests of one HTTP source share the download cache: all exit 0 with one version
    and no partial file is left; before, the cache's `.part` file failed four trials in six."""
    args = ("ingest", "fashion-mnist", "--source", http_subset, "--workers", "1", "--json")
    runs = [start(home, *args) for _ in range(3)]
    results = [ok(finish(proc)) for proc in runs]
    assert {r.json["version"] for r in results} == {results[0].json["version"]}
    assert all(r.json["rows"] == 3_000 for r in results)
    assert catalog_names(home) == {"fashion-mnist": [results[0].json["version"]]}
    downloads = home / "work" / "downloads"
    assert [p.name for p in downloads.iterdir() if p.name.endswith(".part")] == []


# ---------------------------------------------------------------------------------------------
# Item 6: every user error is one line, exit 1


@pytest.fixture
def tiny_home(home: Path, tmp_path: Path) -> Path:
    """``home`` with a 40 + 10 image raw version: too small for the default --rank-multiple."""
    rng = np.random.default_rng(0)

    def images(n: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
        pixels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        return pixels, (np.arange(n) % 10).astype(np.uint8)

    source = write_idx_set(tmp_path / "tiny", {"train": images(40), "test": images(10)})
    home.mkdir(parents=True)
    mnist.ingest(Catalog(str(home / "catalog")), "fashion-mnist", source=str(source))
    return home


def test_small_dataset_against_the_default_rank_multiple(tiny_home: Path) -> None:
    result = finish(start(tiny_home, "preprocess", "fashion-mnist", "--workers", "1"))
    one_line_error(result, "--rank-multiple", "40 training rows")
    assert "fashion-mnist-processed" not in catalog_names(tiny_home)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("preprocess", "fashion-mnist", "--scheduler", "tcp://"), "--scheduler"),
        (("preprocess", "fashion-mnist", "--scheduler", "localhost"), "--scheduler"),
        (("preprocess", "fashion-mnist", "--scheduler", "tcp://127.0.0.1:99999"), "--scheduler"),
        (("ingest", "fashion-mnist", "--scheduler", "http://[::1:8786"), "--scheduler"),
        (("preprocess", "fashion-mnist", "--validation-fraction", "nan"), "finite"),
        (("preprocess", "fashion-mnist", "--test-fraction=-inf"), "finite"),
        (("train", "fashion-mnist", "--lr", "inf"), "finite"),
        (("train", "fashion-mnist", "--lr", "1e999"), "finite"),
        (("run", "fashion-mnist", "--lr", "NaN"), "finite"),
        # Found by tests/test_fuzz_cli.py: an infinite size was an internal error.
        (("ingest", "sdss", "--memory-limit=1e999"), "--memory-limit"),
        # run drove its stages on a LocalCluster whatever --cluster said.
        (("run", "sdss", "--source", "/nonexistent", "--cluster", "slurm"), "--cluster"),
    ],
)
def test_malformed_options_are_one_line(home: Path, args: tuple[str, ...], needle: str) -> None:
    one_line_error(finish(start(home, *args)), needle)


def test_a_file_as_out_of_synth(home: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    one_line_error(
        finish(start(home, "synth", "sdss", "--rows", "100", "--out", str(taken))),
        "--out",
        "is a file",
    )
    one_line_error(
        finish(start(home, "synth", "sdss", "--rows", "100", "--out", str(taken / "sub"))),
        "--out",
    )
    assert taken.read_text() == "not a folder\n"


def test_a_file_as_shardflow_home(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    one_line_error(finish(start(taken, "catalog", "list")), "SHARDFLOW_HOME", "is a file")
    one_line_error(finish(start(taken / "below", "catalog", "list")), "SHARDFLOW_HOME")


def _read_only_mount_works() -> bool:
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --bind / /mnt && mount -o remount,bind,ro /mnt"],
        capture_output=True,
    )
    return shutil.which("unshare") is not None and probe.returncode == 0


@pytest.mark.skipif(
    not shutil.which("unshare") or not _read_only_mount_works(),
    reason="needs `unshare -m` and bind mounts (root, or a user namespace) for a read-only home",
)
def test_a_read_only_home(tiny_home: Path) -> None:
    """SHARDFLOW_HOME on a read-only filesystem (a read-only bind mount in a private mount
    namespace: chmod does not stop root): every command that writes says so in one line."""
    script = (
        f'mount --bind "{tiny_home}" "{tiny_home}" && '
        f'mount -o remount,bind,ro "{tiny_home}" && exec "$@"'
    )
    for args in (
        ("ingest", "fashion-mnist", "--source", str(FASHION_MNIST_DIR), "--workers", "1"),
        ("preprocess", "fashion-mnist", "--rank-multiple", "1", "--workers", "1"),
        ("catalog", "reindex"),
        ("catalog", "gc"),
    ):
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", str(SHARDFLOW), *args],
            capture_output=True,
            text=True,
            env=_env(tiny_home),
            timeout=300,
        )
        one_line_error(Result(proc.returncode, proc.stdout, proc.stderr), "writable")


def test_a_garbled_index_is_rebuilt(tiny_home: Path) -> None:
    index = tiny_home / "catalog" / "index.sqlite"
    assert index.exists()
    index.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    listed = ok(finish(start(tiny_home, "catalog", "list", "--json")))
    assert [d["name"] for d in listed.json["datasets"]] == ["fashion-mnist"]
    assert len(listed.stderr.splitlines()) <= 1  # at most the note that it was rebuilt

    index.write_bytes(os.urandom(8192))
    rebuilt = ok(finish(start(tiny_home, "catalog", "reindex", "--json")))
    assert rebuilt.json == {"versions": 1}
    assert index.read_bytes().startswith(b"SQLite format 3\x00")
    again = ok(finish(start(tiny_home, "catalog", "list", "--json")))
    assert again.stderr == ""


def test_one_garbled_manifest_hides_nothing_else(tiny_home: Path, fashion_subset: Path) -> None:
    """`catalog list` shows every version it can read and names the one it cannot."""
    catalog = Catalog(str(tiny_home / "catalog"))
    good = mnist.ingest(catalog, "mnist", source=str(fashion_subset))
    bad = catalog.get("fashion-mnist")
    manifest = Path(catalog.version_url(bad.name, bad.version)) / "_manifest.json"
    manifest.write_bytes(b"\xff{not json")
    listed = ok(finish(start(tiny_home, "catalog", "list", "--json")))
    assert [(d["name"], d["latest"]) for d in listed.json["datasets"]] == [("mnist", good.version)]
    assert [u["path"] for u in listed.json["unreadable"]] == [str(manifest)]
    assert listed.stderr.count("\n") == 1 and "1 manifest(s) could not be read" in listed.stderr


def _lines_of(stream: object, into: list[str], seen: threading.Event, prefix: str) -> None:
    for line in stream:  # type: ignore[attr-defined]  # a text pipe
        into.append(line)
        if line.startswith(prefix):
            seen.set()


def test_ctrl_c_during_preprocess_is_one_line(home: Path) -> None:
    """Ctrl-C at a terminal signals the whole process group, Dask's workers too: the command
    stops them itself, exits 130 with one line; before, every worker printed its tracebacks
    (about 60 lines)."""
    home.mkdir(parents=True)
    mnist.ingest(Catalog(str(home / "catalog")), "fashion-mnist", source=str(FASHION_MNIST_DIR))
    proc = start(
        home,
        "preprocess",
        "fashion-mnist",
        "--workers",
        "2",
        "--rows-per-group",
        "100",
        "--verbose",
        new_session=True,
    )
    lines: list[str] = []
    writing = threading.Event()
    reader = threading.Thread(target=_lines_of, args=(proc.stderr, lines, writing, "write: "))
    reader.start()
    assert writing.wait(timeout=240), "".join(lines)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    reader.join(timeout=30)
    after = lines[next(i for i, line in enumerate(lines) if line.startswith("write: ")) :]
    noise = [line for line in after if not line.startswith("write: ")]
    assert noise == ["shardflow: interrupted\n"], "".join(after)
    assert "fashion-mnist-processed" not in catalog_names(home)


# ---------------------------------------------------------------------------------------------
# Item 7: bounded resources against hostile or broken sources


def _peak_rss_of(args: list[str], env: dict[str, str]) -> tuple[Result, int]:
    """Run ``args`` under a Python that reports the peak RSS of its largest descendant."""
    wrapper = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(p.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
        "sys.exit(p.returncode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return Result(proc.returncode, "", proc.stderr), int(proc.stdout.strip())


def test_an_endless_skyserver_reply_is_refused_in_bounded_memory(home: Path) -> None:
    with serve(StandIn(synthetic_rows(500), mode="endless", endless_bytes=2_000_000_000)) as s:
        result, peak = _peak_rss_of(
            [
                str(SHARDFLOW),
                "ingest",
                "sdss",
                "--skyserver-url",
                s.url,
                "--data-release",
                "17",
                "--workers",
                "1",
            ],
            _env(home),
        )
        sent = s.endless_sent
    one_line_error(result, "reply exceeds", "for a page of 500 rows")
    assert peak < RSS_BOUND, f"peak RSS {peak / 2**20:.0f} MiB"
    assert sent < 200 * 2**20
    assert "sdss" not in catalog_names(home)


def _idx_gzip(shape: tuple[int, ...], data: bytes = b"") -> bytes:
    header = bytes([0, 0, 8, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)
    return gzip.compress(header + data, mtime=0)


@pytest.mark.parametrize(
    ("train_images", "needle"),
    [
        # 50 MB of zeros in a 50 KB gzip, declaring 60,000 images of 8000 x 8000.
        (lambda: _idx_gzip((60_000, 8000, 8000), bytes(50 << 20)), "8000 x 8000"),
        (lambda: _idx_gzip((0, 28, 28)), "0 records"),
        (lambda: _idx_gzip((2_000, 28, 0)), "(28, 0): empty"),
    ],
    ids=["huge-images", "zero-images", "zero-width"],
)
def test_hostile_idx_files_are_refused_and_leave_no_copy(
    home: Path,
    fashion_subset: Path,
    tmp_path: Path,
    train_images: Callable[[], bytes],
    needle: str,
) -> None:
    """Refused from the header (before anything is inflated), no version committed, and the
    refused file kept nowhere: not in the download cache (item 8)."""
    source = tmp_path / "source"
    shutil.copytree(fashion_subset, source)
    bad = source / "train-images-idx3-ubyte.gz"
    bad.write_bytes(train_images())
    result = finish(
        start(home, "ingest", "fashion-mnist", "--source", str(source), "--workers", "1")
    )
    one_line_error(result, needle)
    assert catalog_names(home) == {}
    downloads = home / "work" / "downloads"
    cached = [p.name for p in downloads.iterdir()] if downloads.exists() else []
    assert not [name for name in cached if name.startswith(_url_key(f"file://{bad}"))], cached
    assert not [name for name in cached if name.startswith(_url_key(str(bad)))], cached


class _BusyAtFirst(StandIn):
    """Answers the first two page queries with 503 (a busy server), then normally."""

    def respond(self, cmd: str) -> tuple[int, bytes | Iterator[bytes]]:
        if "count(*)" not in cmd and len(self.page_queries) < 2:
            self.queries.append(cmd)
            return 503, b"Service Unavailable: the server is busy"
        return super().respond(cmd)


def test_a_busy_skyserver_is_retried_with_progress(home: Path) -> None:
    """The waits between attempts are shown (--verbose) as they happen, from the Dask worker
    that runs the page task; before, they went to the worker's log, unseen."""
    with serve(_BusyAtFirst(synthetic_rows(500))) as s:
        result = finish(
            start(
                home,
                *("ingest", "sdss", "--skyserver-url", s.url, "--data-release", "17"),
                *("--workers", "1", "--verbose", "--json"),
            )
        )
    ok(result)
    assert result.json["rows"] == 500
    retries = [line for line in result.stderr.splitlines() if "retrying in" in line]
    # 2 s then 4 s, each plus up to 1 s of jitter (preprocessing/sources/retry.py); the wait is
    # printed to 0.1 s, so 4 s plus 0.96 s of jitter reads "5.0".
    said = [re.search(r"\(attempt (\d)/3\); retrying in ([\d.]+) s", line) for line in retries]
    waits = [(m.group(1), float(m.group(2))) for m in said if m]
    assert [attempt for attempt, _ in waits] == ["1", "2"], result.stderr
    assert 2.0 <= waits[0][1] <= 3.0 and 4.0 <= waits[1][1] <= 5.0, result.stderr


# ---------------------------------------------------------------------------------------------
# Item 8: nothing leaks


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` and everything under it look untouched for ``seconds``."""
    then = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_catalog_gc_removes_what_a_refused_ingest_left(
    home: Path, fashion_subset: Path, tmp_path: Path
) -> None:
    """A refused ingest keeps its good files (for a rerun) in its work folder and the download
    cache; `catalog gc` removes them once untouched for an hour, and says so; it keeps a live
    job's folder, a committed version, and work younger than an hour."""
    source = tmp_path / "source"
    shutil.copytree(fashion_subset, source)
    (source / "t10k-labels-idx1-ubyte.gz").write_bytes(_idx_gzip((1_000,), bytes([12]) * 1_000))
    refused = finish(
        start(home, "ingest", "fashion-mnist", "--source", str(source), "--workers", "1")
    )
    one_line_error(refused, "label 12")
    work = home / "work"
    leftovers = sorted(p for p in work.iterdir() if p.name not in (".locks", "downloads"))
    cached = sorted((work / "downloads").iterdir())
    assert leftovers and cached
    young = ok(finish(start(home, "catalog", "gc", "--json"))).json
    assert young == {"removed": []}

    for path in [*leftovers, *cached]:
        _age(path, 2 * 3600)
    removed = ok(finish(start(home, "catalog", "gc", "--json"))).json["removed"]
    assert sorted(removed) == sorted(str(p) for p in [*leftovers, *cached])
    assert not any(p.exists() for p in [*leftovers, *cached])
    assert ok(finish(start(home, "catalog", "gc"))).stdout == "nothing to remove\n"


def test_a_failed_launch_leaves_no_run_folder(home: Path, fashion_subset: Path) -> None:
    home.mkdir(parents=True)
    catalog = Catalog(str(home / "catalog"))
    mnist.ingest(catalog, "fashion-mnist", source=str(fashion_subset))
    ok(finish(start(home, "preprocess", "fashion-mnist", "--workers", "1")))
    failed = finish(start(home, "train", "fashion-mnist", "--controller", "mpi", "--epochs", "1"))
    one_line_error(failed, "MPI")
    runs = home / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []
    assert "fashion-mnist-cnn" not in catalog_names(home)


# ---------------------------------------------------------------------------------------------
# Item 9: data problems are counted


def test_non_finite_cells_and_duplicate_keys_of_a_csv_export_are_quarantined(
    home: Path, tmp_path: Path
) -> None:
    """nan, inf, -inf and empty feature cells, and rows repeating an (objid, specobjid): the
    export is ingested whole, those rows quarantined and counted in the processed manifest."""
    made = tmp_path / "made"
    ok(finish(start(home, "synth", "sdss", "--rows", "2000", "--files", "1", "--out", str(made))))
    (export,) = made.glob("*.csv")
    header, *rows = export.read_text().splitlines()
    columns = header.split(",")

    def set_cell(row: int, column: str, value: str) -> None:
        cells = rows[row].split(",")
        cells[columns.index(column)] = value
        rows[row] = ",".join(cells)

    set_cell(10, "u", "nan")
    set_cell(20, "g", "inf")
    set_cell(30, "r", "")
    set_cell(40, "petroRad_z", "-inf")
    rows += [rows[5], rows[6]]  # the same (objid, specobjid) twice
    source = tmp_path / "dirty"
    source.mkdir()
    (source / "export.csv").write_text("\n".join([header, *rows]) + "\n")

    ingested = ok(finish(start(home, "ingest", "sdss", "--source", str(source), "--json"))).json
    assert ingested["rows"] == 2_002
    processed = ok(
        finish(
            start(home, "preprocess", "sdss", "--rank-multiple", "1", "--workers", "1", "--json")
        )
    ).json
    reasons = processed["quarantine"]["reasons"]
    assert reasons["nan:u"] == 1
    assert reasons["infinite:g"] == 1
    assert reasons["nan:r"] == 1
    assert reasons["infinite:petroRad_z"] == 1
    assert reasons["duplicate (objid, specobjid)"] == 2
    quarantined = processed["quarantine"]["rows"]
    assert quarantined == sum(reasons.values())
    assert processed["rows_in"] == 2_002
    kept = sum(split["source_rows"] for split in processed["splits"].values())
    assert kept + quarantined == 2_002
    shown = ok(finish(start(home, "catalog", "show", "sdss-processed", "--json"))).json
    assert json.dumps(shown["statistics"]["quarantine"], sort_keys=True) == json.dumps(
        processed["quarantine"], sort_keys=True
    )


def test_a_csv_row_that_is_not_utf8_is_refused_in_one_line(home: Path, tmp_path: Path) -> None:
    """A row with bytes that are not UTF-8 and a field short: refused naming the row, with
    no "Exception ignored" and traceback of pyarrow's bad-row handler on stderr."""
    made = tmp_path / "made"
    ok(finish(start(home, "synth", "sdss", "--rows", "200", "--files", "1", "--out", str(made))))
    (export,) = made.glob("*.csv")
    header, *rows = export.read_bytes().split(b"\n")
    cells = rows[6].split(b",")
    cells[header.split(b",").index(b"g")] = b"\xff\xfe"
    rows[6] = b",".join(cells[:-1])
    source = tmp_path / "dirty"
    source.mkdir()
    (source / "export.csv").write_bytes(b"\n".join([header, *rows]))

    result = finish(start(home, "ingest", "sdss", "--source", str(source)))
    assert "Exception ignored" not in result.stderr
    one_line_error(result, "export.csv", "row 7 has 21 fields, header has 22")
    assert "sdss" not in catalog_names(home)
