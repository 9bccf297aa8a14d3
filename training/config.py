"""What a user chooses about a training run, in two parts.

:class:`TrainConfig` is what is computed: every field changes the model's bytes and is part of
the model version's identity (:meth:`TrainConfig.parameters`). :class:`LaunchConfig` is where
and how the ranks run it (hosts, controller, checkpoints, threads): never part of the identity.
Both are frozen and keyword-only, validated at construction, and raise
:class:`~data_catalog.errors.ConfigError` naming the field (the CLI shows it as its flag);
:func:`check_launch` refuses a launch its configuration cannot take.
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
# Models training.pipeline_parallel splits into stages.
PIPELINE_MODELS = ("cnn", "mobilenetv2")
LAUNCHERS = ("horovodrun", "slurm", "spark")
SYNCS = ("allreduce", "pairwise")
# Fields added after model versions were committed, with the value every earlier run had: at
# that value they stay out of the version id, so earlier configurations keep their versions.
IDENTITY_SINCE: dict[str, Any] = {
    "sync": "allreduce",
    "average_every": 1,
    "model_stages": 1,
    "micro_batches": 1,
}


def _check_minimums(config: object, minimums: dict[str, int]) -> None:
    for name, minimum in minimums.items():
        value = getattr(config, name)
        # bool is an int subclass; True is no rank count.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(name, f"must be a whole number, got {value!r}")
        if value < minimum:
            raise ConfigError(name, f"must be at least {minimum}, got {value}")


def _check_choices(config: object, choices: dict[str, tuple[str, ...]]) -> None:
    for name, known in choices.items():
        value = getattr(config, name)
        if value not in known:
            raise ConfigError(name, f"must be one of {', '.join(known)}, got {value!r}")


# The largest seed every rank can set (keras.utils.set_random_seed seeds NumPy with it).
MAX_SEED = 2**32 - 1


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What training computes: every field is part of the model version's identity."""

    num_ranks: int = 2
    """Horovod ranks (``horovodrun -np``): the global batch and the learning rate scale with
    it."""
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
    sync: str = "allreduce"
    """How ranks combine what they learn: allreduce (average gradients every step, one model)
    or pairwise (each rank steps on its own gradients; every ``average_every`` steps it
    averages its weights with one partner, partners rotating: training.gossip)."""
    average_every: int = 1
    """With ``sync`` pairwise: steps between two pairwise averages."""
    augment: bool = False
    """Random shifts of up to 2 pixels while training: for small training sets."""
    model_stages: int = 1
    """Model parallelism within a rank: the model split into this many consecutive stages,
    stage i on the rank's device i (its GPUs, else logical CPU devices), pipelined over
    ``micro_batches`` (training.pipeline_parallel); Horovod data parallelism across ranks."""
    micro_batches: int = 1
    """With ``model_stages`` > 1: micro-batches each rank's batch is split into, so that the
    stages work at once (GPipe); must divide ``batch_size``."""

    def __post_init__(self) -> None:
        _check_minimums(
            self,
            {
                "num_ranks": 1,
                "epochs": 1,
                "batch_size": 1,
                "warmup_epochs": 0,
                "seed": 0,
                "shuffle_buffer": 1,
                "backward_passes_per_step": 1,
                "model_stages": 1,
                "micro_batches": 1,
                "average_every": 1,
            },
        )
        if self.seed > MAX_SEED:
            raise ConfigError(
                "seed",
                f"must be at most {MAX_SEED} (NumPy's and TensorFlow's global seeds are 32-bit), "
                f"got {self.seed}",
            )
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
        choices: dict[str, tuple[str, ...]] = {"compression": COMPRESSIONS, "sync": SYNCS}
        if self.model is not None:
            choices["model"] = MODELS
        _check_choices(self, choices)
        self._check_pipeline()
        self._check_sync()

    def _check_pipeline(self) -> None:
        """What model parallelism (``model_stages`` > 1) goes with (training.pipeline_parallel
        says why; :func:`check_launch` what it cannot be launched with)."""
        if self.batch_size % self.micro_batches:
            raise ConfigError(
                "micro_batches",
                f"must divide --batch-size {self.batch_size} into equal micro-batches, got "
                f"{self.micro_batches}",
            )
        if self.model_stages == 1:
            if self.micro_batches > 1:
                raise ConfigError("micro_batches", "needs --model-stages 2 or more to pipeline")
            return
        if self.model is not None and self.model not in PIPELINE_MODELS:
            raise ConfigError(
                "model_stages",
                f"splits only {', '.join(PIPELINE_MODELS)} into stages, not {self.model!r}",
            )
        if self.backward_passes_per_step > 1:
            raise ConfigError(
                "backward_passes_per_step",
                f"is not supported with --model-stages {self.model_stages}: the pipelined step "
                "already sums the gradients of its micro-batches",
            )

    def _check_sync(self) -> None:
        """What pairwise averaging goes with: it sends weights, not gradients, so gradient
        aggregation and gradient compression have nothing to act on."""
        if self.sync == "allreduce":
            if self.average_every != 1:
                raise ConfigError("average_every", "needs --sync pairwise")
            return
        refused = {
            "backward_passes_per_step": self.backward_passes_per_step > 1,
            "compression": self.compression != "none",
            "model_stages": self.model_stages > 1,
        }
        for name, given in refused.items():
            if given:
                raise ConfigError(
                    name,
                    "is not supported with --sync pairwise: the ranks average weights every "
                    "--average-every steps, they allreduce no gradients",
                )

    def parameters(self) -> dict[str, Any]:
        """The model version's identity: every field, but a field of :data:`IDENTITY_SINCE`
        only when it is not its default."""
        return {
            k: v
            for k, v in asdict(self).items()
            if not (k in IDENTITY_SINCE and v == IDENTITY_SINCE[k])
        }


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where and how the ranks run: none of it is part of the model version's identity."""

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
    hosts and task slots of the SLURM allocation it runs in (training.slurm), or spark:
    Horovod's Spark runner starts the ranks as tasks of ``spark_master`` (training.spark)."""
    spark_master: str | None = None
    """With ``launcher`` spark: the Spark master URL (``local[N]``, ``spark://host:port``);
    default ``local[num_ranks]``, Spark in this process's JVM."""
    resume: bool = False
    """Continue from the last checkpoint of an interrupted run of the same configuration."""
    checkpoint_every: int = 0
    """Rank 0 also saves the model, the optimizer and the input position every this many
    steps, for an exact mid-epoch ``resume`` (training.checkpoints); 0: at epoch ends only."""
    timeline: bool = False
    """Write Horovod's timeline (chrome://tracing JSON) into the run directory."""
    threads_per_rank: int = 0
    """TensorFlow compute threads per rank; 0 shares the host's cores among its ranks. 1 also
    pins each rank, and every thread it starts, to one core of its own."""

    def __post_init__(self) -> None:
        _check_minimums(self, {"checkpoint_every": 0, "threads_per_rank": 0})
        _check_choices(self, {"controller": CONTROLLERS, "launcher": LAUNCHERS})
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
        self._check_spark()

    def _check_spark(self) -> None:
        """What ``launcher`` spark goes with: Spark places the ranks (no hosts, no ssh) and
        Horovod's Spark runner is used with Gloo here."""
        if self.launcher != "spark":
            if self.spark_master is not None:
                raise ConfigError("spark_master", "needs --launcher spark")
            return
        if self.spark_master is not None and not re.fullmatch(
            r"local(\[(\*|[1-9][0-9]*)\])?|spark://\S+:[0-9]+", self.spark_master
        ):
            raise ConfigError(
                "spark_master",
                "must be a Spark master URL: local, local[N], local[*] or spark://HOST:PORT (a "
                "standalone master), "
                f"got {self.spark_master!r}",
            )
        refused = {
            "hosts": self.hosts,
            "hostfile": self.hostfile,
            "ssh_port": self.ssh_port,
            "ssh_identity_file": self.ssh_identity_file,
            "disable_cache": self.disable_cache,
            "controller": self.controller != "gloo",
            "timeline": self.timeline,
        }
        for name, given in refused.items():
            if given:
                raise ConfigError(
                    name,
                    "is not supported with --launcher spark: Spark places the ranks, which talk "
                    "over Gloo",
                )


def check_launch(config: TrainConfig, launch: LaunchConfig) -> None:
    """Refuse a launch ``config`` cannot take: a pipelined run (``model_stages`` > 1) cannot
    resume yet, so it takes neither ``resume`` nor ``checkpoint_every``; a local Spark master
    with fewer task slots than ranks would never start them all."""
    slots = re.fullmatch(r"local(?:\[([0-9]+)\])?", launch.spark_master or "")
    if launch.launcher == "spark" and slots and int(slots.group(1) or 1) < config.num_ranks:
        raise ConfigError(
            "spark_master",
            f"{launch.spark_master} runs {int(slots.group(1) or 1)} task(s) at a time, fewer "
            f"than the {config.num_ranks} ranks (--np), which must all run at once",
        )
    if config.model_stages == 1:
        return
    refused = {"checkpoint_every": launch.checkpoint_every > 0, "resume": launch.resume}
    for name, given in refused.items():
        if given:
            raise ConfigError(
                name,
                f"is not supported with --model-stages {config.model_stages}: pipelined runs "
                "cannot resume yet",
            )
