"""A flow killed mid-ingest and rerun: finished downloads are not fetched again."""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e

SLOW_FILE = "/t10k-images-idx3-ubyte.gz"


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    """Counts GETs per path; serves SLOW_FILE slowly while ``slow`` is set."""

    gets: Counter[str]
    slow: threading.Event

    def do_GET(self) -> None:
        self.gets[self.path] += 1
        super().do_GET()

    def copyfile(self, source: Any, outputfile: Any) -> None:
        if self.path != SLOW_FILE or not self.slow.is_set():
            super().copyfile(source, outputfile)
            return
        while chunk := source.read(1024):
            outputfile.write(chunk)
            time.sleep(0.1)  # the subset's 440 KB in about 45 s: time to kill the run

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def slow_server(fashion_subset: Path) -> Iterator[tuple[str, Counter[str], threading.Event]]:
    gets: Counter[str] = Counter()
    slow = threading.Event()
    handler = type("Handler", (CountingHandler,), {"gets": gets, "slow": slow})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(fashion_subset))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", gets, slow
    finally:
        server.shutdown()
        server.server_close()


def test_killed_flow_resumes_without_refetching(
    slow_server: tuple[str, Counter[str], threading.Event],
    shardflow: Callable[..., Result],
    shardflow_home: Path,
    tmp_path: Path,
) -> None:
    url, gets, slow = slow_server
    slow.set()
    # --in-process-below 0: the files fetched on the LocalCluster's two workers, so that others
    # finish while the slow one is in flight (in the command's process a set this small is
    # fetched one file after the other). A worker may queue a file behind the slow one: the
    # run is killed once the slow file is in flight and no other download is.
    command = ["run", "fashion-mnist", "--source", url, "--np", "2", "--epochs", "1"]
    command += ["--in-process-below", "0"]
    env = {
        **os.environ,
        "SHARDFLOW_HOME": str(shardflow_home),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "shardflow"), *command],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    # The slow file in flight, at least two others fetched whole (each has its download cache's
    # digest record) and none begun but not finished: then the kill.
    downloads = shardflow_home / "work" / "downloads"

    def others_fetched() -> int:
        return sum(n for path, n in gets.items() if path.endswith(".gz") and path != SLOW_FILE)

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        records = len(list(downloads.glob("*.sha256")))
        if gets[SLOW_FILE] > 0 and records == others_fetched() >= 2:
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the flow never fetched the other files (gets: {dict(gets)})")
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its temporary Prefect server
    proc.wait(timeout=30)
    fetched_whole = {p for p, n in gets.items() if p.endswith(".gz") and p != SLOW_FILE and n}
    assert gets[SLOW_FILE] == 1
    listed = shardflow("catalog", "list", "--json").json["datasets"]
    assert listed == []  # nothing half-made is visible

    slow.clear()
    rerun = shardflow(*command, "--json")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.json["rows"] == 3_000
    # The files fetched whole before the kill came from the download cache; the one in flight
    # was fetched again; any file not begun before the kill, once.
    assert len(fetched_whole) >= 2
    others = [p for p in gets if p.endswith(".gz") and p != SLOW_FILE]
    assert sorted(others) == sorted(
        f"/{stem}-ubyte.gz"
        for stem in ("train-images-idx3", "train-labels-idx1", "t10k-labels-idx1")
    )
    assert {p: gets[p] for p in others} == {p: 1 for p in others}
    assert gets[SLOW_FILE] == 2
    assert shardflow("catalog", "verify", "--json").json["ok"] is True
    assert not list((shardflow_home / "work" / "downloads").glob("*.sha256"))
