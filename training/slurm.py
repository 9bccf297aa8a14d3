"""The hosts of the SLURM allocation this process runs in, as horovodrun's ``-H``.

sbatch/salloc describe the allocation in the environment of the batch script:

    SLURM_JOB_NODELIST   vm[01-03],gpu7        scontrol show hostnames → vm01 vm02 vm03 gpu7
    SLURM_TASKS_PER_NODE 2(x3),1               → 2 2 2 1, in the node list's order
    SLURM_NTASKS         7                     the sum (absent when only -N was given)
            │
            ▼
    -H vm01:2,vm02:2,vm03:2,gpu7:1             and --np, when not given: 7

horovodrun then starts the ranks itself: on the batch host directly, on the others over ssh
(as with ``--hosts``), so the allocation's nodes must reach each other by ssh.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping

from data_catalog.errors import ShardflowError

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed task counts, one per node: ``"2(x3),1"`` → ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in value.split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None:
            raise ShardflowError(
                f"SLURM_TASKS_PER_NODE={value!r} is not SLURM's form (such as 2(x3),1)"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: the node names of a compressed list."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except FileNotFoundError:
        raise ShardflowError("--launcher slurm needs scontrol (SLURM's client) on PATH") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ShardflowError(f"scontrol show hostnames {nodelist} failed: {last}")
    return done.stdout.split()


def allocation_hosts(
    environ: Mapping[str, str],
    *,
    hostnames: Callable[[str], list[str]] | None = None,
) -> str:
    """horovodrun's ``-H`` (``host:slots,...``) for the allocation ``environ`` describes: each
    node of ``SLURM_JOB_NODELIST`` with its ``SLURM_TASKS_PER_NODE`` slots. ``hostnames``
    expands the node list (default :func:`scontrol_hostnames`)."""
    if not environ.get("SLURM_JOB_ID"):
        raise ShardflowError(
            "--launcher slurm runs inside a SLURM allocation (sbatch/salloc): "
            "SLURM_JOB_ID is not set"
        )
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        raise ShardflowError(
            f"SLURM job {environ['SLURM_JOB_ID']}: SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE "
            "must be set (run from the batch script or salloc's shell, not from a step)"
        )
    hosts, slots = (hostnames or scontrol_hostnames)(nodelist), tasks_per_node(tasks)
    if len(hosts) != len(slots):
        raise ShardflowError(
            f"SLURM allocation: {len(hosts)} nodes in {nodelist} but {len(slots)} task counts "
            f"in SLURM_TASKS_PER_NODE={tasks}"
        )
    total = environ.get("SLURM_NTASKS")
    if total and total.isdigit() and int(total) != sum(slots):
        raise ShardflowError(
            f"SLURM allocation: SLURM_NTASKS={total} but SLURM_TASKS_PER_NODE={tasks} sums to "
            f"{sum(slots)}"
        )
    return ",".join(f"{host}:{count}" for host, count in zip(hosts, slots, strict=True))


def allocation_num_ranks(environ: Mapping[str, str]) -> int | None:
    """The task count of the SLURM allocation ``environ`` describes: ``SLURM_NTASKS`` (or its
    older name ``SLURM_NPROCS``), else the sum of ``SLURM_TASKS_PER_NODE`` (``sbatch -N 2``
    alone sets no task count: one task per node); None outside an allocation."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        value = environ.get(name)
        if not value:
            continue
        if not value.isdigit() or int(value) < 1:
            raise ShardflowError(f"{name}={value!r} is not a task count; give --np")
        return int(value)
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    return sum(tasks_per_node(tasks)) if tasks else None


def default_num_ranks(launcher: str | None, environ: Mapping[str, str]) -> int | None:
    """``--np`` when it is not given: with ``--launcher slurm`` inside an allocation, its task
    count (:func:`allocation_num_ranks`); None (TrainConfig's own default) otherwise."""
    return allocation_num_ranks(environ) if launcher == "slurm" else None


def allocation_slots(hosts: str) -> int:
    """The task slots of a ``host:slots,...`` value."""
    return sum(int(entry.rsplit(":", 1)[1]) for entry in hosts.split(","))


def horovodrun_hosts(num_ranks: int, environ: Mapping[str, str]) -> str:
    """:func:`allocation_hosts`, refused when ``num_ranks`` (``--np``) needs more slots than
    the allocation has."""
    hosts = allocation_hosts(environ)
    slots = allocation_slots(hosts)
    if num_ranks > slots:
        raise ShardflowError(
            f"--np {num_ranks} is more than the {slots} task(s) of SLURM job "
            f'{environ["SLURM_JOB_ID"]} ({hosts}): pass --np "$SLURM_NTASKS" or ask sbatch for '
            f"-n {num_ranks}"
        )
    return hosts
