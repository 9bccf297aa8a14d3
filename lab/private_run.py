"""One command alone in fresh network and PID namespaces, metered: the bytes it moved over its
loopback and the CPU-seconds of every process it started.

    metered(command)
      └ unshare --net --pid --fork --kill-child --mount-proc
          python -m lab.private_run OUT -- command
          └ PID 1 of the namespaces (this module's main): lo up, lo's counters, run command,
            reap every orphan, kill what is left, lo's counters again, CPU times → OUT (JSON)

Why namespaces: the machine is shared, and its own loopback carries other people's traffic; a
private network namespace has a loopback of its own, so its counters are this command's bytes
alone, and nothing in it can listen beyond that loopback. As PID 1 of a private PID namespace
the wrapper inherits and reaps every process the command leaves (Ray's daemons, horovodrun's
ranks), and its scans of the namespace's own /proc see every process of the run and no other
(``Metered.reaped_cpu_seconds`` says why scans); when it dies, the kernel kills everything
left in the namespace, and ``--kill-child`` kills it when ``unshare`` dies (Ctrl-C, a kill of
the experiment): nothing outlives the run.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

LOOPBACK = "lo"


@dataclass(frozen=True, kw_only=True)
class Metered:
    """What a command did in its namespaces."""

    returncode: int
    stdout: str
    stderr_tail: list[str]
    wall_seconds: float
    cpu_seconds: float
    """User + system time of every process of the command (the wrapper's own excluded), as
    last seen by a scan of the namespace's processes every 0.2 s: a process's last 0.2 s at
    most are missed."""
    reaped_cpu_seconds: float
    """The same from the kernel's accounting of reaped processes (``RUSAGE_CHILDREN`` of PID
    1): exact for what it counts, but a process whose parent ignores SIGCHLD is reaped by no
    one that accounts it, and its time is lost. Ray's raylet ignores SIGCHLD (its SigIgn, seen):
    for a Ray run this is far below ``cpu_seconds`` (12 against 32 CPU-s, seen)."""
    loopback_bytes: int
    """Bytes sent over the namespace's loopback (every byte on lo is sent once, received once)."""
    leftover_processes: int
    """Processes still running when the command itself had ended, killed by the wrapper."""


def loopback_sent(proc_net_dev: str = "/proc/net/dev") -> int:
    """Bytes sent on this network namespace's loopback so far."""
    for line in Path(proc_net_dev).read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == LOOPBACK:
            # Receive: bytes packets errs drop fifo frame compressed multicast; then transmit.
            return int(fields.split()[8])
    raise ShardflowError(f"no {LOOPBACK} interface in {proc_net_dev}")


def metered(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    on_line: Callable[[str], None],
    workdir: Path,
) -> Metered:
    """Run ``command`` alone in fresh network and PID namespaces (root) and meter it; its
    stderr goes line by line to ``on_line``. ``workdir`` holds the meter's report."""
    report = workdir / f"metered-{os.getpid()}-{time.monotonic_ns()}.json"
    wrapper = [
        "unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
        sys.executable, "-m", "lab.private_run", str(report), "--", *command,
    ]  # fmt: skip
    lines: list[str] = []
    with subprocess.Popen(
        wrapper, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env)
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            for line in proc.stderr:
                lines.append(line.rstrip())
                on_line(line.rstrip())
            out = proc.stdout.read()
            returncode = proc.wait()
        finally:
            # unshare --kill-child takes the namespaces' PID 1, and with it every process
            # of the command, when unshare ends.
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if not report.exists():
        last = next((x for x in reversed(lines) if x.strip()), "no output")
        raise ShardflowError(f"{command[0]} could not run in its own namespaces: {last}")
    measured: dict[str, Any] = json.loads(report.read_text())
    report.unlink()
    return Metered(
        returncode=returncode,
        stdout=out,
        stderr_tail=lines[-40:],
        wall_seconds=measured["wall_seconds"],
        cpu_seconds=measured["cpu_seconds"],
        reaped_cpu_seconds=measured["reaped_cpu_seconds"],
        loopback_bytes=measured["loopback_bytes"],
        leftover_processes=measured["leftover_processes"],
    )


def _reap_until(pid: int) -> int:
    """Reap every child (orphans are re-parented to PID 1) until ``pid`` ends; its exit code."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            return os.waitstatus_to_exitcode(status)


def _reap_all() -> int:
    """Kill every other process of this PID namespace and reap them; how many there were."""
    try:
        # From PID 1, -1 reaches every process of its namespace but itself.
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    reaped = 0
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return reaped
        except OSError as error:  # pragma: no cover - EINTR is retried by Python
            if error.errno != errno.EINTR:
                raise
        reaped += 1


class _CpuSampler(threading.Thread):
    """Every process's CPU time in this namespace, as last seen, scanned every ``every`` s."""

    def __init__(self, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.seen: dict[tuple[int, float], float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        me = os.getpid()
        while not self.stop.wait(self.every):
            for process in psutil.process_iter(["pid", "create_time", "cpu_times"]):
                info = process.info
                if info["pid"] == me or info["cpu_times"] is None:
                    continue
                times = info["cpu_times"]
                self.seen[(info["pid"], info["create_time"])] = times.user + times.system

    def total(self) -> float:
        self.stop.set()
        self.join()
        return sum(self.seen.values())


def main(argv: Sequence[str]) -> int:
    """PID 1 of the namespaces: ``OUT -- command...``."""
    out, separator, *command = argv
    assert separator == "--" and command, "usage: python -m lab.private_run OUT -- command..."
    subprocess.run(["ip", "link", "set", LOOPBACK, "up"], check=True)
    before = loopback_sent()
    start = time.monotonic()
    # As PID 1 this process ignores signals it has no handler for: pass the usual stops on.
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"shardflow: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return 127
    sampler = _CpuSampler()
    sampler.start()
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda number, _frame: child.send_signal(number))
    returncode = _reap_until(child.pid)
    sampled = sampler.total()
    leftover = _reap_all()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(out).write_text(
        json.dumps(
            {
                "wall_seconds": time.monotonic() - start,
                "cpu_seconds": sampled,
                "reaped_cpu_seconds": usage.ru_utime + usage.ru_stime,
                "loopback_bytes": loopback_sent() - before,
                "leftover_processes": leftover,
            }
        )
    )
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
