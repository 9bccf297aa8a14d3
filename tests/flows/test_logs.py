"""Where library log lines go: the terminal, the log file, or both."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.logs import CHATTY, SHUTDOWN_DETAILS, route_library_logs


@pytest.fixture
def restored_loggers() -> Iterator[None]:
    """Every chatty logger's handlers, filters, propagation and level as they were, afterwards;
    during the test, no log file routed by an earlier test in this process (as in a fresh
    command)."""
    names = {*CHATTY, *(name for name, _start in SHUTDOWN_DETAILS)}
    saved = [
        (logger, list(logger.handlers), list(logger.filters), logger.propagate, logger.level)
        for logger in map(logging.getLogger, sorted(names))
    ]
    for logger, handlers, *_rest in saved:
        logger.handlers = [h for h in handlers if h.get_name() != "shardflow-log-file"]
    try:
        yield
    finally:
        for logger, handlers, filters, propagate, level in saved:
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers = handlers
            logger.filters = filters
            logger.propagate = propagate
            logger.setLevel(level)


def _distributed_to_stderr() -> None:
    """The "distributed" logger with a stderr handler of its own, as Dask configures it when
    first imported (made in the test itself: pytest swaps sys.stderr between a fixture's setup
    and the test)."""
    logger = logging.getLogger("distributed")
    logger.handlers = [h for h in logger.handlers if type(h) is not logging.StreamHandler]
    logger.addHandler(logging.StreamHandler(sys.stderr))
    logger.propagate = False
    logger.setLevel(logging.INFO)


@pytest.mark.parametrize("dask_first", [True, False], ids=["dask-first", "dask-imported-later"])
def test_a_nanny_killing_its_worker_at_shutdown_reaches_the_log_file_only(
    restored_loggers: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], dask_first: bool
) -> None:
    # The CLI routes its logs before anything imports Dask; a Prefect flow run after.
    if dask_first:
        _distributed_to_stderr()
    path = route_library_logs(tmp_path / "logs")
    if not dask_first:
        _distributed_to_stderr()
    nanny = logging.getLogger("distributed.nanny")
    nanny.warning("Worker process still alive after %.1f seconds, killing", 4.0)
    nanny.warning("Restarting worker")  # any other warning still reaches the terminal

    terminal = capsys.readouterr().err
    assert "still alive" not in terminal
    assert "Restarting worker" in terminal
    logged = path.read_text()
    assert "WARNING distributed.nanny: Worker process still alive after 4.0 seconds, killing" in (
        logged
    )
    assert "Restarting worker" in logged
