"""What a user chooses about a preprocessing run: where the tasks run and what the output is.

Both are frozen and keyword-only, validated at construction, and raise
:class:`~data_catalog.errors.ConfigError` naming the field (the CLI shows it as its flag).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from data_catalog.errors import ConfigError
from data_catalog.layout import FORMATS
from preprocessing.plan import PlanConfig


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset
    narrow), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Per LocalCluster worker: a shard task needs a few hundred MiB (docs/preprocessing.md).
DEFAULT_MEMORY_LIMIT = "2GiB"
# Dask pauses a worker at 80 % of its limit; a worker here peaks near 300 MiB.
MIN_MEMORY_LIMIT = 512 * 2**20
# The address forms distributed's comm layer takes for a remote scheduler.
_SCHEDULER_ADDRESS = re.compile(
    r"(tcp|tls|ws|wss|ucx)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})/?"
)
CLUSTERS = ("local", "slurm")
# sbatch --time forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_INTERFACE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


# 200,000 SDSS rows are 30 MB of raw Parquet (0.6 CPU-s of preprocessing) or 75 MB of CSV:
# below this, a LocalCluster's start and stop (about 0.8 s, more on a loaded machine) and its
# workers' imports cost more than splitting the work saves.
IN_PROCESS_BYTES = 64 * 2**20


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the Dask tasks of a stage run."""

    workers: int = field(default_factory=usable_cores)
    """Worker processes of the LocalCluster, one thread each (default: one per usable core);
    ignored with ``scheduler``."""
    scheduler: str | None = None
    """Address of an existing Dask scheduler (tcp://host:8786); its workers must see the
    catalog's directory at the same path."""
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    """Per-worker memory limit of the LocalCluster, in Dask's notation ("2GiB", "500MB")."""
    cluster: str = "local"
    """"local": a LocalCluster of ``workers``; "slurm": ``workers`` SLURM jobs of one Dask
    worker each (one core, ``memory_limit``), through dask-jobqueue's SLURMCluster."""
    slurm_partition: str | None = None
    """The worker jobs' partition (sbatch -p); None: the cluster's default."""
    slurm_account: str | None = None
    """The account the worker jobs are charged to (sbatch -A); None: the user's default."""
    slurm_walltime: str = "01:00:00"
    """Time limit of each worker job (sbatch -t)."""
    slurm_interface: str | None = None
    """The interface the scheduler and the workers talk over (ib0); None: the scheduler binds
    the address this host's name resolves to and the workers the one that reaches it."""
    slurm_start_timeout: float = 300.0
    """Seconds to wait for the first worker job to start and join."""
    in_process_bytes: int = IN_PROCESS_BYTES
    """A job whose first pass plans to read at most this many bytes runs its tasks in this
    process (on ``workers`` threads where a pass's tasks release the GIL, else one after the
    other) instead of starting a LocalCluster (whose start, workers' imports and stop cost
    more than the work: docs/preprocessing.md, "Speed"); the same files either way. 0:
    always start one. Only for a LocalCluster (not --scheduler or slurm)."""

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(
                "workers", f"must be a whole number of at least 1, got {self.workers}"
            )
        if self.memory_limit != DEFAULT_MEMORY_LIMIT:
            # Only a given limit is parsed: Dask's parser imports Dask (0.12 s), which a job
            # small enough to run in this process never needs.
            self._check_memory_limit()
        if self.scheduler is not None:
            match = _SCHEDULER_ADDRESS.fullmatch(self.scheduler)
            if match is None or not 0 < int(match.group(3)) < 65536:
                raise ConfigError(
                    "scheduler",
                    f"{self.scheduler!r} is not a scheduler address; give one like "
                    "tcp://10.0.0.5:8786",
                )
        if not isinstance(self.in_process_bytes, int) or self.in_process_bytes < 0:
            raise ConfigError(
                "in_process_bytes", f"must be a whole number of bytes, got {self.in_process_bytes}"
            )
        self._check_slurm()

    def _check_memory_limit(self) -> None:
        from dask.utils import parse_bytes

        try:
            limit = parse_bytes(self.memory_limit)
        except (ValueError, TypeError, KeyError, OverflowError):  # "1e999": infinity
            limit = 0
        if limit < MIN_MEMORY_LIMIT:
            raise ConfigError(
                "memory_limit",
                f"{self.memory_limit!r}: give a size of at least 512MiB per worker, such as "
                "2GiB or 1500MB",
            )

    def _check_slurm(self) -> None:
        if self.cluster not in CLUSTERS:
            raise ConfigError(
                "cluster", f"must be one of {', '.join(CLUSTERS)}, got {self.cluster!r}"
            )
        if self.cluster == "slurm" and self.scheduler is not None:
            raise ConfigError(
                "cluster", "slurm starts its own scheduler: give --cluster slurm or --scheduler"
            )
        for name in ("slurm_partition", "slurm_account"):
            value = getattr(self, name)
            if value is not None and not _SLURM_NAME.fullmatch(value):
                raise ConfigError(name, f"{value!r} is not a SLURM partition or account name")
        if not _SLURM_TIME.fullmatch(self.slurm_walltime):
            raise ConfigError(
                "slurm_walltime",
                f"{self.slurm_walltime!r}: give a time sbatch takes, such as 01:00:00 or 2-00:00",
            )
        if self.slurm_interface is not None and not _INTERFACE.fullmatch(self.slurm_interface):
            raise ConfigError(
                "slurm_interface", f"{self.slurm_interface!r} is not an interface name such as ib0"
            )
        timeout = self.slurm_start_timeout
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigError("slurm_start_timeout", f"must be a positive number, got {timeout}")


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What a user chooses about the output (all part of the version's identity)."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    format: str | None = None
    """"parquet" (read with petastorm's make_batch_reader) or "petastorm" (a Unischema
    dataset read with make_reader); None: the dataset's default."""
    validation_fraction: float | None = None
    """Share of the training source hashed into the validation split; None: the dataset's
    default."""
    test_fraction: float | None = None
    """Share hashed into the test split, for sources without an official test split."""
    redshift_feature: bool = False
    """SDSS only: train on the spectroscopic redshift too (it nearly decides the class by
    itself, and the seed paper's features do not include it)."""

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError("format", f"{self.format!r} is not one of {', '.join(FORMATS)}")
        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 <= value < 1):
                raise ConfigError(name, f"must be in [0, 1), got {value}")
