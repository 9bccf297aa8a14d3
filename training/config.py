"""What a user chooses about a training run.

:class:`TrainConfig` is frozen and keyword-only, validated at construction, and raises
:class:`~data_catalog.errors.ConfigError` naming the field (the CLI shows it as its flag).
Every field is part of the model version's identity except :data:`EXECUTION_ONLY`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from data_catalog.errors import ConfigError
from training.models import MODELS

COMPRESSIONS = ("none", "fp16")
CONTROLLERS = ("gloo", "mpi")
LAUNCHERS = ("horovodrun", "slurm")
# Fields that change how a run executes, not what it computes: not part of the version id.
EXECUTION_ONLY = (
    "hosts",
    "hostfile",
    "network_interface",
    "ssh_port",
    "ssh_identity_file",
    "disable_cache",
    "controller",
    "launcher",
    "resume",
    "checkpoint_every",
    "timeline",
    "threads_per_rank",
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train, and where the ranks run."""

    num_ranks: int = 2
    """Horovod ranks (``horovodrun -np``)."""
    epochs: int = 3
    """Passes over the training split."""
    batch_size: int = 32
    """Per rank; the global batch is ``batch_size * num_ranks``."""
    model: str | None = None
    """A name of :data:`training.models.MODELS`; None means the dataset's default model, which
    the caller resolves before :func:`training.launcher.train`."""
    learning_rate: float = 0.001
    """For one rank; scaled by the number of ranks."""
    warmup_epochs: int = 1
    """Epochs over which the scaled learning rate ramps up (at most ``epochs`` are used)."""
    seed: int = 0
    """Initial weights, the order of row groups and rows in every epoch."""
    shuffle_buffer: int = 4096
    """Rows a rank mixes at a time within its row groups."""
    backward_passes_per_step: int = 1
    """Local gradient aggregation: allreduce once every K batches."""
    compression: str = "none"
    """Allreduce compression: none or fp16."""
    augment: bool = False
    """Random shifts of up to 2 pixels while training: for small training sets."""
    hosts: str | None = None
    """horovodrun -H value (host:slots,...); default localhost:num_ranks."""
    hostfile: str | None = None
    """horovodrun --hostfile (one "host slots=N" per line), instead of ``hosts``."""
    network_interface: str | None = None
    """horovodrun --network-interface: the interface(s) the ranks talk over (comma-separated,
    for example eth0); default: the interfaces every host has in common."""
    ssh_port: int | None = None
    """horovodrun --ssh-port for remote hosts; default ssh's (22)."""
    ssh_identity_file: str | None = None
    """horovodrun --ssh-identity-file: the private key for remote hosts."""
    disable_cache: bool = False
    """horovodrun --disable-cache: check ssh and interfaces again (it keeps them 60 minutes)."""
    controller: str = "gloo"
    """gloo (built into every Horovod) or mpi (when Horovod was built with MPI)."""
    launcher: str = "horovodrun"
    """horovodrun on ``hosts``/``hostfile`` (default localhost), or slurm: horovodrun on the
    hosts and task slots of the SLURM allocation it runs in (training.slurm)."""
    resume: bool = False
    """Continue from the last checkpoint of an interrupted run of the same configuration."""
    checkpoint_every: int = 0
    """Rank 0 also saves the model, the optimizer and the input position every this many
    steps, for an exact mid-epoch ``resume`` (training.checkpoints); 0: at epoch ends only."""
    timeline: bool = False
    """Write Horovod's timeline (chrome://tracing JSON) into the run directory."""
    threads_per_rank: int = 0
    """TensorFlow compute threads per rank; 0 shares the host's cores among its ranks."""

    def __post_init__(self) -> None:
        minimums = {
            "num_ranks": 1,
            "epochs": 1,
            "batch_size": 1,
            "warmup_epochs": 0,
            "seed": 0,
            "shuffle_buffer": 1,
            "backward_passes_per_step": 1,
            "checkpoint_every": 0,
            "threads_per_rank": 0,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            # bool is an int subclass; True is no rank count.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(name, f"must be a whole number, got {value!r}")
            if value < minimum:
                raise ConfigError(name, f"must be at least {minimum}, got {value}")
        rate = self.learning_rate
        if (
            not isinstance(rate, int | float)
            or isinstance(rate, bool)
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise ConfigError("learning_rate", f"must be a positive finite number, got {rate}")
        # An int rate is the same rate; as a float it gives the same version id as from the CLI.
        object.__setattr__(self, "learning_rate", float(rate))
        choices: dict[str, tuple[str, ...]] = {
            "compression": COMPRESSIONS,
            "controller": CONTROLLERS,
            "launcher": LAUNCHERS,
        }
        if self.model is not None:
            choices["model"] = MODELS
        for name, known in choices.items():
            value = getattr(self, name)
            if value not in known:
                raise ConfigError(name, f"must be one of {', '.join(known)}, got {value!r}")
        if self.ssh_port is not None and (
            not isinstance(self.ssh_port, int)
            or isinstance(self.ssh_port, bool)
            or not 1 <= self.ssh_port <= 65535
        ):
            raise ConfigError("ssh_port", f"must be a port number 1-65535, got {self.ssh_port!r}")
        if self.network_interface is not None and not re.fullmatch(
            r"[A-Za-z0-9_.:@-]{1,15}(,[A-Za-z0-9_.:@-]{1,15})*", self.network_interface
        ):
            raise ConfigError(
                "network_interface",
                f"must be interface names such as eth0 (comma-separated), got "
                f"{self.network_interface!r}",
            )
        if self.hosts and self.hostfile:
            raise ConfigError("hostfile", "cannot be given with hosts: give one of the two")
        if self.launcher == "slurm" and (self.hosts or self.hostfile):
            raise ConfigError(
                "launcher", "slurm takes the hosts from the allocation: drop --hosts/--hostfile"
            )

    def parameters(self) -> dict[str, Any]:
        """The fields that make the model version's identity (all but :data:`EXECUTION_ONLY`)."""
        return {k: v for k, v in asdict(self).items() if k not in EXECUTION_ONLY}
