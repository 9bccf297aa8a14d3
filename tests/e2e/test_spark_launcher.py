"""`train --launcher spark`: Horovod's Spark runner on a real local Spark (a JVM, ``local[2]``)
starts the ranks of the same rank program horovodrun starts, on the real Fashion-MNIST subset.
Its refusals are one line each, and no JVM, Spark worker or rank outlives a killed `train`."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import Result
from tests.e2e.test_processes import (
    SHARDFLOW,
    cmdline,
    command_env,
    home,
    processed_home,
    processes_of,
    started,
    stderr_of,
    wait_for,
)

pytestmark = pytest.mark.e2e

__all__ = ["home", "processed_home"]  # the fixtures, for this module

SPARK = ("--launcher", "spark", "--spark-master", "local[2]", "--np", "2")
# Long enough that ranks left running would still be training when a test looks.
LONG = ("--epochs", "30", "--batch-size", "8")


def test_spark_trains_both_ranks_on_their_own_row_groups_and_commits_the_model(
    home: Path, shardflow: Callable[..., Result]
) -> None:
    trained = shardflow("train", "fashion-mnist", *SPARK, "--epochs", "2", "--json", timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = trained.json
    assert result["num_ranks"] == 2
    assert len(result["history"]["loss"]) == 2
    # 2,000 training images, 2 epochs: a floor well above chance (0.10), below what it reaches.
    assert result["test_accuracy"] >= 0.6, result["test_accuracy"]

    shown = shardflow("catalog", "show", f"fashion-mnist-cnn@{result['version']}", "--json")
    assert shown.returncode == 0, shown.stderr
    assert shown.json["kind"] == "model"
    planned = shown.json["extra"]["row_groups_by_rank"]
    assert set(planned["0"]).isdisjoint(planned["1"]) and planned["0"] and planned["1"]
    # What each rank reports it read, every epoch: its own share, not the whole split.
    by_rank = {str(r["rank"]): r for r in result["input_by_rank"]}
    assert sorted(by_rank) == ["0", "1"]
    for rank, report in by_rank.items():
        assert [e["row_groups_read"] for e in report["epochs"]] == [len(planned[rank])] * 2
    wait_for("no JVM or rank left after the run", lambda: processes_of(home) == [], 20)


def test_spark_refusals_are_one_line(home: Path, shardflow: Callable[..., Result]) -> None:
    cases = {
        ("--spark-master", "mesos://somewhere"): "--spark-master",
        ("--spark-master", "local[1]"): "fewer than the 2 ranks",
        ("--spark-master", "spark://127.0.0.1:1"): "cannot reach the Spark master",
        ("--hosts", "localhost:2"): "not supported with --launcher spark",
    }
    for args, words in cases.items():
        launcher = ("--launcher", "spark", "--np", "2")
        refused = shardflow("train", "fashion-mnist", *launcher, *args, timeout=300)
        assert refused.returncode != 0
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shardflow: "), refused.stderr[-2000:]
        assert words in lines[0]
        assert "Traceback" not in refused.stderr
    # --spark-master alone says what it needs.
    alone = shardflow("train", "fashion-mnist", "--spark-master", "local[2]")
    assert alone.returncode != 0 and "needs --launcher spark" in alone.stderr
    assert not any((home / "runs").glob("*/worker.json"))


def test_no_java_is_one_line_and_starts_nothing(home: Path, tmp_path: Path) -> None:
    env = {**command_env(home, tmp_path / "prefect"), "JAVA_HOME": str(tmp_path / "no-jdk")}
    refused = subprocess.run(
        [SHARDFLOW, "train", "fashion-mnist", *SPARK],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr
    assert "needs a Java runtime" in refused.stderr and "make spark-jdk" in refused.stderr
    assert processes_of(home) == []


def _is_rank(proc: psutil.Process) -> bool:
    """The rank itself, not the `/bin/sh -c env ... gloo_exec_fn ...` Horovod's task service
    starts it with (its command line names gloo_exec_fn too)."""
    return cmdline(proc).split()[1:3] == ["-m", "horovod.spark.task.gloo_exec_fn"]


def _ranks_running(home: Path, command: psutil.Process) -> bool:
    # Ranks and their shells counted together were 4 for the whole training: both tests went
    # on only as the ranks ended (a 30-epoch run's last seconds), not at its first epoch.
    ranks = [p for p in command.children(recursive=True) if _is_rank(p)]
    return len(ranks) == 2 and any(home.glob("runs/*/tensorboard/train/*"))


def _all_gone(home: Path, what: str, seconds: float = 30) -> None:
    """Wait until no process of ``home`` is left; failing, name each one left (its pid, parent,
    state, command line): a run of the suite once found some still there after 30 s, and
    alone, or beside four busy loops, the same kill leaves nothing after 4 s."""
    try:
        wait_for(what, lambda: processes_of(home) == [], seconds)
    except pytest.fail.Exception as failed:
        left = []
        for proc in processes_of(home):
            with contextlib.suppress(psutil.Error):
                left.append(f"{proc.pid} (parent {proc.ppid()}, {proc.status()}): {cmdline(proc)}")
        pytest.fail(f"{failed}; left: " + "; ".join(left))


def test_sigkill_of_train_stops_the_jvm_the_spark_workers_and_every_rank(
    home: Path, tmp_path: Path
) -> None:
    with started(["train", "fashion-mnist", *SPARK, *LONG], home, tmp_path) as proc:
        command = psutil.Process(proc.pid)
        wait_for("both ranks training", lambda: _ranks_running(home, command), 400, proc)
        assert any("java" in cmdline(p) for p in command.children(recursive=True))

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _all_gone(home, "the JVM, Spark's Python workers and the ranks gone after SIGKILL of train")


def test_a_rank_killed_inside_its_spark_task_is_one_line_and_stops_everything(
    home: Path, tmp_path: Path
) -> None:
    with started(["train", "fashion-mnist", *SPARK, *LONG], home, tmp_path) as proc:
        command = psutil.Process(proc.pid)
        wait_for("both ranks training", lambda: _ranks_running(home, command), 400, proc)
        rank = next(p for p in command.children(recursive=True) if _is_rank(p))
        killed = rank.environ()["HOROVOD_RANK"]
        rank.kill()
        proc.wait(timeout=120)
        assert proc.returncode != 0
        said = stderr_of(proc).strip().splitlines()
        assert len(said) == 1 and said[0].startswith("shardflow: "), said[-20:]
        # The killed rank, though the runner may learn first of its peer's end (exit code 1).
        assert f"rank {killed} ended with exit code 137 (SIGKILL)" in said[0], said[0]
        assert "Horovod's Spark runner stopped the other ranks" in said[0]
        _all_gone(home, "nothing left after the failed run")
