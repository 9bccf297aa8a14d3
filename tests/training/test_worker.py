"""What the launcher hands every rank: the user's TrainConfig, nested, through JSON and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import TrainConfig
from training.worker import WorkerConfig


def worker_config(train: TrainConfig) -> WorkerConfig:
    return WorkerConfig(
        train=train,
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


def test_json_round_trip_keeps_the_nested_config(tmp_path: Path) -> None:
    config = worker_config(
        TrainConfig(num_ranks=4, epochs=5, model="cnn", learning_rate=0.01, hosts="a:2,b:2")
    )
    config.dump(tmp_path / "worker.json")
    assert json.loads((tmp_path / "worker.json").read_text())["train"]["hosts"] == "a:2,b:2"
    loaded = WorkerConfig.load(tmp_path / "worker.json")
    assert loaded == config
    assert isinstance(loaded.train, TrainConfig)


def test_a_rank_needs_a_resolved_model() -> None:
    with pytest.raises(ValueError, match="resolve the model first"):
        worker_config(TrainConfig())
