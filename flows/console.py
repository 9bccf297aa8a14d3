"""What every command needs from the process edge, and how it prints."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preprocessing.driver import OnProgress, PassProgress

from flows.settings import Settings

# Set by flows.cli's handler at Ctrl-C or SIGTERM, until the command ends. Python raises the
# handler's KeyboardInterrupt wherever the main thread is, and some places drop it: a weakref
# callback or finaliser ("Exception ignored in"), a library's `except BaseException` while it
# flushes (seen in the last second of `run`, under load). A command whose interrupt was dropped
# still ends as interrupted (exit 130), never as a success.
INTERRUPT = {"pending": False}


def interrupt_handled() -> None:
    """For a command whose normal end is an interrupt (`server`): it has stopped as asked."""
    INTERRUPT["pending"] = False


@dataclass(frozen=True, kw_only=True)
class Context:
    settings: Settings
    as_json: bool
    verbose: bool
    """Progress on stderr (always on a terminal)."""
    debug: bool

    def progress(self, message: str) -> None:
        """Progress of long work, on stderr: shown on a terminal or with --verbose, so that
        scripts reading stderr see nothing but a failure's one-line error."""
        if self.verbose:
            print(message, file=sys.stderr, flush=True)

    def emit(self, result: dict[str, Any], human: Sequence[str]) -> None:
        """Print the result: readable lines, or with --json one JSON object as the last line."""
        if self.as_json:
            print(json.dumps(result, sort_keys=True, default=str), flush=True)
        else:
            for line in human:
                print(line, flush=True)

    @contextmanager
    def pass_progress(self) -> Iterator[OnProgress]:
        """What a stage reports as its tasks finish: a progress bar per pass on a terminal, a
        line at most every few seconds (and at each pass's end) with --verbose elsewhere."""
        if not sys.stderr.isatty():
            yield _Lines(self.progress)
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        bars = Progress(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        ids: dict[str, Any] = {}

        def update(state: PassProgress) -> None:
            if state.pass_name not in ids:
                ids[state.pass_name] = bars.add_task(
                    state.pass_name, total=state.tasks_total, detail=""
                )
            detail = state.describe().split(", ", 1)[1] if ", " in state.describe() else ""
            bars.update(ids[state.pass_name], completed=state.tasks_done, detail=detail)

        with bars:
            yield update


class _Lines:
    """Progress as lines: every few seconds, and when a pass ends."""

    SECONDS = 2.0

    def __init__(self, show: Any) -> None:
        self.show = show
        self.last = 0.0

    def __call__(self, state: PassProgress) -> None:
        now = time.monotonic()
        if state.tasks_done == state.tasks_total or now - self.last >= self.SECONDS:
            self.last = now
            self.show(state.describe())
