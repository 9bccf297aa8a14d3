"""Issue #29 (hardening, round 3), as a hostile user or a careless operator meets it: real
`shardflow` processes, two at once, servers that stop answering, damaged inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from data_catalog import Catalog
from preprocessing.sources import mnist
from tests.conftest import Result

pytestmark = pytest.mark.e2e

SHARDFLOW = Path(sys.executable).parent / "shardflow"


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
