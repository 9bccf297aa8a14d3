"""Cluster provisioning apart from any job: the log filters that keep a stopped run to one
line. (The LocalCluster, a given scheduler and SLURM run jobs in test_driver.py,
test_sdss_cluster.py and tests/cluster/test_slurm.py.)"""

from __future__ import annotations

import logging
import sys

from preprocessing.cluster import _not_a_cancel_race


def test_the_cancel_race_of_distributed_sync_is_not_logged_but_other_errors_are() -> None:
    """distributed's `sync()` raises NameError in its loop thread when Ctrl-C comes before the
    coroutine started (seen once in the Ctrl-C test under load): not the command's error."""

    def record(error: BaseException, message: str) -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            exc_info = sys.exc_info()
        return logging.LogRecord(
            "tornado.application", logging.ERROR, __file__, 1, message, None, exc_info
        )

    race = "Exception in callback functools.partial(<function sync.<locals>.cancel at 0x7f>)"
    free_variable = NameError("cannot access free variable 'future'")
    assert not _not_a_cancel_race(record(free_variable, race))
    assert _not_a_cancel_race(record(ValueError("x"), race))
    assert _not_a_cancel_race(record(free_variable, "Exception in callback <other>"))


def _where(_number: int) -> dict[str, str]:
    import threading
    import time

    time.sleep(0.1)  # long enough that a pool's second thread takes the next task
    return {"thread": threading.current_thread().name}


def _run_passes(
    passes: list[list[tuple[int, bool]]], in_process_bytes: int
) -> tuple[list[str], list[set[str]]]:
    """Each pass's tasks ((bytes, threads) each) through a planned runner of 2 workers: what
    it said, and the threads each pass's tasks ran on."""
    from preprocessing.cluster import planned_runner
    from preprocessing.config import ClusterConfig
    from preprocessing.driver import TaskSpec

    said: list[str] = []
    where: list[set[str]] = []
    config = ClusterConfig(workers=2, in_process_bytes=in_process_bytes)
    with planned_runner(config, said.append) as runner:
        for number, tasks in enumerate(passes):
            specs = [
                TaskSpec(key=f"t-{i}", fn=_where, args=(i,), bytes=size, threads=threads)
                for i, (size, threads) in enumerate(tasks)
            ]
            results = runner.run(specs, run_key=f"pass{number}", on_done=lambda _i, _r: None)
            where.append({r["thread"] for r in results})
    return said, where


def test_a_small_job_runs_its_tasks_on_threads_where_they_release_the_gil() -> None:
    # Small, GIL-free tasks: the command's 2 threads, no cluster.
    said, where = _run_passes([[(10, True)] * 4], in_process_bytes=1_000)
    assert said == ["4 tasks reading 0 MiB: on 2 threads of this process, no cluster started"]
    assert "MainThread" not in where[0] and len(where[0]) == 2
    # One task: no pool for it.
    said, where = _run_passes([[(10, True)]], in_process_bytes=1_000)
    assert said == ["1 tasks reading 0 MiB: in this process, no cluster started"]
    assert where == [{"MainThread"}]
    # A later pass that holds the GIL (an image set's decoding): one after the other, still
    # no cluster.
    said, where = _run_passes([[(10, True)] * 2, [(10, False)] * 2], in_process_bytes=1_000)
    assert not any("dask" in line.lower() for line in said), said
    assert where[1] == {"MainThread"}


def test_a_large_single_task_that_releases_the_gil_starts_no_cluster() -> None:
    said, where = _run_passes([[(10_000, True)]], in_process_bytes=1_000)
    assert said == ["1 tasks reading 0 MiB: on 1 threads of this process, no cluster started"]
    assert where[0] != {"MainThread"}
