"""Hosts on one machine: Linux network namespaces joined by a bridge (docs/cluster.md,
shared CLUSTER.md). The cluster tests and the multi-host experiments (lab.experiments)
run on them; it needs root, ``ip`` (iproute2) and, for Horovod across hosts, Debian's sshd.

    root namespace: bridge br<id> (no address: the root namespace has no route to the hosts)
      ├─ veth <id>0 ── eth0 in namespace <id>-sched  10.77.<k>.1
      ├─ veth <id>1 ── eth0 in namespace <id>-w1     10.77.<k>.2
      └─ ...

Every participant (scheduler, workers, ranks, launcher, client) runs inside a namespace,
through :meth:`Host.popen`/:meth:`Host.run`; nothing in the root namespace ever connects to
these addresses (its default route would send that traffic off the machine). Each namespace
has the same inner interface name (``eth0``), ``lo`` up, IPv6 off, and its own
``/etc/netns/<ns>/hosts`` mapping this machine's hostname (and every host's name) to its own
address, which ``ip netns exec`` bind-mounts over /etc/hosts: Horovod's process-set Gloo
context resolves ``gethostname()``.

:class:`Hosts` is a context manager that removes all of it (processes, namespaces, the bridge,
the hosts files) however the block ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import LaunchConfig

NETNS_ETC = Path("/etc/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One namespace, as a host: its name, its address, the processes started in it."""

    name: str
    """The host name the others know it by (also its namespace's suffix)."""
    namespace: str
    address: str
    veth: str
    """The root namespace's end of its link (its counters: bytes this host sent and got)."""
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, args: Sequence[str], *, nsenter: bool = False) -> list[str]:
        """``args`` run inside this host's namespace: ``ip netns exec`` (with this host's
        /etc/hosts), or ``nsenter --net`` (keeps /sys and cgroups: slurmd needs them)."""
        if nsenter:
            return ["nsenter", f"--net=/run/netns/{self.namespace}", *args]
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: Sequence[str], *, nsenter: bool = False, **kwargs: Any) -> Any:
        """Start ``args`` in this host, in a session of its own; stopped with the hosts."""
        process = subprocess.Popen(
            self.command(args, nsenter=nsenter), start_new_session=True, **kwargs
        )
        self.processes.append(process)
        return process

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(args), check=False, **kwargs)

    def bytes_sent(self) -> int:
        """Bytes this host has sent on its link (the bridge end receives them)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def bytes_received(self) -> int:
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())

    def frame_every_segment(self) -> None:
        """Send every TCP segment as a frame of its own (``gso_max_segs 1`` on eth0), as a
        real Ethernet link does, so that the counters include each segment's headers: veth
        otherwise passes GSO packets of up to 64 KiB whole, counting one header for each."""
        done = self.run(["ip", "link", "set", "dev", "eth0", "gso_max_segs", "1"])
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: cannot set gso_max_segs: {done.stderr.strip()}")

    def rate_limit(self, mbit: float | None) -> None:
        """Make this host's eth0 send at most ``mbit`` Mbit/s (a token bucket, ``tc tbf``, as
        the root qdisc); None: remove the limit. Only what the host sends is shaped: with
        every host limited, each link carries ``mbit`` each way, like a full-duplex link.

        The bucket holds 2 ms of the rate (at least 4 KiB, a few frames), so that a burst
        after an idle moment adds little to a transfer of a second or more; the queue holds
        100 ms of the rate (at least 64 KiB), enough for TCP to keep the link busy (netem is
        not in this kernel, shared CLUSTER.md)."""
        if mbit is None:
            shown = self.run(["tc", "qdisc", "show", "dev", "eth0", "root"]).stdout
            if " tbf " in shown:
                done = self.run(["tc", "qdisc", "del", "dev", "eth0", "root"])
                if done.returncode != 0:
                    raise RuntimeError(f"{self.name}: cannot remove the rate limit: {done.stderr}")
            return
        if not mbit > 0:
            raise ValueError(f"a rate limit must be above 0 Mbit/s, got {mbit}")
        bytes_per_second = mbit * 1e6 / 8
        burst = max(int(bytes_per_second * 0.002), 4096)
        limit = max(int(bytes_per_second * 0.1), 65536)
        done = self.run(
            ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
             f"{int(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: cannot limit eth0 to {mbit} Mbit/s: {done.stderr}")

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()


class Hosts:
    """Namespaces ``names`` on one bridge, for the block's duration."""

    def __init__(self, names: Sequence[str]) -> None:
        self.id = secrets.token_hex(2)
        # A /24 of its own per set of hosts, so that two sets never share addresses.
        self.subnet = f"10.77.{int(self.id, 16) % 250 + 1}"
        self.bridge = f"br{self.id}"
        self.hosts = {
            name: Host(
                name=name,
                namespace=f"sf{self.id}-{name}",
                address=f"{self.subnet}.{number}",
                veth=f"v{self.id}{number}",
            )
            for number, name in enumerate(names, start=1)
        }

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hostname = socket.gethostname()
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns",
                host.namespace)  # fmt: skip
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            for setting in ("all", "default"):
                subprocess.run(
                    ["ip", "netns", "exec", host.namespace, "sysctl", "-qw",
                     f"net.ipv6.conf.{setting}.disable_ipv6=1"],
                    check=True, capture_output=True,
                )  # fmt: skip
            etc = NETNS_ETC / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            others = "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {hostname}\n{others}")

    def close(self) -> None:
        for host in self.hosts.values():
            host.stop()
        for host in self.hosts.values():
            # What the hosts' own servers started (ranks under sshd sessions, in sessions of
            # their own): every process still in the namespace.
            pids = subprocess.run(
                ["ip", "netns", "pids", host.namespace], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def wait_for_port(self, client: Host, server: Host, port: int, timeout: float = 60) -> None:
        """Until ``server`` accepts connections on ``port``, asked from inside ``client``."""
        probe = (
            "import socket, sys; s = socket.socket(); s.settimeout(1); "
            f"sys.exit(s.connect_ex(('{server.address}', {port})))"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.run(["python3", "-c", probe]).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{server.name}:{port} did not answer within {timeout:.0f} s")


@dataclass(frozen=True)
class Ssh:
    """A throwaway ssh identity: sshd on some hosts accepts it, and ``bin`` holds an ``ssh``
    that keeps the host keys it meets in its own known_hosts (never root's ~/.ssh)."""

    identity: Path
    bin: Path
    port: int


def start_sshd(hosts: Sequence[Host], folder: Path, *, port: int = 22) -> Ssh:
    """sshd (Debian openssh-server) on ``port`` in each of ``hosts``, accepting one new key.

    As shared CLUSTER.md has it: its own host key, authorized key file and config, ``UsePAM
    no``, ``StrictModes no``; /run/sshd must exist. The ``ssh`` in ``bin`` is the one
    horovodrun finds on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    identity = folder / "id_ed25519"
    host_key = folder / "host_ed25519"
    for key in (identity, host_key):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
            check=True, capture_output=True,
        )  # fmt: skip
    (folder / "authorized_keys").write_text(Path(f"{identity}.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)
    for host in hosts:
        config = folder / f"sshd-{host.name}.conf"
        config.write_text(
            f"Port {port}\nListenAddress {host.address}\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nUsePAM no\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            f"PidFile {folder / f'sshd-{host.name}.pid'}\nLogLevel ERROR\n"
        )
        host.popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec /usr/bin/ssh -o UserKnownHostsFile={folder / 'known_hosts'} "
        '-o LogLevel=ERROR "$@"\n'
    )
    wrapper.chmod(0o755)
    return Ssh(identity=identity, bin=bin_dir, port=port)


@dataclass
class RankHosts:
    """Namespaced hosts ``head`` (where horovodrun runs) and ``w1..wN`` (one rank each, sshd
    on :attr:`ssh`'s port), as :func:`rank_hosts` made them."""

    hosts: Hosts
    ssh: Ssh
    rank_names: tuple[str, ...]

    @property
    def head(self) -> Host:
        return self.hosts["head"]

    def launch_config(self, num_ranks: int, *, threads_per_rank: int = 0) -> LaunchConfig:
        """The launch that puts ``num_ranks`` ranks on the first ``num_ranks`` rank hosts,
        talking over eth0, one rank per host."""
        if not 1 <= num_ranks <= len(self.rank_names):
            raise ValueError(f"{num_ranks} ranks on {len(self.rank_names)} rank hosts")
        return LaunchConfig(
            hosts=",".join(f"{name}:1" for name in self.rank_names[:num_ranks]),
            network_interface="eth0",
            ssh_port=self.ssh.port,
            ssh_identity_file=str(self.ssh.identity),
            disable_cache=True,
            threads_per_rank=threads_per_rank,
        )

    def bytes_sent(self) -> dict[str, int]:
        """Bytes each rank host has sent on its link so far (its veth counter)."""
        return {name: self.hosts[name].bytes_sent() for name in self.rank_names}

    def rate_limit(self, mbit: float | None) -> None:
        """:meth:`Host.rate_limit` on every rank host's eth0 (None: no limit)."""
        for name in self.rank_names:
            self.hosts[name].rate_limit(mbit)


@contextlib.contextmanager
def rank_hosts(
    num_hosts: int, folder: Path, *, ssh_port: int = 2222, frame_every_segment: bool = True
) -> Iterator[RankHosts]:
    """``head`` and ``num_hosts`` rank hosts on one bridge, sshd on every rank host, for the
    block's duration; everything (processes, namespaces, links) is removed however it ends.

    ``frame_every_segment``: each rank host sends every TCP segment as a frame of its own, so
    that the veth counters count bytes as a real Ethernet link does (:meth:`Host.
    frame_every_segment`)."""
    if os.geteuid() != 0:
        raise PermissionError(
            "namespaced hosts need root (ip netns, veth links, sshd): run as root, or on real "
            "hosts with --hosts"
        )
    names = tuple(f"w{number}" for number in range(1, num_hosts + 1))
    with Hosts(["head", *names]) as hosts:
        if frame_every_segment:
            for name in names:
                hosts[name].frame_every_segment()
        ssh = start_sshd([hosts[name] for name in names], folder, port=ssh_port)
        for name in names:
            hosts.wait_for_port(hosts["head"], hosts[name], ssh_port)
        yield RankHosts(hosts=hosts, ssh=ssh, rank_names=names)
