"""training.horovodrun dies with the process that started it, and its ranks with it, whatever
that process did with SIGTERM before (issue #29: no process outlives the command that started it).

Real horovodrun on localhost; the ranks are two sleeping Pythons, so that a rank left behind is
still there when the test looks. Each process of a test carries a marker in its environment
(horovodrun hands its environment to the ranks): that is how the test finds what is left once
the parent is gone, and how it stops all of it in the end, whatever the outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

pytestmark = pytest.mark.e2e

MARK = "SHARDFLOW_TEST_WRAPPER_MARK"
RANK = "import time; print('rank up', flush=True); time.sleep(600)"
# The parent: a supervisor that ignores (and, with "block", blocks) SIGTERM, both inherited by
# what it starts, then starts the wrapper as the launcher does (a session of its own).
PARENT = f"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "block" in sys.argv:
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
subprocess.Popen(
    [sys.executable, "-m", "training.horovodrun", "--parent", str(os.getpid()),
     "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-c", {RANK!r}],
    start_new_session=True,
)
print("started", flush=True)
time.sleep(600)
"""
STOP_SECONDS = 60


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def mark() -> Iterator[str]:
    mark = uuid.uuid4().hex
    yield mark
    for proc in _marked(mark):
        proc.kill()


def _parent(mark: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PARENT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, MARK: mark, "PYTHONPATH": os.getcwd()},
    )


def _left_after(mark: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(1)
    return [" ".join(p.cmdline())[:120] for p in left]


@pytest.mark.parametrize("how", ["ignored", "block"])
def test_parent_killed_while_horovodrun_starts_leaves_nothing(mark: str, how: str) -> None:
    parent = _parent(mark, how)
    assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
    parent.kill()  # horovodrun is importing: before Horovod's own SIGTERM handler
    parent.wait()
    assert _left_after(mark, STOP_SECONDS) == []


@pytest.mark.parametrize("how", ["ignored", "block"])
def test_parent_killed_while_ranks_run_leaves_nothing(mark: str, how: str) -> None:
    parent = _parent(mark, how)
    assert parent.stdout is not None
    up = 0
    for line in parent.stdout:
        up += "rank up" in line
        if up == 2:
            break
    assert up == 2, "the ranks never started"
    parent.kill()
    parent.wait()
    assert _left_after(mark, STOP_SECONDS) == []
