"""`shardflow train` checks its input and its outcome, as a user runs it: a flipped byte in a
training shard or a hand-edited manifest is refused in one line before any rank starts
(`catalog verify` names the damage), and a run that diverged commits no model."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result, copy_home

pytestmark = pytest.mark.e2e

TRAIN = ("train", "fashion-mnist", "--np", "2", "--epochs", "1", "--batch-size", "8")


@pytest.fixture(scope="module")
def processed_home(fashion_processed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SHARDFLOW_HOME with 2,000 real Fashion-MNIST images ingested and preprocessed (the
    session's, copied)."""
    return copy_home(fashion_processed, tmp_path_factory.mktemp("processed") / "home")


@pytest.fixture
def home(processed_home: Path, shardflow_home: Path) -> Path:
    """This test's copy of the processed home (the ``shardflow`` fixture runs in it)."""
    return Path(shutil.copytree(processed_home, shardflow_home))


def processed_dir(home: Path) -> Path:
    (manifest,) = (home / "catalog" / "datasets" / "fashion-mnist-processed").glob(
        "*/_manifest.json"
    )
    return manifest.parent


def error_lines(result: Result) -> list[str]:
    return result.stderr.splitlines()


def kinds(shardflow: Callable[..., Result]) -> set[str]:
    return {d["kind"] for d in shardflow("catalog", "list", "--json").json["datasets"]}


def test_a_flipped_byte_in_a_train_shard_stops_train_before_any_rank(
    shardflow: Callable[..., Result], home: Path
) -> None:
    (shard,) = (processed_dir(home) / "split=train").glob("*.parquet")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    verify = shardflow("catalog", "verify")
    assert verify.returncode == 1
    assert f"{shard}: sha256 mismatch" in verify.stderr

    result = shardflow(*TRAIN)
    assert result.returncode == 1
    (line,) = error_lines(result)  # one line, no TensorFlow or Horovod output
    assert line.startswith("shardflow: error: ")
    assert f"{shard}: sha256 mismatch" in line
    assert "nothing was trained" in line
    # No rank started: the launcher writes the ranks' config into the run folder first.
    assert not (home / "runs").exists()
    verbose = shardflow(*TRAIN, "--verbose")
    assert verbose.returncode == 1
    assert "horovodrun" not in verbose.stderr
    assert kinds(shardflow) == {"raw", "processed"}


def edit_train_file_rows(manifest: dict[str, Any]) -> None:
    entry = next(f for f in manifest["files"] if f["path"].startswith("split=train/"))
    entry["rows"] -= 1


def edit_rows_per_group(manifest: dict[str, Any]) -> None:
    manifest["statistics"]["train"]["rows_per_group"] += 1


def edit_normalization_mean(manifest: dict[str, Any]) -> None:
    manifest["statistics"]["normalization"]["mean"][0] += 0.01


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (edit_train_file_rows, r"files\[split=train/part-00000\.parquet\]\.rows is 1855"),
        (edit_rows_per_group, r"statistics\.train\.rows_per_group is 30"),
        (edit_normalization_mean, r"statistics\.normalization\.mean\[0\] is 0\.2942"),
    ],
)
def test_a_hand_edited_manifest_is_named_by_verify_and_refused_by_train(
    shardflow: Callable[..., Result],
    home: Path,
    edit: Callable[[dict[str, Any]], None],
    field: str,
) -> None:
    path = processed_dir(home) / "_manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))

    verify = shardflow("catalog", "verify", "fashion-mnist-processed")
    assert verify.returncode == 1
    assert f"shardflow: verify: {path}: " in verify.stderr
    assert "edited after it was committed" in verify.stderr
    assert re.search(field, verify.stderr), verify.stderr

    result = shardflow(*TRAIN)
    assert result.returncode == 1
    (line,) = error_lines(result)
    assert line.startswith(f"shardflow: error: {path}: ")
    assert "edited after it was committed" in line
    assert not (home / "runs").exists()
    assert "fashion-mnist-cnn" not in shardflow("catalog", "list").stdout


def test_a_diverged_run_commits_no_model(shardflow: Callable[..., Result], home: Path) -> None:
    """A learning rate of 1e30 makes the loss NaN, or over a thousand times the first step's,
    at the second step on CPU (Adam moves every weight by about the rate; the logits overflow
    to NaN in some runs and not in others: both were seen)."""
    result = shardflow(*TRAIN, "--lr", "1e30")
    assert result.returncode == 1
    (line,) = error_lines(result)
    assert re.fullmatch(
        r"shardflow: error: training diverged at epoch 1 step \d+ \(loss (nan|inf|"
        r"\S+, over 1000 times the first step's \S+)\): "
        r"nothing committed; lower the learning rate \(--lr\)",
        line,
    ), line
    assert kinds(shardflow) == {"raw", "processed"}
    # The diverged epoch was not checkpointed, so the run folder went as after a failed launch.
    assert list((home / "runs").iterdir()) == []
