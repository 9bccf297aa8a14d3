"""Time ``hvd.allreduce`` of float32 tensors across the ranks of a horovodrun, phase by phase.

    horovodrun -np N -H w1:1,...,wN:1 --network-interface eth0 --gloo \\
        python -m lab.allreduce_probe PLAN.json
    │  every rank: hvd.init(); for each phase of the plan:
    │    (with a control folder) rank 0 writes ready-<k>, waits for go-<k>: whoever runs the
    │    probe changes the network between phases (lab.netns: Host.rate_limit)
    │    for each size: warm-up allreduces, then repeats of [barrier, timed allreduce]
    ▼
rank 0 writes the plan's ``out`` (JSON): per phase and size, every rank's seconds per repeat,
the slowest rank's per repeat, and their median; the ranks' CPU seconds and wall seconds.

A repeat's time is the slowest rank's: each rank times its own ``allreduce`` call from the
moment a barrier (a 1-value allreduce) lets it go, and the collective is done when the last
rank has its sum. The sum is checked (every value N) so that a timing never stands for a
broken allreduce.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.netns import RankHosts

# How long rank 0 waits for whoever runs the probe to say "go" for a phase.
GO_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True, kw_only=True)
class Phase:
    """Sizes timed under one network condition."""

    label: str
    sizes: tuple[int, ...]
    """Tensor sizes in bytes (float32: a multiple of 4)."""
    repeats: int
    warmup: int = 1


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the probe times, and where it reports."""

    phases: tuple[Phase, ...]
    out: str
    """Where rank 0 writes the results (JSON), on the filesystem every host shares."""
    control: str | None = None
    """A shared folder for the phase handshake (ready-<k> / go-<k>); None: no pauses."""

    def __post_init__(self) -> None:
        for phase in self.phases:
            if phase.repeats < 1 or phase.warmup < 0:
                raise ValueError(f"phase {phase.label}: repeats >= 1 and warmup >= 0")
            for size in phase.sizes:
                if size < 4 or size % 4:
                    raise ValueError(f"phase {phase.label}: {size} bytes is not float32 values")

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def read(cls, path: Path) -> Plan:
        raw = json.loads(path.read_text())
        phases = tuple(
            Phase(
                label=p["label"],
                sizes=tuple(int(s) for s in p["sizes"]),
                repeats=int(p["repeats"]),
                warmup=int(p["warmup"]),
            )
            for p in raw["phases"]
        )
        return cls(phases=phases, out=raw["out"], control=raw.get("control"))


def wait_for(path: Path, timeout: float, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout:.0f} s")
        time.sleep(poll)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_on(
    hosts: RankHosts,
    num_ranks: int,
    phases: Sequence[tuple[float | None, Phase]],
    folder: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The probe on the first ``num_ranks`` rank hosts of ``hosts`` (one rank each, horovodrun
    in their head namespace, over ssh, talking on eth0), each phase under its rate limit in
    Mbit/s (None: none) on every rank host's eth0. Returns rank 0's results, each phase with
    its ``mbit``; the limits are removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    control = folder / "control"
    control.mkdir(exist_ok=True)
    for stale in control.iterdir():
        stale.unlink()
    out = folder / "probe.json"
    plan = Plan(phases=tuple(p for _, p in phases), out=str(out), control=str(control))
    plan_path = plan.write(folder / "plan.json")
    launch = hosts.launch_config(num_ranks)
    command = hosts.head.command(
        [sys.executable, "-m", "training.horovodrun", "--parent", str(os.getpid()),
         "-np", str(num_ranks), "-H", str(launch.hosts), "--network-interface", "eth0",
         "--ssh-port", str(launch.ssh_port), "--ssh-identity-file",
         str(launch.ssh_identity_file), "--disable-cache", "--gloo",
         sys.executable, "-m", "lab.allreduce_probe", str(plan_path)]
    )  # fmt: skip
    env = {
        **os.environ,
        "PATH": f"{hosts.ssh.bin}:{os.environ.get('PATH', '')}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    }
    tail: deque[str] = deque(maxlen=40)
    log = (folder / "horovodrun.log").open("w")
    try:
        with subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=Path(__file__).resolve().parents[1],
        ) as proc:  # fmt: skip
            try:
                for number, (mbit, phase) in enumerate(phases):
                    ready = control / f"ready-{number}"
                    while not ready.exists():
                        if proc.poll() is not None:
                            break
                        time.sleep(0.05)
                    if proc.poll() is not None:
                        break
                    hosts.rate_limit(mbit)
                    progress(f"allreduce probe, {num_ranks} hosts: {phase.label}")
                    (control / f"go-{number}").touch()
                returncode = proc.wait()
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
    finally:
        log.close()
        hosts.rate_limit(None)
    if returncode != 0 or not out.exists():
        tail.extend((folder / "horovodrun.log").read_text().splitlines())
        last = "\n".join(tail)
        raise RuntimeError(f"allreduce probe on {num_ranks} hosts failed ({returncode}):\n{last}")
    result: dict[str, Any] = json.loads(out.read_text())
    for (mbit, _), measured in zip(phases, result["phases"], strict=True):
        measured["mbit"] = mbit
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lab.allreduce_probe PLAN.json", file=sys.stderr)
        return 2
    plan = Plan.read(Path(args[0]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Horovod: the ranks and their collectives.
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    rank, num_ranks = hvd.rank(), hvd.size()
    token = tf.ones([1], tf.float32)

    def barrier() -> None:
        hvd.allreduce(token, op=hvd.Sum, name="probe_barrier").numpy()

    phases: list[dict[str, Any]] = []
    for number, phase in enumerate(plan.phases):
        barrier()
        if plan.control is not None:
            if rank == 0:
                control = Path(plan.control)
                (control / f"ready-{number}").touch()
                wait_for(control / f"go-{number}", GO_TIMEOUT_SECONDS)
            barrier()
        cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
        sizes = []
        for size in phase.sizes:
            values = tf.ones([size // 4], tf.float32)
            name = f"probe_{number}_{size}"
            for _ in range(phase.warmup):
                hvd.allreduce(values, op=hvd.Sum, name=name)[:1].numpy()
            seconds = []
            for _ in range(phase.repeats):
                barrier()
                start = time.perf_counter()
                total = hvd.allreduce(values, op=hvd.Sum, name=name)
                first = float(total[:1].numpy()[0])
                seconds.append(time.perf_counter() - start)
                if first != num_ranks:
                    raise RuntimeError(f"allreduce of ones over {num_ranks} ranks gave {first}")
            del values
            # Horovod: every rank's times, to rank 0.
            everyone = hvd.allgather(tf.constant([seconds], tf.float64)).numpy()
            slowest = everyone.max(axis=0).tolist()
            sizes.append(
                {
                    "bytes": size,
                    "seconds_by_rank": everyone.tolist(),
                    "seconds": slowest,
                    "median_seconds": statistics.median(slowest),
                }
            )
        cpu = hvd.allgather(tf.constant([_cpu_seconds() - cpu_start], tf.float64)).numpy()
        phases.append(
            {
                "label": phase.label,
                "sizes": sizes,
                "wall_seconds": time.perf_counter() - wall_start,
                "cpu_seconds_by_rank": np.asarray(cpu).tolist(),
            }
        )
    if rank == 0:
        result = {"num_ranks": num_ranks, "phases": phases}
        Path(plan.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({"num_ranks": num_ranks, "phases": len(phases)}), flush=True)
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
