"""Real test data for the sources: the 20 CIFAR-10 test images inside foolbox's wheel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
WHEELS = REPO / ".cache/wheels"
FOOLBOX_WHEEL = WHEELS / "foolbox-3.3.4-py3-none-any.whl"
PREFETCH = (
    ".venv/bin/python -m pip download --no-deps --only-binary=:all: -d .cache/wheels foolbox==3.3.4"
)


@pytest.fixture(scope="session")
def foolbox_wheel() -> Path:
    """foolbox 3.3.4's wheel, from .cache/wheels, downloaded there from PyPI when missing."""
    if not FOOLBOX_WHEEL.exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--only-binary=:all:", "-d", str(WHEELS), "foolbox==3.3.4"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not FOOLBOX_WHEEL.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.fail(
                f"cannot get {FOOLBOX_WHEEL.name} ({last}); in the repository run `{PREFETCH}` "
                "(or `make test`, which does)"
            )
    return FOOLBOX_WHEEL
