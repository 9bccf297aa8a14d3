"""Host.rate_limit: a tc token bucket on a namespaced host's eth0 makes it send like a link of
that rate (what the scaling experiment's allreduce measurements stand on), and goes away."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from lab.netns import Hosts

pytestmark = pytest.mark.e2e

PORT = 9000
# Prints the bytes of the first connection that brings any, and the seconds from its first
# byte to its end (connections that bring nothing, as wait_for_port's probe, are skipped).
RECEIVE = """
import socket, sys, time
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2]))); server.listen(4)
received = 0
while not received:
    connection, _ = server.accept(); start = None
    while chunk := connection.recv(1 << 20):
        start = start or time.monotonic(); received += len(chunk)
print(received, time.monotonic() - start)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    s.sendall(bytes(int(sys.argv[3])))
"""
# TCP payload per 1514-byte frame with timestamps (1448 bytes), the share tbf's rate leaves to
# the data: the rest are Ethernet, IP and TCP headers.
PAYLOAD_SHARE = 1448 / 1514


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts(["w1", "w2"]) as made:
        for name in ("w1", "w2"):
            made[name].frame_every_segment()
        yield made


def _payload_mbit_per_second(hosts: Hosts, size: int) -> float:
    """A bulk TCP transfer of ``size`` bytes from w1 to w2, timed at w2's end."""
    sender, receiver = hosts["w1"], hosts["w2"]
    server = receiver.popen(
        [sys.executable, "-c", RECEIVE, receiver.address, str(PORT)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    hosts.wait_for_port(sender, receiver, PORT)
    sent = sender.run([sys.executable, "-c", SEND, receiver.address, str(PORT), str(size)])
    assert sent.returncode == 0, sent.stderr
    out, _ = server.communicate(timeout=120)
    received, seconds = out.split()
    assert int(received) == size
    return size * 8 / float(seconds) / 1e6


@pytest.mark.parametrize("mbit", [1.0, 10.0, 100.0])
def test_a_rate_limited_host_sends_at_its_rate(hosts: Hosts, mbit: float) -> None:
    hosts["w1"].rate_limit(mbit)
    try:
        # About 1.5 s of the rate: the 2 ms bucket adds a fraction of a per cent.
        size = int(mbit * 1e6 / 8 * 1.5)
        achieved = _payload_mbit_per_second(hosts, size)
    finally:
        hosts["w1"].rate_limit(None)
    # The token bucket is a ceiling (a busy machine can only be slower): the payload never
    # beats the rate's payload share; and at these rates the machine keeps up with it.
    print(f"\n{mbit:g} Mbit/s limit: {achieved:.3f} Mbit/s of TCP payload")
    assert achieved <= mbit * PAYLOAD_SHARE * 1.03
    assert achieved >= mbit * PAYLOAD_SHARE * 0.85


def test_the_limit_is_replaced_and_removed(hosts: Hosts) -> None:
    w1 = hosts["w1"]

    def root_qdisc() -> str:
        return w1.run(["tc", "qdisc", "show", "dev", "eth0", "root"]).stdout

    w1.rate_limit(10)
    w1.rate_limit(20)  # replace, not add
    assert "tbf" in root_qdisc() and "20Mbit" in root_qdisc()
    w1.rate_limit(None)
    assert "tbf" not in root_qdisc()
    w1.rate_limit(None)  # removing no limit is no error
    with pytest.raises(ValueError, match="above 0"):
        w1.rate_limit(0)
