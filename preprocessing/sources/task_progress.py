"""Progress of a task that runs on a Dask worker, carried back to the command that runs it.

    task on a worker ── report(message) ── worker.log_event(TOPIC, message)
        │                                          (in this process: this module's log)
        ▼
    driver: client.subscribe_topic(TOPIC, ...) ── the command's progress (stderr, --verbose)

    a job run in the command's own process (no cluster): ``to(progress)`` around its tasks

Without it a task's progress (a slow server retried, a reply capped) ends in the worker's log,
which nothing shows: the command looked stuck while it waited.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

TOPIC = "shardflow-progress"

_log = logging.getLogger(__name__)
_here: list[Callable[[str], None]] = []


@contextmanager
def to(progress: Callable[[str], None]) -> Iterator[None]:
    """Within the block, what tasks running in this process report goes to ``progress``."""
    _here.append(progress)
    try:
        yield
    finally:
        _here.pop()


def report(message: str) -> None:
    """One line of a task's progress: to the driver when on a Dask worker; in the command's
    own process, to its progress (:func:`to`); else this log."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        if _here:
            _here[-1](message)
        else:
            _log.info("%s", message)
        return
    worker.log_event(TOPIC, message)


def retries_only(message: str) -> None:
    """:func:`report` for a fetch's waits before another attempt; its byte counts stay out."""
    if "retrying in" in message:
        report(message)
