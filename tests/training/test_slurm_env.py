"""`--launcher slurm`: the allocation's environment, as sbatch and salloc set it, into
horovodrun's `-H` (training.slurm), and the command line it makes (training.launcher)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from data_catalog.errors import ConfigError, ShardflowError
from preprocessing.config import ClusterConfig
from training.config import LaunchConfig, TrainConfig
from training.launcher import horovodrun_command
from training.slurm import (
    allocation_hosts,
    allocation_num_ranks,
    default_num_ranks,
    horovodrun_hosts,
    tasks_per_node,
)


def _expand(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` for the lists these tests use."""
    known = {
        "vm": ["vm"],
        "node[01-03],gpu7": ["node01", "node02", "node03", "gpu7"],
        "c[1-2]": ["c1", "c2"],
    }
    return known[nodelist]


def _allocation(**env: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "42", **env}


@pytest.mark.parametrize(
    ("value", "counts"),
    [
        ("2", [2]),
        ("1(x2)", [1, 1]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4,2(x2),1(x1)", [4, 2, 2, 1]),
        ("16(x128)", [16] * 128),
    ],
)
def test_tasks_per_node_expands_slurms_counts(value: str, counts: list[int]) -> None:
    assert tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2x3", "2(x)", "(x2)", "2(x3)1", "a"])
def test_tasks_per_node_refuses_other_forms(value: str) -> None:
    with pytest.raises(ShardflowError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node(value)


def test_allocation_hosts_pairs_each_node_with_its_tasks() -> None:
    environ = _allocation(
        SLURM_JOB_NODELIST="node[01-03],gpu7", SLURM_TASKS_PER_NODE="2(x3),1", SLURM_NTASKS="7"
    )
    assert allocation_hosts(environ, hostnames=_expand) == "node01:2,node02:2,node03:2,gpu7:1"


def test_allocation_hosts_without_ntasks_and_with_the_old_nodelist_name() -> None:
    # sbatch -N 2 alone sets no SLURM_NTASKS; SLURM_NODELIST is the older name of the list.
    environ = _allocation(SLURM_NODELIST="c[1-2]", SLURM_TASKS_PER_NODE="1(x2)")
    assert allocation_hosts(environ, hostnames=_expand) == "c1:1,c2:1"


def test_outside_an_allocation_is_refused_in_one_line() -> None:
    with pytest.raises(ShardflowError) as raised:
        allocation_hosts({"SLURM_TASKS_PER_NODE": "2"}, hostnames=_expand)
    assert str(raised.value) == (
        "--launcher slurm runs inside a SLURM allocation (sbatch/salloc): SLURM_JOB_ID is not set"
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (_allocation(SLURM_TASKS_PER_NODE="2"), "SLURM_JOB_NODELIST"),
        (_allocation(SLURM_JOB_NODELIST="c[1-2]", SLURM_TASKS_PER_NODE="2"), "2 nodes"),
        (
            _allocation(SLURM_JOB_NODELIST="vm", SLURM_TASKS_PER_NODE="2", SLURM_NTASKS="3"),
            "SLURM_NTASKS=3",
        ),
    ],
)
def test_inconsistent_allocations_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ShardflowError, match=message):
        allocation_hosts(environ, hostnames=_expand)


def test_more_ranks_than_tasks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.slurm.scontrol_hostnames", _expand)
    environ = _allocation(SLURM_JOB_NODELIST="vm", SLURM_TASKS_PER_NODE="2", SLURM_NTASKS="2")
    assert horovodrun_hosts(2, environ) == "vm:2"
    with pytest.raises(ShardflowError, match=r"--np 4 is more than the 2 task\(s\)"):
        horovodrun_hosts(4, environ)


def test_horovodrun_command_takes_the_allocations_hosts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("training.slurm.scontrol_hostnames", _expand)
    for name, value in _allocation(
        SLURM_JOB_NODELIST="c[1-2]", SLURM_TASKS_PER_NODE="2(x2)", SLURM_NTASKS="4"
    ).items():
        monkeypatch.setenv(name, value)
    command = horovodrun_command(
        TrainConfig(num_ranks=4), LaunchConfig(launcher="slurm"), tmp_path, python="python"
    )
    assert command[:5] == ["horovodrun", "-np", "4", "-H", "c1:2,c2:2"]


@pytest.mark.parametrize(
    ("environ", "num_ranks"),
    [
        (_allocation(SLURM_NTASKS="7", SLURM_TASKS_PER_NODE="2(x3),1"), 7),
        # SLURM_NPROCS is the older name of the count.
        (_allocation(SLURM_NPROCS="3", SLURM_TASKS_PER_NODE="3"), 3),
        # sbatch -N 2 alone sets no count: one task per node.
        (_allocation(SLURM_TASKS_PER_NODE="1(x2)"), 2),
        ({"SLURM_NTASKS": "7"}, None),  # no SLURM_JOB_ID: not inside an allocation
        ({}, None),
    ],
)
def test_allocation_num_ranks(environ: dict[str, str], num_ranks: int | None) -> None:
    assert allocation_num_ranks(environ) == num_ranks


def test_a_task_count_that_is_no_number_is_refused() -> None:
    with pytest.raises(ShardflowError, match="SLURM_NTASKS='x' is not a task count"):
        allocation_num_ranks(_allocation(SLURM_NTASKS="x"))


def test_np_defaults_to_the_task_count_only_with_the_slurm_launcher() -> None:
    environ = _allocation(SLURM_NTASKS="6", SLURM_TASKS_PER_NODE="3(x2)")
    assert default_num_ranks("slurm", environ) == 6
    assert default_num_ranks("horovodrun", environ) is None
    assert default_num_ranks(None, environ) is None


def _train_config(environ: dict[str, str], *argv: str) -> TrainConfig:
    """TrainConfig as `shardflow train fashion-mnist ARGV` builds it in ``environ``."""
    from flows import options
    from flows.cli import build_parser

    args = build_parser().parse_args(["train", "fashion-mnist", *argv])
    return options.build(TrainConfig, args, "train", environ=environ)


def test_train_np_defaults_to_the_allocations_tasks() -> None:
    inside = _allocation(SLURM_JOB_NODELIST="c[1-2]", SLURM_TASKS_PER_NODE="3(x2)",
                         SLURM_NTASKS="6")  # fmt: skip
    default = TrainConfig().num_ranks
    assert default != 6
    assert _train_config(inside, "--launcher", "slurm").num_ranks == 6
    # Given, --np wins; another launcher, or outside an allocation, keeps the usual default.
    assert _train_config(inside, "--launcher", "slurm", "--np", "2").num_ranks == 2
    assert _train_config(inside).num_ranks == default
    assert _train_config({}, "--launcher", "slurm").num_ranks == default
    assert _train_config({}).num_ranks == default
    assert _train_config({}, "--np", "3").num_ranks == 3


def test_run_np_defaults_to_the_allocations_tasks() -> None:
    from flows import options
    from flows.cli import build_parser

    args = build_parser().parse_args(["run", "fashion-mnist", "--launcher", "slurm"])
    environ = _allocation(SLURM_NPROCS="4", SLURM_TASKS_PER_NODE="4")
    assert options.build(TrainConfig, args, "train", environ=environ).num_ranks == 4


def test_the_launcher_is_not_part_of_the_model_version() -> None:
    assert "launcher" not in {f.name for f in dataclasses.fields(TrainConfig)}
    assert LaunchConfig(launcher="slurm").launcher == "slurm"


def test_launcher_slurm_takes_no_hosts() -> None:
    with pytest.raises(ConfigError, match="allocation"):
        LaunchConfig(launcher="slurm", hosts="a:1")
    with pytest.raises(ConfigError):
        LaunchConfig(launcher="srun")


@pytest.mark.parametrize(
    "fields",
    [
        {"cluster": "pbs"},
        {"cluster": "slurm", "scheduler": "tcp://10.0.0.5:8786"},
        {"cluster": "slurm", "slurm_walltime": "1 hour"},
        {"cluster": "slurm", "slurm_partition": "a b"},
        {"cluster": "slurm", "slurm_start_timeout": 0},
        {"cluster": "slurm", "slurm_interface": "eth0; rm"},
    ],
)
def test_cluster_config_refuses_bad_slurm_settings(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ClusterConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("walltime", ["30", "00:30", "01:00:00", "2-00", "2-00:30:00"])
def test_cluster_config_takes_sbatchs_time_forms(walltime: str) -> None:
    assert ClusterConfig(cluster="slurm", slurm_walltime=walltime).slurm_walltime == walltime
