"""The check before a multi-host run: each remote host's code fingerprint, read from what its
probe printed, whatever a library warned on stderr after it."""

from __future__ import annotations

import pytest

from data_catalog.errors import ShardflowError
from training import hosts
from training.config import LaunchConfig
from training.fingerprint import model_code


def _answering(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    monkeypatch.setattr(hosts, "remote_hosts", lambda config, num_ranks: ["w1"])
    monkeypatch.setattr(
        hosts, "_ask", lambda config, host, remote: hosts.HostAnswer(host, 0, output)
    )


def test_a_warning_after_the_fingerprint_is_not_taken_for_other_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _answering(monkeypatch, f"{model_code()}\nsome library: its cache folder isn't writable)")
    assert hosts.check_hosts(LaunchConfig(hosts="w1:2"), 2) == ["w1"]


def test_a_host_with_other_code_is_refused_naming_its_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _answering(monkeypatch, "src-0123456789abcdef\na warning")
    with pytest.raises(ShardflowError, match=r"host w1 runs other training code \(src-0123"):
        hosts.check_hosts(LaunchConfig(hosts="w1:2"), 2)
