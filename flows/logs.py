"""Where log lines go: the terminal shows a command's own progress and every warning; the
libraries' chatter (Dask's scheduler, nanny and worker start and stop lines) goes to
``$SHARDFLOW_HOME/logs/shardflow.log`` instead (a flow run's own lines also reach its API)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

# Loggers whose INFO lines are about the machinery, not the user's work.
CHATTY = ("distributed", "tornado", "asyncio", "fsspec", "numexpr")
_HANDLER_NAME = "shardflow-log-file"
# (logger, start of the message) of warnings that are details of shutting down, not something
# the user acts on: a LocalCluster's nanny, closing, kills a worker process that did not end in
# time (a busy machine, a task still running).
SHUTDOWN_DETAILS = (("distributed.nanny", "Worker process still alive after"),)


def _chatter(record: logging.LogRecord) -> bool:
    """False for a library's line below WARNING (the filter drops it from the terminal)."""
    if record.levelno >= logging.WARNING:
        return True
    return not any(record.name == n or record.name.startswith(n + ".") for n in CHATTY)


def _shutdown_detail_to_file_only(record: logging.LogRecord) -> bool:
    """On the loggers of :data:`SHUTDOWN_DETAILS`: such a line goes to the log file alone.

    A logger's filter, not a terminal handler's: Dask adds its stderr handler when it is
    first imported, after the command routed its logs."""
    if not any(
        record.name == name and record.getMessage().startswith(start)
        for name, start in SHUTDOWN_DETAILS
    ):
        return True
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            if handler.get_name() == _HANDLER_NAME and record.levelno >= handler.level:
                handler.handle(record)
        logger = logger.parent if logger.propagate else None
    return False


def _to_terminal(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return stream in (sys.stderr, sys.stdout) or type(handler).__name__ == "PrefectConsoleHandler"


def route_library_logs(log_dir: Path) -> Path:
    """Keep the libraries' INFO lines off the terminal and in ``log_dir/shardflow.log``
    (idempotent: call it again after a library configured its logging)."""
    path = log_dir / "shardflow.log"
    chatty = [logging.getLogger(name) for name in CHATTY]
    to_file: logging.Handler | None = None
    # Not on the root logger: Prefect leaves logging alone when the root already has a handler.
    for logger in chatty:
        if any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
            continue
        if to_file is None:
            log_dir.mkdir(parents=True, exist_ok=True)
            to_file = logging.FileHandler(path)
            to_file.set_name(_HANDLER_NAME)
            to_file.setLevel(logging.INFO)
            to_file.setFormatter(
                logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
            )
        logger.addHandler(to_file)
    for name, _start in SHUTDOWN_DETAILS:
        logging.getLogger(name).addFilter(_shutdown_detail_to_file_only)
    for logger in [logging.getLogger(), *chatty]:
        for handler in logger.handlers:
            if _to_terminal(handler) and _chatter not in handler.filters:
                handler.addFilter(_chatter)
    return path
