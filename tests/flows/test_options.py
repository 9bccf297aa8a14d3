"""`flows.options.command_line`: the flags that give a TrainConfig back, as the experiments
hand a config to `shardflow train` on namespaced hosts."""

from __future__ import annotations

import pytest

from flows.cli import build_parser
from flows.options import build, command_line
from training.config import TrainConfig

CONFIGS = [
    TrainConfig(),
    TrainConfig(num_ranks=3, epochs=1, batch_size=16, model="cnn", learning_rate=0.002),
    TrainConfig(
        num_ranks=2,
        hosts="w1:1,w2:1",
        network_interface="eth0",
        ssh_port=2222,
        ssh_identity_file="/tmp/id",
        disable_cache=True,
        backward_passes_per_step=2,
        compression="fp16",
        augment=True,
    ),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_flags_give_the_config_back(config: TrainConfig) -> None:
    args = build_parser().parse_args(["train", "mnist", *command_line(config, "train")])
    assert build(TrainConfig, args, "train", environ={}) == config


def test_a_default_config_needs_no_flags() -> None:
    assert command_line(TrainConfig(), "train") == []
