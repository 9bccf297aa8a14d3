"""The one place that maps configuration fields to command-line flags.

Every option of a stage is a field of its config dataclass (``ClusterConfig``, ``JobOptions``
and ``PlanConfig``, ``TrainConfig`` and ``LaunchConfig``, ``SkyServerOptions``,
``IngestRequest``, ``SynthRequest``); its default is the dataclass's, its flag is declared here
once, and a :class:`~data_catalog.errors.ConfigError` naming the field is shown with the flag
(``num_ranks`` → ``--np``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def count(text: str) -> int:
    """A number of things to do: 1 or more (a benchmark of 0 rounds or steps has nothing to
    measure)."""
    number = whole_number(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {text!r}")
    return number


def port_number(text: str) -> int:
    """A TCP port a server can listen on: 1 to 65535 (0 would be any port, unknown to print)."""
    port = whole_number(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return port


def finite_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A duration: a finite number of seconds above 0."""
    value = finite_number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Flag:
    """How one config field appears on the command line."""

    field: str
    flag: str
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None
    choices: Sequence[str] | None = None
    switch: bool = False
    """A flag without a value that sets the field to True."""
    default_help: str | None = None
    """What the help says of the default, when the value alone would not tell."""
    environment_default: Callable[[Mapping[str, Any], Mapping[str, str]], Any] | None = None
    """When the flag is not given: its value from the other flags' values (of every group)
    and the environment, or None for the config's default."""


def _slurm_num_ranks(values: Mapping[str, Any], environ: Mapping[str, str]) -> int | None:
    from training.slurm import default_num_ranks

    return default_num_ranks(values.get("launcher"), environ)


@functools.cache
def _config_flags() -> dict[str, tuple[type[Any], tuple[Flag, ...]]]:
    """Each config class with the flags of the fields a user may set, by a short name."""
    from preprocessing.config import ClusterConfig, JobOptions, usable_cores
    from preprocessing.datasets import DATASETS, IngestRequest, SkyServerOptions, SynthRequest
    from preprocessing.plan import PlanConfig
    from training.config import LaunchConfig, TrainConfig
    from training.models import MODELS

    return {
        "ingest": (
            IngestRequest,
            (
                Flag(
                    field="source",
                    flag="--source",
                    metavar="URI",
                    help="where the raw files are; "
                    + "; ".join(f"{d.name}: {d.source_help}" for d in DATASETS.values()),
                    default_help="the dataset's default source",
                ),
            ),
        ),
        "skyserver": (
            SkyServerOptions,
            (
                Flag(
                    field="url",
                    flag="--skyserver-url",
                    metavar="URL",
                    help="sdss without --source: SkyServer base URL, for mirrors",
                ),
                Flag(
                    field="data_release",
                    flag="--data-release",
                    type=whole_number,
                    metavar="N",
                    help="sdss without --source: data release",
                ),
                Flag(
                    field="limit",
                    flag="--limit",
                    type=whole_number,
                    metavar="N",
                    help="sdss without --source: fetch at most N rows",
                    default_help="all that match",
                ),
                Flag(
                    field="concurrency",
                    flag="--skyserver-queries",
                    type=whole_number,
                    metavar="N",
                    help="sdss without --source: SkyServer queries in flight at once, over "
                    "separate objid ranges (a shared public service: keep it low)",
                ),
            ),
        ),
        "plan": (
            PlanConfig,
            (
                Flag(
                    field="rank_multiple",
                    flag="--rank-multiple",
                    type=whole_number,
                    metavar="M",
                    help="training row groups are equal and their count a multiple of M, so "
                    "that up to M ranks (any divisor of M) get equal, whole row groups",
                ),
                Flag(
                    field="remainder",
                    flag="--remainder",
                    choices=("drop", "pad", "keep"),
                    help="training rows that do not fill equal row groups: drop them (every "
                    "sample read once per epoch) or pad by repeating the first rows; counted "
                    "in the manifest (image sets); sdss keeps them, in each raw piece's last, "
                    "shorter row group",
                    default_help="drop for image sets, keep for sdss",
                ),
                Flag(
                    field="target_rows_per_group",
                    flag="--rows-per-group",
                    type=whole_number,
                    metavar="N",
                    help="target rows per row group, the unit a rank reads",
                ),
            ),
        ),
        "job": (
            JobOptions,
            (
                Flag(
                    field="format",
                    flag="--format",
                    choices=("parquet", "petastorm"),
                    help="parquet (petastorm make_batch_reader) or a Petastorm dataset with a "
                    "Unischema (make_reader)",
                    default_help="petastorm for cifar10, parquet for the others",
                ),
                Flag(
                    field="validation_fraction",
                    flag="--validation-fraction",
                    type=finite_number,
                    metavar="F",
                    help="share of the training source hashed (by sample id) into the "
                    "validation split",
                    default_help="0.05 for images, 0.1 for sdss",
                ),
                Flag(
                    field="test_fraction",
                    flag="--test-fraction",
                    type=finite_number,
                    metavar="F",
                    help="share hashed into the test split, for sources without an official one",
                    default_help="sdss: 0.1",
                ),
                Flag(
                    field="redshift_feature",
                    flag="--with-redshift",
                    switch=True,
                    help="sdss: train on the spectroscopic redshift too (it nearly decides the "
                    "class by itself; the seed paper's features leave it out)",
                ),
            ),
        ),
        "cluster": (
            ClusterConfig,
            (
                Flag(
                    field="workers",
                    flag="--workers",
                    type=whole_number,
                    metavar="N",
                    help="Dask LocalCluster worker processes, one thread each (ingest: one "
                    "task per input file; preprocess: one per piece, then one per shard)",
                    default_help=f"one per usable core, here {usable_cores()}",
                ),
                Flag(
                    field="in_process_bytes",
                    flag="--in-process-below",
                    type=whole_number,
                    metavar="BYTES",
                    help="a job whose first pass reads at most this many bytes runs in this "
                    "process instead of starting a LocalCluster (the same files); a larger "
                    "ingest of CSV exports runs on --workers threads of this process; 0: always "
                    "start one",
                    default_help="67108864 (64 MiB)",
                ),
                Flag(
                    field="memory_limit",
                    flag="--memory-limit",
                    metavar="SIZE",
                    help="memory limit of each LocalCluster worker; Dask pauses a worker at "
                    "80%% of it and restarts it at 95%%",
                ),
                Flag(
                    field="scheduler",
                    flag="--scheduler",
                    metavar="ADDRESS",
                    help="use an existing Dask scheduler (tcp://host:8786) instead of a "
                    "LocalCluster; its workers must see $SHARDFLOW_HOME",
                    default_help="a LocalCluster",
                ),
                Flag(
                    field="cluster",
                    flag="--cluster",
                    choices=("local", "slurm"),
                    help="where the Dask workers run: a LocalCluster, or slurm: --workers "
                    "SLURM jobs of one core and --memory-limit each (dask-jobqueue "
                    "SLURMCluster), submitted with sbatch from this host",
                ),
                Flag(
                    field="slurm_partition",
                    flag="--slurm-partition",
                    metavar="NAME",
                    help="--cluster slurm: the partition of the worker jobs",
                    default_help="the cluster's default partition",
                ),
                Flag(
                    field="slurm_account",
                    flag="--slurm-account",
                    metavar="NAME",
                    help="--cluster slurm: the account the worker jobs are charged to",
                    default_help="your default account",
                ),
                Flag(
                    field="slurm_walltime",
                    flag="--slurm-walltime",
                    metavar="TIME",
                    help="--cluster slurm: time limit of each worker job (sbatch -t: "
                    "HH:MM:SS, MM, D-HH:MM)",
                ),
                Flag(
                    field="slurm_interface",
                    flag="--slurm-interface",
                    metavar="NIC",
                    help="--cluster slurm: the network interface the scheduler (here) and "
                    "the workers (on the compute nodes) talk over, for example ib0",
                    default_help="the address this host's name resolves to",
                ),
                Flag(
                    field="slurm_start_timeout",
                    flag="--slurm-start-timeout",
                    type=finite_number,
                    metavar="SECONDS",
                    help="--cluster slurm: how long to wait for the first worker job to start "
                    "(a busy queue needs more)",
                ),
            ),
        ),
        "train": (
            TrainConfig,
            (
                Flag(
                    field="num_ranks",
                    flag="--np",
                    type=whole_number,
                    help="Horovod ranks (horovodrun -np)",
                    default_help=f"{_default(TrainConfig, 'num_ranks')}; with --launcher slurm, "
                    "the allocation's SLURM_NTASKS",
                    environment_default=_slurm_num_ranks,
                ),
                Flag(field="epochs", flag="--epochs", type=whole_number, help="training epochs"),
                Flag(
                    field="batch_size",
                    flag="--batch-size",
                    type=whole_number,
                    help="per rank; the global batch is this times --np",
                ),
                Flag(
                    field="model",
                    flag="--model",
                    choices=MODELS,
                    help="images: cnn, mobilenetv2, resnet50 (Keras applications, random "
                    "init); sdss: dnn",
                    default_help="the dataset's: cnn for images, dnn for sdss",
                ),
                Flag(
                    field="learning_rate",
                    flag="--lr",
                    type=finite_number,
                    help="learning rate for one rank, scaled by --np",
                ),
                Flag(field="seed", flag="--seed", type=whole_number, help="random seed"),
                Flag(
                    field="backward_passes_per_step",
                    flag="--backward-passes-per-step",
                    type=whole_number,
                    metavar="K",
                    help="sum gradients of K local batches before each allreduce: K times "
                    "less traffic",
                ),
                Flag(
                    field="compression",
                    flag="--compression",
                    choices=("none", "fp16"),
                    help="compress gradients for allreduce",
                ),
                Flag(
                    field="sync",
                    flag="--sync",
                    choices=("allreduce", "pairwise"),
                    help="allreduce: every step, every rank's gradients averaged (one model); "
                    "pairwise: no gradient allreduce, each rank steps on its own gradients and "
                    "every --average-every steps averages its weights (BN statistics included; "
                    "Adam's moments stay local) with one partner, partners rotating so that "
                    "over N-1 rounds (N odd: N, one rank sitting out each) every rank meets "
                    "every other. Each average sends about the model's size per rank, whatever "
                    "N (allreduce: 2(N-1)/N of it); the committed model is the mean of all "
                    "ranks' at the end (one allreduce). Usually needs more epochs for the same "
                    "accuracy",
                ),
                Flag(
                    field="average_every",
                    flag="--average-every",
                    type=whole_number,
                    metavar="K",
                    help="with --sync pairwise: steps between two pairwise averages (K times "
                    "fewer bytes, ranks drift further apart in between)",
                ),
                Flag(
                    field="augment",
                    flag="--augment",
                    switch=True,
                    help="random shifts of up to 2 pixels while training, for small training sets",
                ),
                Flag(
                    field="model_stages",
                    flag="--model-stages",
                    type=whole_number,
                    metavar="N",
                    help="hybrid parallelism: split the model (cnn, mobilenetv2) into N "
                    "consecutive stages of about equal FLOPs, stage i on the rank's device i "
                    "(GPUs when a rank sees N, else N logical CPU devices); Horovod still "
                    "averages gradients across ranks. 1: data parallelism alone",
                ),
                Flag(
                    field="micro_batches",
                    flag="--micro-batches",
                    type=whole_number,
                    metavar="M",
                    help="with --model-stages: split each rank's batch into M micro-batches "
                    "that flow through the stages one after another, so that stage 2 works on "
                    "one while stage 1 works on the next (GPipe); M must divide --batch-size. "
                    "Same maths as one batch, except that BatchNorm normalises per micro-batch",
                ),
            ),
        ),
        "launch": (
            LaunchConfig,
            (
                Flag(
                    field="hosts",
                    flag="--hosts",
                    metavar="HOST:SLOTS,...",
                    help="horovodrun -H",
                    default_help="localhost:NP",
                ),
                Flag(
                    field="hostfile",
                    flag="--hostfile",
                    metavar="FILE",
                    help="horovodrun --hostfile: one 'HOST slots=N' per line, instead of --hosts",
                ),
                Flag(
                    field="network_interface",
                    flag="--network-interface",
                    metavar="NIC[,NIC]",
                    help="horovodrun --network-interface: the interface the ranks talk over "
                    "(for example eth0)",
                    default_help="the interfaces all hosts have in common",
                ),
                Flag(
                    field="ssh_port",
                    flag="--ssh-port",
                    type=whole_number,
                    metavar="PORT",
                    help="horovodrun --ssh-port, for remote hosts",
                    default_help="ssh's own (22)",
                ),
                Flag(
                    field="ssh_identity_file",
                    flag="--ssh-identity-file",
                    metavar="FILE",
                    help="horovodrun --ssh-identity-file: the private key for remote hosts",
                ),
                Flag(
                    field="disable_cache",
                    flag="--disable-cache",
                    switch=True,
                    help="horovodrun --disable-cache: check ssh and interfaces again (it keeps "
                    "their results 60 minutes)",
                ),
                Flag(
                    field="controller",
                    flag="--controller",
                    choices=("gloo", "mpi"),
                    help="Horovod's controller: gloo (always built) or mpi (needs Horovod built "
                    "with MPI)",
                ),
                Flag(
                    field="launcher",
                    flag="--launcher",
                    choices=("horovodrun", "slurm", "spark"),
                    help="slurm: run inside an sbatch/salloc allocation, horovodrun on its "
                    "nodes and task slots (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE) instead "
                    "of --hosts; --np defaults to its task count. spark: Horovod's Spark "
                    "runner starts the ranks as tasks of --spark-master (needs Java 17)",
                ),
                Flag(
                    field="spark_master",
                    flag="--spark-master",
                    metavar="URL",
                    help="--launcher spark: the Spark master (local[N], spark://HOST:PORT)",
                    default_help="local[NP]",
                ),
                Flag(
                    field="resume",
                    flag="--resume",
                    switch=True,
                    help="continue an interrupted run of the same configuration from its last "
                    "checkpoint",
                ),
                Flag(
                    field="checkpoint_every",
                    flag="--checkpoint-every",
                    type=whole_number,
                    metavar="STEPS",
                    help="also checkpoint model, optimizer and input position every STEPS "
                    "steps (and on SIGTERM), so that --resume continues mid-epoch exactly",
                    default_help="0: at epoch ends only",
                ),
                Flag(
                    field="timeline",
                    flag="--timeline",
                    switch=True,
                    help="record Horovod's timeline (chrome://tracing JSON) in the run directory",
                ),
                Flag(
                    field="threads_per_rank",
                    flag="--threads-per-rank",
                    type=whole_number,
                    metavar="N",
                    help="TensorFlow compute threads per rank (for example 1 when ranks share a "
                    "machine's cores)",
                    default_help="0: the host's cores shared among its ranks",
                ),
            ),
        ),
        "synth": (
            SynthRequest,
            (
                Flag(
                    field="rows",
                    flag="--rows",
                    type=whole_number,
                    help="rows in all (images: training rows)",
                ),
                Flag(
                    field="test_rows",
                    flag="--test-rows",
                    type=whole_number,
                    help="images: test rows",
                    default_help="a sixth of --rows (cifar10: a fifth)",
                ),
                Flag(
                    field="source",
                    flag="--source",
                    metavar="DIR",
                    help="images: the pool of real images to draw on",
                    default_help="fashion-mnist: Debian's dataset-fashion-mnist",
                ),
                Flag(field="files", flag="--files", type=whole_number, help="sdss: files"),
                Flag(field="format", flag="--format", choices=("csv", "fits"), help="sdss"),
                Flag(field="out", flag="--out", metavar="DIR", help="folder to write into"),
                Flag(field="seed", flag="--seed", type=whole_number, help="random seed"),
            ),
        ),
    }


def flags_of(group: str) -> tuple[Flag, ...]:
    return _config_flags()[group][1]


def flag_for(field: str) -> str:
    """The command-line flag of a config field, for messages (``num_ranks`` → ``--np``)."""
    for _cls, flags in _config_flags().values():
        for flag in flags:
            if flag.field == field:
                return flag.flag
    return field


def command_line(config: Any, group: str) -> list[str]:
    """The flags of ``group`` that give ``config`` (a config made from them): each field that
    differs from its default, so that ``build`` of the parsed flags gives ``config`` back."""
    cls, flags = _config_flags()[group]
    by_field = {flag.field: flag for flag in flags}
    args: list[str] = []
    for f in dataclasses.fields(cls):
        value = getattr(config, f.name)
        if value == _default(cls, f.name):
            continue
        flag = by_field.get(f.name)
        if flag is None:
            raise ValueError(f"{cls.__name__}.{f.name} has no flag: it cannot be {value!r}")
        if flag.switch:
            args.append(flag.flag)
        else:
            args += [flag.flag, str(value)]
    return args


def _default(cls: type[Any], name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return dataclasses.MISSING
    raise KeyError(f"{cls.__name__} has no field {name}")


def add_flags(
    parser: argparse.ArgumentParser, group: str, *, only: Sequence[str] | None = None
) -> None:
    """Add the flags of ``group`` (a key of the table above) to ``parser``, with the config's
    defaults in their help."""
    cls, flags = _config_flags()[group]
    for flag in flags:
        if only is not None and flag.field not in only:
            continue
        default = _default(cls, flag.field)
        required = default is dataclasses.MISSING
        shown = flag.default_help or ("" if default is None or required else str(default))
        help_text = flag.help + (f" (default: {shown})" if shown and not flag.switch else "")
        if required:
            help_text += " (required)"
        if flag.switch:
            parser.add_argument(flag.flag, dest=flag.field, action="store_true", help=help_text)
            continue
        parser.add_argument(
            flag.flag,
            dest=flag.field,
            type=flag.type,
            choices=flag.choices,
            metavar=flag.metavar or (None if flag.choices else flag.flag.lstrip("-").upper()),
            required=required,
            # None tells build() the flag was not given: the environment may choose.
            default=None if required or flag.environment_default else default,
            help=help_text,
        )


def build(
    cls: type[T],
    args: argparse.Namespace,
    group: str,
    *,
    environ: Mapping[str, str] = os.environ,
    **fixed: Any,
) -> T:
    """``cls`` from the flags of ``group`` in ``args`` (and ``fixed`` fields); a flag with an
    :attr:`Flag.environment_default` that was not given takes it from ``environ``."""
    _cls, flags = _config_flags()[group]
    values = {f.field: getattr(args, f.field) for f in flags if hasattr(args, f.field)}
    for flag in flags:
        if flag.environment_default is None or values.get(flag.field) is not None:
            continue
        values.pop(flag.field, None)
        # The other groups' flags too: --np's default follows --launcher (group "launch").
        chosen = flag.environment_default({**vars(args), **values}, environ)
        if chosen is not None:
            values[flag.field] = chosen
    return cls(**values, **fixed)
