"""The namespaced hosts themselves: they reach each other by address and by name, count the
bytes they send, and vanish afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lab.netns import Hosts

pytestmark = pytest.mark.e2e


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_hosts_talk_by_name_and_leave_nothing_behind() -> None:
    with Hosts(["w1", "w2"]) as hosts:
        w1, w2 = hosts["w1"], hosts["w2"]
        server = w1.popen(
            [sys.executable, "-m", "http.server", "8000", "--bind", w1.address],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        hosts.wait_for_port(w2, w1, 8000)
        sent_before = w1.bytes_sent()
        fetched = w2.run(
            [sys.executable, "-c", "import urllib.request; "
             "print(len(urllib.request.urlopen('http://w1:8000/', timeout=10).read()))"]
        )  # fmt: skip
        assert fetched.returncode == 0, fetched.stderr
        assert int(fetched.stdout) > 0
        assert w1.bytes_sent() > sent_before
        # The machine's own name means each host itself, as Horovod's Gloo contexts need.
        resolved = w2.run([sys.executable, "-c", "import socket; "
                           "print(socket.gethostbyname(socket.gethostname()))"])  # fmt: skip
        assert resolved.stdout.strip() == w2.address
        namespaces = {w1.namespace, w2.namespace}
        assert namespaces <= _namespaces()
        assert server.poll() is None
    assert server.poll() is not None
    assert not namespaces & _namespaces()
