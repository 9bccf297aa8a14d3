"""Issue #29 (hardening, round 3), as a hostile user or a careless operator meets it: real
`shardflow` processes, two at once, servers that stop answering, damaged inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from data_catalog import Catalog
from preprocessing.sources import mnist
from tests.conftest import Result, copy_home, free_port
from tests.preprocessing.sources.skyserver_standin import StandIn, serve, synthetic_rows

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
SHARDFLOW = BIN / "shardflow"


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "SHARDFLOW_HOME": str(home), **extra}


def start(home: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(SHARDFLOW), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(home, **env),
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> Result:
    stdout, stderr = proc.communicate(timeout=timeout)
    return Result(proc.returncode, stdout, stderr)


def run(home: Path, *args: str, timeout: float = 300, **env: str) -> Result:
    return finish(start(home, *args, **env), timeout)


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_line_error(result: Result, *needles: str) -> str:
    """The one line a user error leaves on stderr, after exit 1; it contains ``needles``."""
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith("shardflow: error: "), line
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def processed_subset(home: Path, fashion_subset: Path) -> Path:
    """``home`` with the 3,000-image subset ingested and preprocessed (8 training groups)."""
    home.mkdir(parents=True)
    mnist.ingest(Catalog(str(home / "catalog")), "fashion-mnist", source=str(fashion_subset))
    ok(run(home, "preprocess", "fashion-mnist", "--workers", "1", "--rank-multiple", "8"))
    return home


# ---------------------------------------------------------------------------------------------
# Item 4: two identical train runs take turns


def test_two_identical_train_runs_take_turns(processed_subset: Path) -> None:
    """The second waits for the first's lock on the run folder, says so, then finds the model
    committed; the first's files stay whole (before, the second removed the run folder
    mid-training and both wrote into one)."""
    home = processed_subset
    args = ("train", "fashion-mnist", "--np", "1", "--epochs", "2", "--batch-size", "32")
    first = start(home, *args, "--json", "--verbose")
    assert first.stderr is not None
    seen: list[str] = []
    launched = threading.Event()

    def read() -> None:
        assert first.stderr is not None
        for line in first.stderr:
            seen.append(line)
            if line.startswith("train: 1 ranks x"):
                launched.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert launched.wait(timeout=240), "".join(seen)
    second = ok(run(home, *args, "--json", "--verbose", timeout=600))
    stdout = first.stdout.read() if first.stdout is not None else ""
    assert first.wait(timeout=600) == 0, "".join(seen)[-3000:]
    reader.join(timeout=30)
    done = Result(0, stdout, "".join(seen))
    assert "waiting for another run training in" in second.stderr, second.stderr[-3000:]
    assert second.json["version"] == done.json["version"]
    catalog = Catalog(str(home / "catalog"))
    (model,) = catalog.versions("fashion-mnist-cnn")
    assert catalog.verify("fashion-mnist-cnn") == []
    run_dir = Path(model.extra["run_dir"])
    entry = next(f for f in model.files if f.path == "metrics.json")
    assert (run_dir / "metrics.json").read_bytes() == catalog.file_path(model, entry).read_bytes()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())


# ---------------------------------------------------------------------------------------------
# Items 6 and 10: an external Dask scheduler that cannot run the work


def _listen(*, answer: bytes | None) -> tuple[str, Callable[[], None]]:
    """A loopback listener that accepts and never answers (``answer`` None), or answers every
    connection with ``answer`` (an HTTP server's reply); its address and its stop."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stopped = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stopped.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)
            if answer is not None:
                conn.recv(65536)
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()

    return f"127.0.0.1:{server.getsockname()[1]}", stop


HTTP_REPLY = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize(
    ("answer", "needle"),
    [(None, "did not answer within 3 s"), (HTTP_REPLY, "did not answer as a Dask scheduler")],
    ids=["silent", "http"],
)
def test_a_scheduler_address_that_never_answers_dask(
    processed_subset: Path, answer: bytes | None, needle: str
) -> None:
    address, stop = _listen(answer=answer)
    try:
        result = run(
            processed_subset,
            *("preprocess", "fashion-mnist", "--rank-multiple", "4"),
            *("--scheduler", f"tcp://{address}"),
            timeout=120,
            SHARDFLOW_DEADLINE_CONNECT="3",
        )
    finally:
        stop()
    one_line_error(result, f"tcp://{address}", needle)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A `dask scheduler` on loopback with no worker; stopped after the test."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address = f"tcp://127.0.0.1:{port}"
    _wait_for_port(port)
    try:
        yield address, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _wait_for_port(port: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on 127.0.0.1:{port}")


def _worker(address: str, home: Path, **env: str) -> subprocess.Popen[bytes]:
    """One `dask worker` without a nanny (nothing restarts it when it dies)."""
    return subprocess.Popen(
        [str(BIN / "dask"), "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
         "--no-nanny", "--no-dashboard", "--local-directory", str(home / "dask-worker")],
        env=_env(home, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


PREPROCESS_MANY = ("preprocess", "fashion-mnist", "--rank-multiple", "4", "--rows-per-group", "50")


def test_a_scheduler_without_workers_is_named(
    processed_subset: Path, scheduler: tuple[str, subprocess.Popen[bytes]]
) -> None:
    address, _proc = scheduler
    result = run(
        processed_subset,
        *PREPROCESS_MANY,
        *("--scheduler", address),
        timeout=120,
        SHARDFLOW_DEADLINE_WORKERS="4",
    )
    one_line_error(result, f"no Dask worker: the scheduler {address}", "did not answer within 4 s")


def test_the_only_worker_killed_mid_write_is_named(
    processed_subset: Path, scheduler: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Its worker dies by SIGKILL right after its first shard (SHARDFLOW_CRASH_AT): the tasks
    wait for a worker that never comes, until the deadline says so."""
    address, _proc = scheduler
    worker = _worker(address, processed_subset, SHARDFLOW_CRASH_AT="after-shard:1")
    try:
        result = run(
            processed_subset,
            *PREPROCESS_MANY,
            *("--scheduler", address),
            timeout=180,
            SHARDFLOW_DEADLINE_WORKERS="4",
        )
    finally:
        worker.kill()
        worker.wait(timeout=30)
    one_line_error(result, f"no Dask worker: the scheduler {address}")
    assert "fashion-mnist-processed@" not in run(processed_subset, "catalog", "list").stdout


def test_a_scheduler_killed_mid_run_is_one_line(
    processed_subset: Path, scheduler: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """kill -9 of the scheduler while the command waits on it (its only worker stopped, so the
    run is mid-way whenever the kill lands): one line naming it, exit 1; before, a 36-line
    traceback and an internal error, exit 2."""
    import signal

    address, proc = scheduler
    worker = _worker(address, processed_subset)
    _wait_for_workers(address, 1)
    worker.send_signal(signal.SIGSTOP)
    command = start(processed_subset, *PREPROCESS_MANY, "--scheduler", address, "--verbose")
    assert command.stderr is not None
    try:
        lines = []
        for line in command.stderr:
            lines.append(line)
            if line.startswith("dask: using scheduler"):
                break
        proc.kill()
        rest = command.stderr.read()
        command.wait(timeout=180)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    after = [line for line in rest.splitlines() if not line.startswith("dask: ")]
    assert command.returncode == 1, "".join(lines) + rest
    assert len(after) == 1 and after[0].startswith("shardflow: error: "), rest
    assert f"lost the Dask scheduler {address}" in after[0]
    assert "finished tasks are kept" in after[0]


def _wait_for_workers(address: str, count: int) -> None:
    probe = (
        "from distributed import Client; "
        f"c = Client({address!r}, timeout=30); c.wait_for_workers({count}, timeout=120)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Items 8 and 14: a PREFECT_API_URL that does not answer


@pytest.mark.parametrize("kind", ["silent", "refused"])
def test_a_prefect_api_that_does_not_answer_is_named_before_any_work(
    home: Path, fashion_subset: Path, kind: str
) -> None:
    if kind == "silent":
        address, stop = _listen(answer=None)
    else:
        address, stop = f"127.0.0.1:{free_port()}", lambda: None
    api = f"http://{address}/api"
    try:
        result = run(
            home,
            *("run", "fashion-mnist", "--source", str(fashion_subset), "--np", "1"),
            timeout=180,
            PREFECT_API_URL=api,
            SHARDFLOW_DEADLINE_CONNECT="3",
        )
    finally:
        stop()
    needle = "did not answer within 3 s" if kind == "silent" else "does not answer /health"
    one_line_error(result, f"the Prefect API at {api}", needle, "unset PREFECT_API_URL")
    assert not (home / "catalog").exists() or run(home, "catalog", "list").stdout.startswith(
        "the catalog at"
    )


# ---------------------------------------------------------------------------------------------
# Item 13: `shardflow server` says where it is only once it answers there


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--port", "70000"), "--port"),
        (("--port", "0"), "--port"),
        (("--host", "256.1.1.1"), "--host '256.1.1.1' is not a host name or address"),
        (("--host", "192.0.2.1"), "--host 192.0.2.1 is not an address of this machine"),
    ],
)
def test_server_refuses_an_address_it_cannot_listen_on(
    home: Path, args: tuple[str, ...], needle: str
) -> None:
    result = run(home, "server", *args, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and needle in result.stderr, result.stderr
    assert "PREFECT_API_URL" not in result.stderr


def test_server_on_a_busy_port_points_nowhere(home: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run(home, "server", "--port", str(port), timeout=60)
    one_line_error(result, f"port {port} on 127.0.0.1 is in use")
    assert "export PREFECT_API_URL" not in result.stderr


# ---------------------------------------------------------------------------------------------
# Item 9: a SkyServer that drips its reply, or never answers


class _Dripping(StandIn):
    """Pages arrive one byte at a time, one every half second (the count is answered)."""

    def respond(self, cmd: str) -> tuple[int, bytes | Iterator[bytes]]:
        status, body = super().respond(cmd)
        if "count(*)" in cmd or not isinstance(body, bytes):
            return status, body

        def drip() -> Iterator[bytes]:
            for byte in body:
                time.sleep(0.5)
                yield bytes([byte])

        return status, drip()


class _Silent(StandIn):
    """Pages are never answered (the count is)."""

    def respond(self, cmd: str) -> tuple[int, bytes | Iterator[bytes]]:
        if "count(*)" in cmd:
            return super().respond(cmd)
        self.queries.append(cmd)
        time.sleep(30)
        return 503, b"too late"


@pytest.mark.parametrize(
    ("standin", "needle"),
    [(_Dripping, "the reply was not whole within 2 s"), (_Silent, "Read timed out")],
    ids=["drip", "silent"],
)
def test_a_skyserver_too_slow_to_finish_is_named(
    home: Path, standin: type[StandIn], needle: str
) -> None:
    with serve(standin(synthetic_rows(500))) as server:
        result = run(
            home,
            *("ingest", "sdss", "--skyserver-url", server.url, "--data-release", "17"),
            *("--workers", "1"),
            timeout=240,
            SHARDFLOW_DEADLINE_REPLY="2",
        )
    one_line_error(result, server.url, needle, "(3 attempts)")


# ---------------------------------------------------------------------------------------------
# Item 15: bench options


@pytest.mark.parametrize(
    "args",
    [
        ("reader", "fashion-mnist", "--steps", "0"),
        ("preprocess", "fashion-mnist", "--rounds", "0"),
        ("ingest", "sdss", "--rounds", "-1"),
        ("scaling", "fashion-mnist", "--batch-size", "0"),
        ("aggregation", "fashion-mnist", "--epochs", "0"),
        ("ingest", "sdss", "--files", "0"),
    ],
)
def test_bench_counts_below_one_are_usage_errors(
    home: Path, fashion_processed: Path, args: tuple[str, ...]
) -> None:
    # A home holding the dataset, so that before the fix each count reached the bench (and
    # its internal error) instead of stopping at "no dataset" (docs/hardening.md, item 15).
    result = run(copy_home(fashion_processed, home), "bench", *args, timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert "expected 1 or more" in line and "internal error" not in line, line


def test_train_refuses_a_seed_the_ranks_cannot_use(home: Path, fashion_processed: Path) -> None:
    """Issue #29 item 18: refused before anything is planned or launched (in a home holding
    the dataset: before the fix the ranks started and failed)."""
    one_line_error(
        run(copy_home(fashion_processed, home), "train", "fashion-mnist", "--seed", "4294967296"),
        "--seed must be at most 4294967295",
    )


# ---------------------------------------------------------------------------------------------
# Item 16: IDX errors name the user's file, not a work copy that is gone


def _idx(shape: tuple[int, ...], data: bytes, *, dims: int | None = None, code: int = 8) -> bytes:
    import struct

    return bytes([0, 0, code, dims or len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + data


@pytest.mark.parametrize("compress", [True, False], ids=["gz", "plain"])
@pytest.mark.parametrize(
    ("stem", "content", "needle"),
    [
        ("train-labels-idx1-ubyte", b"\x00\x00\x0d\x01" + bytes(8), "IDX type"),
        ("train-labels-idx1-ubyte", _idx((2_000,), bytes([200]) * 2_000), "label 200"),
        ("train-labels-idx1-ubyte", _idx((2_000,), bytes(2_000) + b"extra"), "but the file holds"),
        ("train-labels-idx1-ubyte", _idx((0,), b""), "0 records"),
        ("train-images-idx3-ubyte", _idx((2_000, 28, 28, 1), bytes(4)), "dimensions"),
        ("train-images-idx3-ubyte", _idx((2_000, 9000, 9000), bytes(4)), "9000 x 9000"),
    ],
    ids=["magic", "label", "trailing", "zero", "4-d", "huge"],
)
def test_idx_errors_name_the_users_file(
    home: Path, fashion_subset: Path, tmp_path: Path, stem: str, content: bytes, needle: str,
    compress: bool,
) -> None:  # fmt: skip
    import gzip
    import shutil

    source = tmp_path / "source"
    shutil.copytree(fashion_subset, source)
    (source / f"{stem}.gz").unlink()
    bad = source / (f"{stem}.gz" if compress else stem)
    bad.write_bytes(gzip.compress(content, mtime=0) if compress else content)
    result = run(home, "ingest", "fashion-mnist", "--source", str(source), "--workers", "1")
    line = one_line_error(result, needle)
    assert str(bad) in line, line
    assert str(home / "work") not in line, line


# ---------------------------------------------------------------------------------------------
# Items 17, 22 and 23: source file names, and files left out


def test_source_file_names_of_any_legal_form_and_files_left_out(home: Path, tmp_path: Path) -> None:
    """A 244-character name and a name holding a newline are ingested (item 17: "File name too
    long" on a derived work path; item 23: the newline reached the catalog's file name); a
    compressed export and a stray text file beside them are named in a warning (item 22)."""
    import shutil

    made = tmp_path / "made"
    ok(run(home, "synth", "sdss", "--rows", "600", "--files", "3", "--out", str(made)))
    exports = sorted(made.glob("*.csv"))
    source = tmp_path / "source"
    source.mkdir()
    long_name = "a" * 240 + ".csv"
    shutil.copy(exports[0], source / long_name)
    shutil.copy(exports[1], source / "new\nline.csv")
    shutil.copy(exports[2], source / "c.csv")
    (source / "d.csv.gz").write_bytes(b"\x1f\x8b not read")
    (source / "e.txt").write_text("notes\n")

    result = ok(run(home, "ingest", "sdss", "--source", str(source), "--json"))
    assert result.json["rows"] == 600
    warnings = [line for line in result.stderr.splitlines() if line]
    assert len(warnings) == 1, result.stderr
    assert "skipping 2 file(s)" in warnings[0] and "'d.csv.gz', 'e.txt'" in warnings[0]
    shown = ok(run(home, "catalog", "show", "sdss", "--json")).json
    names = [Path(f["path"]).name for f in shown["files"] if f["path"].endswith(".parquet")]
    assert len(names) == 3 and all("\n" not in n and len(n.encode()) < 160 for n in names), names
    assert any("new_line" in n for n in names), names


def test_an_idx_file_beside_its_gz_twin_is_noticed(
    home: Path, fashion_subset: Path, tmp_path: Path
) -> None:
    import gzip
    import shutil

    source = tmp_path / "source"
    shutil.copytree(fashion_subset, source)
    plain = source / "train-labels-idx1-ubyte"
    plain.write_bytes(gzip.decompress((source / "train-labels-idx1-ubyte.gz").read_bytes()))
    result = ok(run(home, "ingest", "fashion-mnist", "--source", str(source), "--workers", "1"))
    assert result.stderr.count("warning") == 1, result.stderr
    assert "holds both train-labels-idx1-ubyte.gz and train-labels-idx1-ubyte" in result.stderr


# ---------------------------------------------------------------------------------------------
# Item 19: every row quarantined


def test_every_row_quarantined_says_so_and_why(home: Path, tmp_path: Path) -> None:
    """A FITS export whose class values are lower case: every row is quarantined, and the one
    line says how many of how many and why (before: row groups were blamed, or an internal
    error from empty statistics)."""
    from astropy.table import Table

    made = tmp_path / "made"
    ok(run(home, "synth", "sdss", "--rows", "2000", "--files", "1", "--format", "fits",
           "--out", str(made)))  # fmt: skip
    (export,) = made.glob("*.fits")
    table = Table.read(export)
    table["class"] = [str(c).lower() for c in table["class"]]
    source = tmp_path / "lower"
    source.mkdir()
    table.write(source / "lower.fits")
    ok(run(home, "ingest", "sdss", "--source", str(source)))
    for extra in ((), ("--rank-multiple", "1")):
        line = one_line_error(
            run(home, "preprocess", "sdss", "--workers", "1", *extra),
            "2,000 of 2,000 rows were quarantined",
            "unknown class (expected STAR / GALAXY / QSO)",
            "no training rows",
        )
        assert "row group" not in line


# ---------------------------------------------------------------------------------------------
# Item 20: a stopped rank is the one blamed


def test_a_stopped_rank_is_blamed_not_the_one_that_waited(processed_subset: Path) -> None:
    """SIGSTOP of rank 1 mid-epoch: rank 0 times out in Gloo (5 s here) and horovodrun ends
    the job; the line names rank 1 as stopped (before: rank 0, with no reason), and no rank
    outlives the command."""
    import signal

    import psutil

    from tests.e2e.test_training_failures import still_running, worker_ranks

    command = start(
        processed_subset,
        *("train", "fashion-mnist", "--np", "2", "--epochs", "3", "--batch-size", "8"),
        "--verbose",
        HOROVOD_GLOO_TIMEOUT_SECONDS="5",
    )
    assert command.stderr is not None
    lines = []
    for line in command.stderr:
        lines.append(line)
        if "Epoch 1/3" in line:
            break
    ranks = worker_ranks(psutil.Process(command.pid))
    assert len(ranks) == 2, "".join(lines)
    rank_one = next(r for r in ranks if r.environ().get("HOROVOD_RANK") == "1")
    started = psutil.Process(command.pid).children(recursive=True)
    rank_one.send_signal(signal.SIGSTOP)
    rest = command.stderr.read()
    assert command.wait(timeout=240) == 1, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("shardflow: error: training stopped: rank 1 was stopped"), last
    assert "rank 0 gave up waiting for it after 5 s" in last
    _gone, alive = psutil.wait_procs(started, timeout=60)
    assert still_running(alive) == []


def test_a_killed_horovodrun_is_said_so(processed_subset: Path) -> None:
    """SIGKILL of horovodrun (the launcher of the ranks) mid-epoch: one line saying so, not
    the last line it printed (a `warnings.warn(` line, before), and no rank outlives it."""
    import signal

    import psutil

    from tests.e2e.test_training_failures import still_running

    command = start(
        processed_subset,
        *("train", "fashion-mnist", "--np", "2", "--epochs", "3", "--batch-size", "8"),
        "--verbose",
    )
    assert command.stderr is not None
    for line in command.stderr:
        if "Epoch 1/3" in line:
            break
    started = psutil.Process(command.pid).children(recursive=True)
    launcher = next(p for p in started if "training.horovodrun" in p.cmdline())
    launcher.send_signal(signal.SIGKILL)
    rest = command.stderr.read()
    assert command.wait(timeout=240) == 1, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("shardflow: error: horovodrun was killed (SIGKILL)"), last
    _gone, alive = psutil.wait_procs(started, timeout=60)
    assert still_running(alive) == []


def test_waiting_for_a_worker_is_said_with_verbose(
    processed_subset: Path, scheduler: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Item 6: "nothing even with -v" while it waited; now the wait is said, then the error."""
    address, _proc = scheduler
    result = run(
        processed_subset,
        *PREPROCESS_MANY,
        *("--scheduler", address, "--verbose"),
        timeout=120,
        SHARDFLOW_DEADLINE_WORKERS="4",
    )
    assert result.returncode == 1
    assert f"dask: the scheduler {address} has no worker; waiting up to 4 s" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("shardflow: error: no Dask worker")
