"""The installed environment is the one requirements/lock.txt describes where it matters for
security: setuptools out of CVE-2024-6345's range (fixed in 70.0), petastorm the local re-pack
that no longer holds it below 70, and pip's own check clean (docs/STACK.md)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

# CVE-2024-6345 (remote code execution through setuptools' package_index) is fixed in 70.0.
SETUPTOOLS_FIXED = Version("70.0")


def test_setuptools_is_out_of_the_cve_range() -> None:
    installed = Version(metadata.version("setuptools"))
    assert installed >= SETUPTOOLS_FIXED, f"setuptools {installed}: run make setup"


def test_petastorm_no_longer_holds_setuptools_back() -> None:
    assert metadata.version("petastorm") == "0.13.1+shardflow.1"
    requires = [Requirement(r) for r in metadata.requires("petastorm") or []]
    assert "setuptools" not in {r.name for r in requires}
    # The rest of what petastorm 0.13.1 asks is still asked.
    assert {"pyarrow", "pyspark", "numpy", "pandas", "fsspec"} <= {r.name for r in requires}


def test_pip_check_is_clean() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "No broken requirements found." in checked.stdout
