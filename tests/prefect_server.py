"""`shardflow server` on a free loopback port, for the tests that need a real Prefect server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

BIN = Path(sys.executable).parent


@contextmanager
def shardflow_server(env: dict[str, str], log_path: Path, start_seconds: float) -> Iterator[str]:
    """`shardflow server` started with ``env`` (PREFECT_API_URL removed: it is the server),
    its output in ``log_path``; yields its base URL once healthy, stops it when the block ends.
    A server that ends or stays unhealthy for ``start_seconds`` fails the test with its log."""
    env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "shardflow"), "server", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_seconds
            while True:
                try:
                    if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("Prefect server did not start:\n" + log_path.read_text())
                time.sleep(1)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
