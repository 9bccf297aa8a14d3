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
