"""A rank killed mid-epoch, resumed from the last step checkpoint: the resumed run feeds exactly
the batches an uninterrupted run fed from that step, and ends with its weights (random shifts
included)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from data_catalog import Catalog
from tests.conftest import Result
from tests.e2e.test_training_failures import still_running, worker_ranks
from training import checkpoints

pytestmark = pytest.mark.e2e

TRAIN = [
    "train",
    "fashion-mnist",
    "--np",
    "2",
    "--epochs",
    "2",
    "--batch-size",
    "8",
    "--checkpoint-every",
    "5",
    # Random shifts: their generator's counter is saved, so the resume stays exact.
    "--augment",
]


def _weights(home: Path, version: str) -> dict[str, Any]:
    """The committed model's weight arrays by name."""
    import h5py

    catalog = Catalog(home / "catalog")
    manifest = catalog.get("fashion-mnist-cnn", version)
    keras = catalog.file_path(manifest, next(f for f in manifest.files if f.path == "model.keras"))
    arrays: dict[str, Any] = {}
    with zipfile.ZipFile(keras) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")

    def keep(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            arrays[name] = item[()]

    with weights:
        weights.visititems(keep)
    return arrays


def _fed(run_dir: Path, rank: int) -> dict[tuple[int, int], list[str]]:
    """{(epoch from 0, step): row ids} of every batch ``rank`` fed (the last record wins)."""
    fed = {}
    for line in (run_dir / f"rows-rank-{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        fed[record["epoch"], record["step"]] = record["rows"]
    return fed


def test_killed_mid_epoch_resumes_with_the_uninterrupted_batches_and_weights(
    shardflow: Callable[..., Result],
    fashion_home: Path,
    shardflow_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fashion_home: the subset ingested and preprocessed, in shardflow_home.
    clean_home = tmp_path / "clean-home"
    shutil.copytree(shardflow_home, clean_home)
    monkeypatch.setenv("SHARDFLOW_TEST_RECORD_ROWS", "1")

    clean = shardflow(*TRAIN, "--json", home=clean_home)
    assert clean.returncode == 0, clean.stderr[-3000:]
    clean_result = clean.json
    steps = clean_result["steps_per_epoch"]
    clean_dir = Path(clean_result["run_dir"])

    env = {
        **os.environ,
        "SHARDFLOW_HOME": str(shardflow_home),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    executable = Path(sys.executable).parent / "shardflow"
    proc = subprocess.Popen(
        [str(executable), *TRAIN, "--verbose"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        # The first checkpoint inside epoch 2 (step 0 is the end of epoch 1).
        if re.search(r"step checkpoint: epoch 2 step [1-9]", line):
            break
    else:
        pytest.fail("no step checkpoint in epoch 2:\n" + "".join(lines[-20:]))
    command = psutil.Process(proc.pid)
    ranks = worker_ranks(command)
    assert len(ranks) == 2
    started = command.children(recursive=True)
    ranks[-1].send_signal(signal.SIGKILL)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, rest[-2000:]
    assert still_running(started) == []

    run_dir = shardflow_home / "runs" / clean_dir.name  # the same version, another home
    saved = checkpoints.load(run_dir / "checkpoints" / checkpoints.STEP_CHECKPOINT)
    position = saved.position
    assert len(saved.random_counters) == 1  # RandomTranslation's
    assert position.epoch == 1 and 0 < position.step < steps, position
    assert position.global_step % 5 == 0 and position.num_ranks == 2
    # What the killed run fed is not what is compared: only the resumed run's batches.
    for rank in range(2):
        (run_dir / f"rows-rank-{rank}.jsonl").unlink()
    # The same state, resumed on one rank below.
    one_rank_home = tmp_path / "one-rank-home"
    shutil.copytree(shardflow_home, one_rank_home)

    resumed = shardflow(*TRAIN, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = resumed.json
    assert result["version"] == clean_result["version"]
    assert result["resumed_at"]["epoch"] == 2
    assert result["resumed_at"]["step"] == position.step

    compared = 0
    for rank in range(2):
        fed, clean_fed = _fed(run_dir, rank), _fed(clean_dir, rank)
        expected = {(1, s) for s in range(position.step, steps)}
        assert set(fed) == expected, sorted(set(fed) ^ expected)[:5]
        for key in sorted(fed):
            assert fed[key] == clean_fed[key], (rank, key)
            compared += 1
    resumed_weights = _weights(shardflow_home, result["version"])
    clean_weights = _weights(clean_home, clean_result["version"])
    assert sorted(resumed_weights) == sorted(clean_weights) and clean_weights
    difference = max(
        float(np.max(np.abs(resumed_weights[n] - clean_weights[n]))) for n in clean_weights
    )
    print(
        f"\nkilled after epoch 2 step {position.step} of {steps}; {compared} batches compared; "
        f"max weight difference {difference:.3g}"
    )
    for name, array in clean_weights.items():
        assert np.allclose(resumed_weights[name], array, atol=1e-5), name

    # On one rank: the rest of epoch 2, every remaining sample once, in the 2-rank run's global
    # order (its step s of rank 0, then of rank 1, then step s + 1 ...).
    one = shardflow(*TRAIN, "--np", "1", "--resume", "--json", home=one_rank_home)
    assert one.returncode == 0, one.stderr[-3000:]
    one_result = one.json
    assert one_result["num_ranks"] == 1
    assert "on 1 ranks" in one_result["resumed_at"]["note"]
    one_fed = _fed(Path(one_result["run_dir"]), 0)
    clean_by_rank = [_fed(clean_dir, rank) for rank in range(2)]
    expected_order = [
        clean_by_rank[rank][1, s] for s in range(position.step, steps) for rank in range(2)
    ]
    fed_order = [one_fed[key] for key in sorted(one_fed) if key[0] == 1]
    assert fed_order == expected_order
    remaining = [row for batch in expected_order for row in batch]
    fed_rows = [row for batch in fed_order for row in batch]
    assert len(fed_rows) == len(set(fed_rows)) == len(remaining)
    print(f"one rank fed the {len(fed_rows)} remaining rows of epoch 2 once each")
