"""lab.private_run: a command alone in its own network and PID namespaces (root), metered."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from data_catalog.errors import ShardflowError
from lab.private_run import metered

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)

# Sends 3 MB to itself over TCP on 127.0.0.1, leaves a sleeping grandchild behind, burns CPU
# (0.5 s), then idles.
PROGRAM = textwrap.dedent(
    """
    import socket, subprocess, sys, time
    subprocess.Popen(["sleep", "600"], start_new_session=True)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    payload = b"x" * (3 * 1024 * 1024)
    client.sendall(payload)
    client.close()
    got = 0
    while chunk := peer.recv(1 << 16):
        got += len(chunk)
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    # Idle at the end: the meter's scans miss a process's last 0.2 s (Metered.cpu_seconds), and
    # a scan delayed on a busy host missed more of a burn that ran to the exit (0.38 of 0.5 s).
    time.sleep(1.0)
    print(got)
    sys.exit(3)
    """
)


def test_metered_counts_its_loopback_bytes_and_cpu_and_leaves_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    run = metered(
        [sys.executable, "-c", PROGRAM], env=os.environ, on_line=lines.append, workdir=tmp_path
    )
    assert run.returncode == 3
    assert run.stdout.strip() == str(3 * 1024 * 1024)
    # Its own loopback: the 3 MB and their headers, none of the machine's other traffic.
    assert 3 * 1024 * 1024 <= run.loopback_bytes < 4 * 1024 * 1024
    assert run.cpu_seconds >= 0.4
    # The sleeping grandchild was killed, not left running.
    assert run.leftover_processes == 1
    assert list(tmp_path.iterdir()) == []


def test_a_command_that_cannot_start_is_named(tmp_path: Path) -> None:
    with pytest.raises(ShardflowError, match="cannot run /nonexistent/engine"):
        metered(["/nonexistent/engine"], env=os.environ, on_line=lambda _: None, workdir=tmp_path)


def _running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_ctrl_c_of_the_caller_ends_every_process_of_the_run(tmp_path: Path) -> None:
    marker = f"{os.getpid() % 1000 + 7000}.25"
    caller = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys
        from pathlib import Path
        from lab.private_run import metered
        # As a terminal's foreground command: a pytest started in the background of a script
        # (bash `&`) hands its children SIGINT ignored, and Python then installs no
        # KeyboardInterrupt for it (the test failed so, in a full run started that way).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        script = ("import subprocess, time; "
                  "subprocess.Popen(['sleep', '{marker}'], start_new_session=True); "
                  "time.sleep(600)")
        metered([sys.executable, "-c", script], env=os.environ, on_line=print,
                workdir=Path({str(tmp_path)!r}))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", caller], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _running(f"sleep\0{marker}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(f"sleep\0{marker}"), "the run never started"
        # Ctrl-C: SIGINT to the caller's whole process group, as a terminal sends it.
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _running(f"sleep\0{marker}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(f"sleep\0{marker}") == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
