"""What is computed apart from where it runs: every TrainConfig field is part of the model
version's identity, no LaunchConfig field is, and the ids of model versions committed before
the two were split are unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from data_catalog.identity import version_id
from data_catalog.manifest import ParentRef
from training.config import IDENTITY_SINCE, LaunchConfig, TrainConfig

PARENT = ParentRef(name="fashion-mnist-processed", version="0123456789abcdef")


def model_id(config: TrainConfig) -> str:
    """The model version id of ``config`` on one processed version and one code version (the
    launcher adds the current code's: training.launcher.train)."""
    return version_id(
        name="fashion-mnist-cnn",
        kind="model",
        parents=[PARENT],
        sources=(),
        parameters=config.parameters(),
        code_version="pinned",
    )


# Computed on 4d1aaa5, where TrainConfig still held the launch fields (EXECUTION_ONLY).
PINNED = [
    (TrainConfig(model="cnn"), "d7ce3d89d8124450"),
    (
        TrainConfig(
            num_ranks=4,
            epochs=5,
            batch_size=64,
            model="dnn",
            learning_rate=0.002,
            warmup_epochs=0,
            seed=3,
            shuffle_buffer=100,
            backward_passes_per_step=2,
            compression="fp16",
            augment=True,
        ),
        "523cd7ccd0ca4726",
    ),
    (TrainConfig(model="cnn", sync="pairwise", average_every=4), "2fd705123841aa3c"),
    (
        TrainConfig(model="mobilenetv2", batch_size=32, model_stages=2, micro_batches=4),
        "48bf9a9dc1ba347e",
    ),
]


@pytest.mark.parametrize(("config", "expected"), PINNED)
def test_model_version_ids_of_earlier_configurations_are_unchanged(
    config: TrainConfig, expected: str
) -> None:
    assert model_id(config) == expected


# For each field: a valid configuration and the same with only that field changed.
BASE = TrainConfig(model="cnn")
CHANGED: dict[str, tuple[TrainConfig, dict[str, Any]]] = {
    "num_ranks": (BASE, {"num_ranks": 3}),
    "epochs": (BASE, {"epochs": 4}),
    "batch_size": (BASE, {"batch_size": 64}),
    "model": (BASE, {"model": "mobilenetv2"}),
    "learning_rate": (BASE, {"learning_rate": 0.002}),
    "warmup_epochs": (BASE, {"warmup_epochs": 0}),
    "seed": (BASE, {"seed": 1}),
    "shuffle_buffer": (BASE, {"shuffle_buffer": 1024}),
    "backward_passes_per_step": (BASE, {"backward_passes_per_step": 2}),
    "compression": (BASE, {"compression": "fp16"}),
    "sync": (BASE, {"sync": "pairwise"}),
    "average_every": (TrainConfig(model="cnn", sync="pairwise"), {"average_every": 2}),
    "augment": (BASE, {"augment": True}),
    "model_stages": (BASE, {"model_stages": 2}),
    "micro_batches": (TrainConfig(model="cnn", model_stages=2), {"micro_batches": 2}),
}


def test_every_train_config_field_is_tried() -> None:
    """A field added to TrainConfig needs a case here (and IDENTITY_SINCE, when model versions
    were committed before it)."""
    assert set(CHANGED) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(IDENTITY_SINCE) <= set(CHANGED)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_every_train_config_field_changes_the_model_version_id(field: str) -> None:
    base, change = CHANGED[field]
    assert list(change) == [field]
    assert model_id(dataclasses.replace(base, **change)) != model_id(base)


def test_no_launch_config_field_is_a_train_config_field() -> None:
    """Where and how the ranks run cannot reach the identity: TrainConfig has no such field."""
    launch = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert launch == {
        "hosts",
        "hostfile",
        "network_interface",
        "ssh_port",
        "ssh_identity_file",
        "disable_cache",
        "controller",
        "launcher",
        "spark_master",
        "resume",
        "checkpoint_every",
        "timeline",
        "threads_per_rank",
    }
    assert not launch & {f.name for f in dataclasses.fields(TrainConfig)}


def test_both_configs_are_frozen_and_keyword_only() -> None:
    for cls in (TrainConfig, LaunchConfig):
        with pytest.raises(TypeError):
            cls(2)  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().__setattr__("seed" if cls is TrainConfig else "resume", 1)


def test_a_seed_no_rank_can_set_is_refused_here() -> None:
    """Issue #29 item 18: 2**32 passed validation, then failed inside every rank."""
    from data_catalog.errors import ConfigError

    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ConfigError, match="seed must be at most 4294967295"):
        TrainConfig(seed=2**32)


def test_spark_launcher_takes_a_master_url_and_refuses_what_spark_decides() -> None:
    from data_catalog.errors import ConfigError
    from training.config import check_launch

    for master in (None, "local", "local[4]", "local[*]", "spark://h1:7077,h2:7077"):
        assert LaunchConfig(launcher="spark", spark_master=master).spark_master == master
    with pytest.raises(ConfigError, match="must be a Spark master URL"):
        LaunchConfig(launcher="spark", spark_master="mesos://x")
    with pytest.raises(ConfigError, match="needs --launcher spark"):
        LaunchConfig(spark_master="local[2]")
    for refused in ({"hosts": "a:1"}, {"controller": "mpi"}, {"ssh_port": 2222}):
        with pytest.raises(ConfigError, match="not supported with --launcher spark"):
            LaunchConfig(launcher="spark", **refused)  # type: ignore[arg-type]
    # A local master with fewer slots than ranks would wait for tasks that never start.
    with pytest.raises(ConfigError, match="runs 1 task"):
        check_launch(TrainConfig(num_ranks=2), LaunchConfig(launcher="spark", spark_master="local"))
    check_launch(TrainConfig(num_ranks=2), LaunchConfig(launcher="spark", spark_master="local[2]"))
