"""A rank dies mid-epoch: the job ends promptly with a clear message, and --resume finishes it
with the accuracy of a run that was never interrupted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e


def worker_ranks(command: psutil.Process) -> list[psutil.Process]:
    """The training ranks started by ``command`` (its descendants running the worker), not
    those of other training runs on the machine."""
    found = []
    for proc in command.children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        # horovodrun's own command line names the worker too; the shells it starts the ranks
        # through hold the whole command in one argument.
        if "training.worker" in cmdline and "horovodrun" not in " ".join(cmdline):
            found.append(proc)
    return found


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` that have not ended (a zombie has; is_running also checks that
    the pid was not reused)."""
    alive = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_killed_rank_stops_the_job_and_resume_finishes(
    shardflow: Callable[..., Result], fashion_home: Path, shardflow_home: Path, tmp_path: Path
) -> None:
    # fashion_home: the subset ingested and preprocessed, in shardflow_home.
    # A second home with the same raw and processed versions, for a run that is never killed
    # (in the first home its model version would be the resumed run's, found and not retrained).
    clean_home = tmp_path / "clean-home"
    shutil.copytree(shardflow_home, clean_home)

    train = ["train", "fashion-mnist", "--np", "2", "--epochs", "5", "--batch-size", "8"]
    env = {
        **os.environ,
        "SHARDFLOW_HOME": str(shardflow_home),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    executable = Path(sys.executable).parent / "shardflow"
    proc = subprocess.Popen(
        [str(executable), *train, "--verbose"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "Epoch 3/5" in line:  # epochs 1 and 2 are checkpointed
            break
    else:
        pytest.fail("training never reached epoch 3:\n" + "".join(lines[-20:]))
    command = psutil.Process(proc.pid)
    ranks = worker_ranks(command)
    assert len(ranks) == 2
    # Everything the command started, to check that none outlives it (once it has exited, its
    # orphans would no longer be its descendants).
    started = command.children(recursive=True)
    ranks[-1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rest = proc.stderr.read()
    returncode = proc.wait(timeout=120)
    assert time.monotonic() - killed_at < 60
    assert returncode == 1
    error_lines = [line for line in rest.splitlines() if line.startswith("shardflow:")]
    assert len(error_lines) == 1, rest[-2000:]
    assert "ended with exit code 137 (SIGKILL)" in error_lines[0]
    assert "--resume" in error_lines[0]
    assert still_running(started) == []
    kinds = {d["kind"] for d in shardflow("catalog", "list", "--json").json["datasets"]}
    assert kinds == {"raw", "processed"}  # no model version from the failed run

    resumed = shardflow(*train, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = resumed.json
    assert result["resumed_after_epoch"] >= 2
    assert result["epochs"] == 5
    assert result["test_accuracy"] >= 0.70

    # The same training without the kill lands in the same band.
    clean = shardflow(*train, "--json", home=clean_home)
    assert clean.returncode == 0, clean.stderr[-3000:]
    clean_result = clean.json
    assert clean_result["resumed_after_epoch"] == 0
    assert clean_result["version"] == result["version"]  # the same configuration
    assert abs(result["test_accuracy"] - clean_result["test_accuracy"]) <= 0.05, (
        result["test_accuracy"],
        clean_result["test_accuracy"],
    )
    # It continued from the checkpoint, not from scratch: its first epoch's loss is that of
    # the clean run's same epoch, not that of a first epoch.
    resumed_loss = result["history"]["loss"][0]
    clean_loss = clean_result["history"]["loss"]
    same_epoch = clean_loss[result["resumed_after_epoch"]]
    assert abs(resumed_loss - same_epoch) < abs(resumed_loss - clean_loss[0]), (
        resumed_loss,
        clean_loss,
    )
