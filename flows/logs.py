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


def _chatter(record: logging.LogRecord) -> bool:
    """False for a library's line below WARNING (the filter drops it from the terminal)."""
    if record.levelno >= logging.WARNING:
        return True
    return not any(record.name == n or record.name.startswith(n + ".") for n in CHATTY)


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
    for logger in [logging.getLogger(), *chatty]:
        for handler in logger.handlers:
            if _to_terminal(handler) and _chatter not in handler.filters:
                handler.addFilter(_chatter)
    return path
