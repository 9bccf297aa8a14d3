"""A process's reported peak RSS is its own: not the size of the parent that spawned it (Linux
starts ``ru_maxrss`` of an exec'd child at its parent's high-water mark, which made every Dask
worker and benchmarked command report at least its parent's size)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from preprocessing.driver import peak_rss_bytes


def test_a_child_reports_its_own_peak_not_its_parents() -> None:
    held = np.ones(400 * 2**20 // 8)  # this process: over 400 MiB
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource; from preprocessing.driver import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    own, inherited = (int(v) for v in child.stdout.split())
    assert inherited >= 400 * 2**20  # what ru_maxrss says
    assert own < 200 * 2**20  # numpy and pyarrow imported: well under the parent's 400 MiB
    assert peak_rss_bytes() >= held.nbytes
