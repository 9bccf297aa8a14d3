"""The launcher's pure parts: the horovodrun command line a configuration and launch give, and
the configurations' own checks (each bad field named, as the CLI shows it by its flag)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from data_catalog import Catalog
from data_catalog.errors import ConfigError, ShardflowError
from training.config import LaunchConfig, TrainConfig
from training.launcher import horovodrun_command, run_ranks, train

RUN_DIR = Path("/runs/fashion-mnist-cnn-0123456789abcdef")
WORKER = ["python3", "-m", "training.worker", f"{RUN_DIR}/worker.json"]


def command(num_ranks: int = 2, **fields: Any) -> list[str]:
    return horovodrun_command(
        TrainConfig(model="cnn", num_ranks=num_ranks),
        LaunchConfig(**fields),
        RUN_DIR,
        horovodrun="horovodrun",
        python="python3",
    )


def test_default_is_gloo_on_localhost_with_a_slot_per_rank() -> None:
    assert command() == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", *WORKER]
    assert command(num_ranks=5)[:5] == ["horovodrun", "-np", "5", "-H", "localhost:5"]


def test_hosts_are_passed_as_given() -> None:
    assert command(num_ranks=4, hosts="node1:2,node2:2") == [
        "horovodrun",
        "-np",
        "4",
        "-H",
        "node1:2,node2:2",
        "--gloo",
        *WORKER,
    ]


def test_a_hostfile_replaces_the_hosts() -> None:
    assert command(num_ranks=4, hostfile="/etc/hosts.txt") == [
        "horovodrun",
        "-np",
        "4",
        "--hostfile",
        "/etc/hosts.txt",
        "--gloo",
        *WORKER,
    ]


def test_mpi_controller_replaces_gloo() -> None:
    line = command(controller="mpi")
    assert "--mpi" in line
    assert "--gloo" not in line


def test_timeline_goes_into_the_run_directory() -> None:
    line = command(timeline=True)
    at = line.index("--timeline-filename")
    assert line[at + 1] == str(RUN_DIR / "timeline.json")
    assert line[at + 2 :] == WORKER  # horovodrun's options, then the program
    assert "--timeline-filename" not in command()


def test_mpi_controller_needs_horovod_built_with_mpi(tmp_path: Path) -> None:
    import horovod.tensorflow as hvd

    if hvd.mpi_built():
        pytest.skip("this Horovod has MPI")
    with pytest.raises(ShardflowError, match="built without MPI; use --controller gloo"):
        run_ranks(
            TrainConfig(model="cnn"), LaunchConfig(controller="mpi"), tmp_path, lambda _m: None
        )


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"num_ranks": 0}, "num_ranks", "must be at least 1, got 0"),
        ({"epochs": -1}, "epochs", "must be at least 1, got -1"),
        ({"batch_size": 0}, "batch_size", "must be at least 1, got 0"),
        ({"batch_size": 2.5}, "batch_size", "must be a whole number, got 2.5"),
        ({"num_ranks": True}, "num_ranks", "must be a whole number, got True"),
        ({"warmup_epochs": -1}, "warmup_epochs", "must be at least 0, got -1"),
        ({"seed": -3}, "seed", "must be at least 0, got -3"),
        ({"shuffle_buffer": 0}, "shuffle_buffer", "must be at least 1, got 0"),
        (
            {"backward_passes_per_step": 0},
            "backward_passes_per_step",
            "must be at least 1, got 0",
        ),
        ({"learning_rate": 0.0}, "learning_rate", "must be a positive finite number, got 0.0"),
        ({"learning_rate": -0.1}, "learning_rate", "must be a positive finite number, got -0.1"),
        ({"learning_rate": math.nan}, "learning_rate", "must be a positive finite number, got nan"),
        ({"learning_rate": math.inf}, "learning_rate", "must be a positive finite number, got inf"),
        (
            {"model": "vgg"},
            "model",
            "must be one of cnn, mobilenetv2, resnet50, dnn, got 'vgg'",
        ),
        ({"compression": "zip"}, "compression", "must be one of none, fp16, got 'zip'"),
    ],
)
def test_a_bad_field_is_named(fields: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        TrainConfig(**fields)
    assert (raised.value.field, raised.value.problem) == (field, problem)
    assert str(raised.value) == f"{field} {problem}"


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"controller": "nccl"}, "controller", "must be one of gloo, mpi, got 'nccl'"),
        (
            {"hosts": "a:1", "hostfile": "hosts.txt"},
            "hostfile",
            "cannot be given with hosts: give one of the two",
        ),
        ({"checkpoint_every": -1}, "checkpoint_every", "must be at least 0, got -1"),
        ({"threads_per_rank": -1}, "threads_per_rank", "must be at least 0, got -1"),
        ({"threads_per_rank": 1.0}, "threads_per_rank", "must be a whole number, got 1.0"),
        ({"ssh_port": 0}, "ssh_port", "must be a port number 1-65535, got 0"),
        (
            {"network_interface": "eth0; rm"},
            "network_interface",
            "must be interface names such as eth0 (comma-separated), got 'eth0; rm'",
        ),
    ],
)
def test_a_bad_launch_field_is_named(fields: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        LaunchConfig(**fields)
    assert (raised.value.field, raised.value.problem) == (field, problem)


def test_the_defaults_are_valid_and_leave_the_model_to_the_dataset() -> None:
    assert TrainConfig().model is None
    # An int rate is the same rate, with the identity of the float the CLI passes (as JSON,
    # where 1 and 1.0 differ).
    as_int = json.dumps(TrainConfig(model="cnn", learning_rate=1).parameters())
    assert as_int == json.dumps(TrainConfig(model="cnn", learning_rate=1.0).parameters())


def test_the_identity_is_the_fields_that_change_what_is_computed() -> None:
    """The parameters a model version's id derives from; a change here changes every id."""
    config = TrainConfig(model="cnn", augment=True)
    assert config.parameters() == {
        "num_ranks": 2,
        "epochs": 3,
        "batch_size": 32,
        "model": "cnn",
        "learning_rate": 0.001,
        "warmup_epochs": 1,
        "seed": 0,
        "shuffle_buffer": 4096,
        "backward_passes_per_step": 1,
        "compression": "none",
        "augment": True,
    }


def test_fields_added_later_join_the_identity_only_off_their_default() -> None:
    """Model versions committed before sync/model stages existed keep their ids."""
    assert "model_stages" not in TrainConfig(model="cnn").parameters()
    hybrid = TrainConfig(model="cnn", model_stages=2, micro_batches=4).parameters()
    assert (hybrid["model_stages"], hybrid["micro_batches"]) == (2, 4)
    gossip = TrainConfig(model="cnn", sync="pairwise", average_every=2).parameters()
    assert (gossip["sync"], gossip["average_every"]) == ("pairwise", 2)


def test_train_refuses_an_unresolved_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resolve the dataset's default model"):
        train(
            Catalog(tmp_path / "catalog"),
            "fashion-mnist",
            config=TrainConfig(),
            launch=LaunchConfig(),
            runs_dir=tmp_path,
        )


# --- the one line of a failed run (issue #29 item 20) ----------------------------------------

HOROVOD_END = [
    "RuntimeError: Horovod detected that one or more processes exited with non-zero status, "
    "thus causing the job to be terminated. The first process to do so was:",
    "Process name: 0",
    "Exit code: 1",
]
GLOO_TIMEOUT = (
    "[0]<stderr>:[2026-11-26 09:47:36: E horovod/common/operations.cc:697] [0]: Horovod "
    "background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
    "waiting 30000ms for recv operation to complete"
)


def test_a_rank_that_timed_out_waiting_is_not_blamed() -> None:
    from training.launcher import _failure_message

    tail = [
        GLOO_TIMEOUT,
        "[0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: Graph execution error:",
        *HOROVOD_END,
    ]
    blamed = _failure_message(1, tail, [1])
    assert blamed.startswith("training stopped: rank 1 was stopped (SIGSTOP or a debugger)")
    assert "rank 0 gave up waiting for it after 30 s" in blamed
    unknown = _failure_message(1, tail, [])
    assert unknown.startswith("training stopped: a rank stopped answering")
    assert "rank 0 ended" not in blamed + unknown


def test_a_killed_horovodrun_is_said_so_not_a_warning_line() -> None:
    from training.launcher import _failure_message

    tail = ["[1]<stderr>:  warnings.warn("]
    message = _failure_message(-9, tail, [])
    assert message.startswith("horovodrun was killed (SIGKILL)"), message
    assert "warnings.warn" not in message


def test_a_ranks_own_error_is_its_cause() -> None:
    from training.launcher import _failure_message

    tail = ["[0]<stderr>:Traceback (most recent call last):", "[0]<stderr>:KeyError: 'loss'"]
    message = _failure_message(1, [*tail, *HOROVOD_END], [])
    assert message.startswith("training stopped: rank 0 ended with exit code 1 (KeyError: 'loss')")


def test_a_failed_spark_run_is_its_one_line_and_names_spark() -> None:
    from training.launcher import _failure_message
    from training.spark import FAILURE_PREFIX

    tail = ["26/11/26 WARN something", f"{FAILURE_PREFIX}Exception: Spark job has failed"]
    message = _failure_message(1, tail, [], "Horovod's Spark runner")
    assert message == "Horovod's Spark runner failed: Exception: Spark job has failed"
    rank = [f"{FAILURE_PREFIX}RuntimeError: Horovod detected ... Process name: 1 Exit code: 3"]
    message = _failure_message(1, rank, [], "Horovod's Spark runner")
    assert message.startswith("training stopped: rank 1 ended with exit code 3 and Horovod's")
