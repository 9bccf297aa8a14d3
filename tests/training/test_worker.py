"""What the launcher hands every rank: the user's TrainConfig and LaunchConfig, nested, through
JSON and back; and what the rank does first with the launch (one core for threads_per_rank 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

from training import worker
from training.config import LaunchConfig, TrainConfig
from training.rank import setup
from training.rank.config import WorkerConfig


def worker_config(train: TrainConfig, launch: LaunchConfig | None = None) -> WorkerConfig:
    return WorkerConfig(
        train=train,
        launch=launch or LaunchConfig(),
        train_url="file:///catalog/fashion-mnist-processed/v/train",
        test_dir="/catalog/fashion-mnist-processed/v/test",
        run_dir="/runs/fashion-mnist-cnn-v",
        spec={"kind": "images", "format": "parquet", "image_shape": [28, 28, 1]},
        num_classes=10,
        steps_per_epoch=892,
        mean=[0.286],
        std=[0.353],
        validation_dir="/catalog/fashion-mnist-processed/v/validation",
    )


def test_json_round_trip_keeps_the_nested_configs(tmp_path: Path) -> None:
    config = worker_config(
        TrainConfig(num_ranks=4, epochs=5, model="cnn", learning_rate=0.01),
        LaunchConfig(hosts="a:2,b:2", threads_per_rank=1, checkpoint_every=50),
    )
    config.dump(tmp_path / "worker.json")
    written = json.loads((tmp_path / "worker.json").read_text())
    assert written["launch"]["hosts"] == "a:2,b:2"
    assert "hosts" not in written["train"]
    loaded = WorkerConfig.load(tmp_path / "worker.json")
    assert loaded == config
    assert isinstance(loaded.train, TrainConfig)
    assert isinstance(loaded.launch, LaunchConfig)


def test_a_worker_json_from_before_the_launch_config_is_read(tmp_path: Path) -> None:
    """The launcher reads the worker.json of earlier runs when it looks for a step checkpoint
    of the same configuration on another rank count: then the launch fields sat in "train"."""
    config = worker_config(
        TrainConfig(num_ranks=4, model="cnn"), LaunchConfig(hosts="a:2,b:2", resume=True)
    )
    old = asdict(config)
    old["train"] |= old.pop("launch")
    old["threads_per_rank"] = 0
    (tmp_path / "worker.json").write_text(json.dumps(old))
    assert WorkerConfig.load(tmp_path / "worker.json") == config


def test_a_rank_needs_a_resolved_model() -> None:
    with pytest.raises(ValueError, match="resolve the model first"):
        worker_config(TrainConfig())


class _Started(Exception):
    """Raised where Horovod would start: the rank's set-up before it is done."""


@pytest.mark.parametrize(("threads_per_rank", "pinned"), [(0, False), (1, True), (2, False)])
def test_threads_per_rank_1_pins_the_rank_before_horovod_starts(
    monkeypatch: pytest.MonkeyPatch, threads_per_rank: int, pinned: bool
) -> None:
    """The one home of threads_per_rank: 1 pins every rank to one core (train and the bench
    alike), before any thread starts."""
    calls: list[str] = []
    monkeypatch.setattr(setup, "pin_to_one_core", lambda: calls.append("pin"))

    def init_horovod(_train: TrainConfig) -> setup.World:
        calls.append("horovod")
        raise _Started

    monkeypatch.setattr(setup, "init_horovod", init_horovod)
    launch = LaunchConfig(threads_per_rank=threads_per_rank)
    with pytest.raises(_Started):
        worker.run(worker_config(TrainConfig(model="cnn"), launch))
    assert calls == (["pin", "horovod"] if pinned else ["horovod"])


PIN = textwrap.dedent(
    """
    import os, sys
    from training.rank.setup import pin_to_one_core
    core = pin_to_one_core({"HOROVOD_RANK": sys.argv[1]})
    print(core, sorted(os.sched_getaffinity(0)))
    """
)


@pytest.mark.parametrize("rank", [0, 1, 5])
def test_pin_to_one_core_gives_rank_r_core_r_mod_the_cores(rank: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", PIN, str(rank)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    expected = cores[rank % len(cores)]
    assert done.stdout.split(maxsplit=1) == [str(expected), f"[{expected}]\n"]
