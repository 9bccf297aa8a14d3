"""MNIST ingest through the download cache: an interrupted run's whole files are reused."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog
from preprocessing.driver import PassProgress, run_job, serial_runner
from preprocessing.sources import idx, mnist


class Interrupted(Exception):
    pass


def _source(directory: Path) -> Path:
    rng = np.random.default_rng(5)
    directory.mkdir()
    for prefix, n in (("train", 60), ("t10k", 20)):
        pixels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        idx.write(directory / f"{prefix}-images-idx3-ubyte.gz", pixels, compress=True)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        idx.write(directory / f"{prefix}-labels-idx1-ubyte.gz", labels, compress=True)
    return directory


class CrashAfter:
    """Runs tasks in this process and raises after ``count`` of them, as a crash would."""

    def __init__(self, count: int) -> None:
        self.count = count

    def run(self, tasks: Any, *, run_key: str, on_done: Any) -> list[Any]:
        results = []
        for index, spec in enumerate(tasks):
            if index == self.count:
                raise Interrupted
            results.append(spec.fn(*spec.args))
            on_done(index, results[-1])
        return results


def test_rerun_reuses_files_fetched_before_the_crash_then_forgets_them(tmp_path: Path) -> None:
    source = _source(tmp_path / "source")
    catalog = Catalog(tmp_path / "catalog")
    cache, work = tmp_path / "downloads", tmp_path / "work"
    job = mnist.plan_ingest("mnist", source=str(source), cache=cache)

    with pytest.raises(Interrupted):
        run_job(catalog, job, runner=lambda: nullcontext(CrashAfter(3)), work_root=work)
    assert catalog.names() == []
    assert len(list(cache.glob("*.sha256"))) == 3  # train images, train labels, t10k images

    seen: list[PassProgress] = []
    manifest = run_job(catalog, job, runner=serial_runner, work_root=work, on_progress=seen.append)
    assert manifest.rows == 80
    assert seen[-1].reused == 3  # fetched and checked before the crash: kept
    assert {s["file"]: s["uri"] for s in manifest.sources} == {
        p.name: p.as_uri() for p in source.iterdir()
    }
    assert list(cache.iterdir()) == []  # committed: the catalog holds the bytes
    assert not any(work.glob("mnist-idx-*/"))  # and the job's folder is gone
    assert catalog.verify() == []
