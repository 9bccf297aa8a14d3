"""A real single-node SLURM for tests: Debian's munged, slurmctld and slurmd (22.05), all on
loopback, every file in one temporary folder (shared CLUSTER.md, "SLURM").

    root/munge/   munge.key (made here), munge.sock    munged -F, its own key and socket
    root/slurm.conf                                      SLURM_CONF for daemons and clients
    root/state/ root/spool/ root/log/                    slurmctld -D, slurmd -D
          │
          ▼  SlurmctldHost=<hostname>(127.0.0.1), NodeName=<hostname> NodeAddr=127.0.0.1,
             CPUs=2, ports chosen free on 127.0.0.1, proctrack/linuxproc, task/none

``ip netns exec`` remounts /sys and hides the cgroups slurmd looks for, so nothing here runs in
a namespace: every port is on 127.0.0.1 and every client (sbatch, srun, squeue, scancel) finds
the controller through ``SLURM_CONF``. :func:`single_node_slurm` cancels every job, then stops
the daemons by PID, however the block ends; :func:`slurm_cluster` is the module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel")
PARTITION = "debug"
NODE_CPUS = 2
START_SECONDS = 60.0
STOP_SECONDS = 30.0


def missing_reason() -> str | None:
    """Why this machine cannot run the single-node SLURM, or None."""
    if os.geteuid() != 0:
        return "a single-node SLURM needs root (slurmd runs jobs as their users)"
    missing = [name for name in DAEMONS if shutil.which(name, path=_PATH) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed: `make test` installs Debian's slurmctld, "
            "slurmd, slurm-client and munge"
        )
    return None


_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _memory_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


@dataclass
class Slurm:
    """A running single-node SLURM: its config, its folder, its daemons."""

    root: Path
    hostname: str = field(default_factory=socket.gethostname)
    processes: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def jobcomp(self) -> Path:
        """One line per finished job (jobcomp/filetxt; this SLURM has no slurmdbd for sacct)."""
        return self.root / "log" / "jobcomp.txt"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` and the daemons' folder on PATH."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _PATH}

    def run(
        self, *args: str, timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("env", self.env)
        return subprocess.run(
            list(args), capture_output=True, text=True, check=False, timeout=timeout, **kwargs
        )

    def finished_jobs(self) -> list[dict[str, str]]:
        """The jobcomp records of the jobs that ended, as {field: value}."""
        if not self.jobcomp.exists():
            return []
        return [
            dict(item.split("=", 1) for item in line.split() if "=" in item)
            for line in self.jobcomp.read_text().splitlines()
            if line.strip()
        ]

    def queued_jobs(self) -> list[str]:
        done = self.run("squeue", "-h", "-o", "%i")
        return done.stdout.split() if done.returncode == 0 else []

    # --- start and stop ----------------------------------------------------------------------

    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its folder searchable by all for the socket (it only warns otherwise).
        self.root.chmod(0o755)
        (self.root / "munge").chmod(0o755)
        srun_ports = random.Random().randrange(40000, 59000, 100)
        memory = max(1024, _memory_mib() // 2)
        lines = {
            "ClusterName": "shardflow-test",
            "SlurmctldHost": f"{self.hostname}(127.0.0.1)",
            "SlurmctldPort": str(free_port()),
            "SlurmdPort": str(free_port()),
            "SrunPortRange": f"{srun_ports}-{srun_ports + 99}",
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.root / 'munge' / 'munge.sock'}",
            "StateSaveLocation": str(self.root / "state"),
            "SlurmdSpoolDir": str(self.root / "spool"),
            "SlurmctldPidFile": str(self.root / "slurmctld.pid"),
            "SlurmdPidFile": str(self.root / "slurmd.pid"),
            "SlurmctldLogFile": str(self.root / "log" / "slurmctld.log"),
            "SlurmdLogFile": str(self.root / "log" / "slurmd.log"),
            # cgroups are not for a test: track a job's processes by parentage, bind nothing.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "MailProg": "/bin/true",
            "ReturnToService": "2",
            "SlurmdParameters": "config_overrides",
            "JobCompType": "jobcomp/filetxt",
            "JobCompLoc": str(self.jobcomp),
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "MinJobAge": "600",
        }
        text = "".join(f"{key}={value}\n" for key, value in lines.items())
        text += (
            f"NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} "
            f"RealMemory={memory} State=UNKNOWN\n"
            f"PartitionName={PARTITION} Nodes={self.hostname} Default=YES MaxTime=INFINITE "
            "State=UP\n"
        )
        self.conf.write_text(text)

    def _start(self, name: str, args: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("w")
        self.processes[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    def start(self) -> None:
        self.write_config()
        munge = self.root / "munge"
        subprocess.run(
            ["mungekey", "--create", "--keyfile", str(munge / "munge.key")],
            check=True, capture_output=True, env=self.env,
        )  # fmt: skip
        self._start(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
             f"--socket={munge / 'munge.sock'}", f"--pid-file={munge / 'munged.pid'}",
             f"--seed-file={munge / 'munged.seed'}", f"--log-file={self.root / 'log/munged.log'}",
             "--origin=127.0.0.1"],
        )  # fmt: skip
        self._wait(lambda: (munge / "munge.sock").exists(), "munged's socket")
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.hostname])
        self._wait(self._node_idle, f"node {self.hostname} idle in sinfo")

    def _node_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-n", self.hostname, "-o", "%T", timeout=20)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {START_SECONDS:g} s: {self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
            for path in sorted((self.root / "log").glob("*"))
            if path.is_file()
        )

    def stop(self) -> None:
        """scancel every job (and wait for them to end), then the daemons by PID."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                jobs = self.queued_jobs()
                if jobs:
                    self.run("scancel", "--full", *jobs, timeout=30)
                deadline = time.monotonic() + STOP_SECONDS
                while self.queued_jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()


@contextlib.contextmanager
def single_node_slurm(root: Path) -> Iterator[Slurm]:
    """munged, slurmctld and slurmd from ``root``, for the block's duration."""
    slurm = Slurm(root)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """A single-node SLURM for the module, ``SLURM_CONF`` set in this process's environment
    (the CLI's subprocesses, and their sbatch calls, inherit it)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    # A short path: munged's socket path must fit in sockaddr_un (108 bytes).
    root = Path(tmp_path_factory.mktemp("slurm", numbered=True))
    with single_node_slurm(root) as slurm, pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(slurm.conf))
        patch.setenv("PATH", _PATH)
        yield slurm
