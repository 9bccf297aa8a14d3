"""A 2-rank run killed (SIGKILL of its process group) at each point of its life, then resumed,
ends as the run that was never interrupted: its weights, its test accuracy, one committed
model, and no traceback (issue #29 item 5 and its "Must show").

    mid-epoch   after the first step checkpoint inside epoch 2
    trained     after the last step and its checkpoints (rank 0 paused before the figures)
    evaluate    during the test evaluation (rank 0 paused before it)
    commit      inside the model's commit: the launcher killed once the version's folder is
                moved into the catalog and before its manifest is written (the catalog's
                failpoint ``moved``)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from data_catalog import Catalog
from tests.conftest import Result
from tests.e2e.test_mid_epoch_resume import _weights
from tests.e2e.test_training_failures import still_running

pytestmark = pytest.mark.e2e

TRAIN = [
    *("train", "fashion-mnist", "--np", "2", "--epochs", "2", "--batch-size", "32"),
    *("--checkpoint-every", "5", "--augment"),
]
# Each kill point: the environment that makes the run stop there, the line that says it has.
POINTS: dict[str, tuple[dict[str, str], str]] = {
    "mid-epoch": ({}, r"step checkpoint: epoch 2 step [1-9]"),
    "trained": ({"SHARDFLOW_TEST_PAUSE_AT": "trained"}, r"paused at trained"),
    "evaluate": ({"SHARDFLOW_TEST_PAUSE_AT": "evaluate"}, r"paused at evaluate"),
    "commit": ({"SHARDFLOW_CATALOG_CRASH_AT": "moved"}, r"test accuracy"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, fashion_subset: Path) -> Path:
    """A home holding the subset's raw and processed versions, copied for every run."""
    home = tmp_path_factory.mktemp("base") / "home"
    for args in (
        ("ingest", "fashion-mnist", "--source", str(fashion_subset)),
        ("preprocess", "fashion-mnist", "--rank-multiple", "8"),
    ):
        done = _shardflow(home, *args)
        assert done.returncode == 0, done.stderr[-2000:]
    return home


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "SHARDFLOW_HOME": str(home), **(extra or {})}
    for hook in ("SHARDFLOW_TEST_PAUSE_AT", "SHARDFLOW_CATALOG_CRASH_AT"):
        if hook not in (extra or {}):
            env.pop(hook, None)
    return env


def _shardflow(home: Path, *args: str) -> Result:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "shardflow"), *args],
        capture_output=True,
        text=True,
        env=_env(home),
        timeout=900,
    )
    return Result(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def clean(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    home = tmp_path_factory.mktemp("clean") / "home"
    shutil.copytree(base, home)
    done = _shardflow(home, *TRAIN, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return home, done.json


def _kill_at(home: Path, point: str) -> list[str]:
    """Start the run, SIGKILL its process group where ``point`` says; return its stderr."""
    extra, marker = POINTS[point]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "shardflow"), *TRAIN, "--verbose"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_env(home, extra),
        start_new_session=True,
    )
    assert proc.stderr is not None
    command = psutil.Process(proc.pid)
    started: list[psutil.Process] = []
    lines = []
    for line in proc.stderr:
        lines.append(line)
        started = started or [p for p in command.children(recursive=True)]
        if re.search(marker, line):
            break
    else:
        proc.wait(timeout=60)  # the commit failpoint: the launcher killed itself
    started += [p for p in _children(command) if p not in started]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines[-30:])
    # Nothing of the killed run outlives it: horovodrun and the ranks stop with it.
    _gone, alive = psutil.wait_procs(started, timeout=60)
    assert still_running(alive) == [], alive
    return lines


def _children(command: psutil.Process) -> list[psutil.Process]:
    try:
        return command.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("point", list(POINTS))
def test_killed_then_resumed_ends_as_the_uninterrupted_run(
    base: Path,
    clean: tuple[Path, dict[str, object]],
    tmp_path: Path,
    point: str,
) -> None:
    clean_home, clean_result = clean
    home = tmp_path / "home"
    shutil.copytree(base, home)
    killed = _kill_at(home, point)
    catalog = Catalog(home / "catalog")
    assert "fashion-mnist-cnn" not in catalog.names(), "".join(killed[-20:])

    resumed = _shardflow(home, *TRAIN, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    result = resumed.json
    assert result["version"] == clean_result["version"]
    assert result["test_accuracy"] == clean_result["test_accuracy"]
    assert [m.version for m in catalog.versions("fashion-mnist-cnn")] == [result["version"]]
    assert catalog.verify() == []
    weights = _weights(home, result["version"])
    clean_weights = _weights(clean_home, str(clean_result["version"]))
    assert sorted(weights) == sorted(clean_weights) and clean_weights
    for name, array in clean_weights.items():
        assert np.allclose(weights[name], array, atol=1e-5), (point, name)
    if point != "mid-epoch":
        assert result["resumed_at"]["note"].endswith("nothing left to train"), result
