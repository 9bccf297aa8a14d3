"""`flows.options.command_line`: the flags that give a TrainConfig and a LaunchConfig back, as
the experiments hand them to `shardflow train` on namespaced hosts; the launch flags are the
ones they always were."""

from __future__ import annotations

import pytest

from data_catalog.errors import ConfigError
from flows.cli import build_parser
from flows.options import build, command_line, flag_for, flags_of
from training.config import LaunchConfig, TrainConfig

CONFIGS = [
    (TrainConfig(), LaunchConfig()),
    (
        TrainConfig(num_ranks=3, epochs=1, batch_size=16, model="cnn", learning_rate=0.002),
        LaunchConfig(),
    ),
    (
        TrainConfig(num_ranks=2, backward_passes_per_step=2, compression="fp16", augment=True),
        LaunchConfig(
            hosts="w1:1,w2:1",
            network_interface="eth0",
            ssh_port=2222,
            ssh_identity_file="/tmp/id",
            disable_cache=True,
            resume=True,
            checkpoint_every=10,
            timeline=True,
            threads_per_rank=1,
        ),
    ),
    (TrainConfig(), LaunchConfig(hostfile="/tmp/hosts", controller="mpi")),
    (TrainConfig(), LaunchConfig(launcher="spark", spark_master="spark://master:7077")),
]


@pytest.mark.parametrize(("config", "launch"), CONFIGS)
def test_the_flags_give_the_configs_back(config: TrainConfig, launch: LaunchConfig) -> None:
    flags = [*command_line(config, "train"), *command_line(launch, "launch")]
    args = build_parser().parse_args(["train", "mnist", *flags])
    assert build(TrainConfig, args, "train", environ={}) == config
    assert build(LaunchConfig, args, "launch", environ={}) == launch


def test_a_default_config_needs_no_flags() -> None:
    assert command_line(TrainConfig(), "train") == []
    assert command_line(LaunchConfig(), "launch") == []


def test_the_launch_flags_are_the_ones_train_always_had() -> None:
    flags = {flag.field: flag.flag for flag in flags_of("launch")}
    assert flags == {
        "hosts": "--hosts",
        "hostfile": "--hostfile",
        "network_interface": "--network-interface",
        "ssh_port": "--ssh-port",
        "ssh_identity_file": "--ssh-identity-file",
        "disable_cache": "--disable-cache",
        "controller": "--controller",
        "launcher": "--launcher",
        "spark_master": "--spark-master",
        "resume": "--resume",
        "checkpoint_every": "--checkpoint-every",
        "timeline": "--timeline",
        "threads_per_rank": "--threads-per-rank",
    }
    for command in ("train", "run"):
        text = build_parser().parse_args([command, "mnist"])
        assert all(hasattr(text, field) for field in flags)
    assert flag_for("checkpoint_every") == "--checkpoint-every"


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--model-stages", "2", "--resume"], "resume"),
        (["--model-stages", "2", "--checkpoint-every", "5"], "checkpoint_every"),
    ],
)
def test_a_launch_the_config_cannot_take_is_refused_by_its_flag(
    argv: list[str], field: str
) -> None:
    from flows.commands.stages import _train_configs

    args = build_parser().parse_args(["train", "cifar10", *argv])
    with pytest.raises(ConfigError) as raised:
        _train_configs(args)
    assert raised.value.field == field


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "cifar10", "--epochs=--"], "--epochs needs a value (got '--')"),
        (["preprocess", "cifar10", "--validation-fraction=--"], "--validation-fraction needs"),
        (["ingest", "sdss", "--source=--"], "--source needs a value (got '--')"),
        (["bench", "storage", "fashion-mnist", "--grown-dir=--"], "--grown-dir needs a value"),
    ],
)
def test_a_value_of_two_dashes_is_a_one_line_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """CPython 3.11's argparse hands '--' over as an empty list, past the flag's type."""
    from flows.cli import main

    assert main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"shardflow: error: {message}"), line


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "expected a number of seconds above 0, got '0'"),
        ("-5", "expected a number of seconds above 0, got '-5'"),
        ("soon", "expected a number, got 'soon'"),
        ("inf", "expected a finite number, got 'inf'"),
    ],
)
def test_a_train_timeout_that_is_not_a_duration_is_a_one_line_error(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["run", "fashion-mnist", f"--train-timeout={value}"])
    assert exited.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shardflow run: error: argument --train-timeout: " + message), line


def test_a_train_timeout_reaches_the_pipeline_as_seconds() -> None:
    args = build_parser().parse_args(["run", "sdss", "--train-timeout", "5400"])
    assert args.train_timeout == 5400.0
    assert build_parser().parse_args(["run", "sdss"]).train_timeout is None
