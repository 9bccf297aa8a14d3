"""How long shardflow waits on something outside it before it says, in one line, what stopped
answering. Every wait on a server or a cluster takes its limit from here:

    name      default  what
    connect      20 s  a connection to a server and its first answer (a Dask scheduler's
                       handshake, the Prefect API's /health, an object store's connect)
    reply        60 s  one reply of an object store or a source server (SkyServer), from the
                       request to its last byte (a server sending one byte every few seconds
                       included), plus the time its bytes take at a slowest allowed rate
    workers     120 s  a Dask scheduler with no worker while tasks wait for one

``SHARDFLOW_DEADLINE_<NAME>`` (seconds) overrides a default: slow networks need more, tests
need less. It is read when a wait starts, in whichever process waits (a Dask worker fetching a
page inherits the command's environment).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from data_catalog.errors import ConfigError, ShardflowError

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Deadline:
    name: str
    default: float

    @property
    def variable(self) -> str:
        return f"SHARDFLOW_DEADLINE_{self.name.upper()}"

    def seconds(self, environ: Mapping[str, str] = os.environ) -> float:
        """The limit in force: the environment's, else the default."""
        given = environ.get(self.variable)
        if not given:
            return self.default
        try:
            value = float(given)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(self.variable, f"must be a positive number of seconds, got {given!r}")
        return value


CONNECT = Deadline(name="connect", default=20.0)
REPLY = Deadline(name="reply", default=60.0)
WORKERS = Deadline(name="workers", default=120.0)


class DeadlineExceeded(ShardflowError):
    """Something outside shardflow did not answer within its deadline; the message names it."""


def exceeded(
    what: str, deadline: Deadline, remedy: str, seconds: float | None = None
) -> DeadlineExceeded:
    """The one-line error for ``what`` having taken longer than ``deadline`` (``seconds``: the
    limit it had, when more than the deadline's own: a transfer's time for its bytes)."""
    limit = deadline.seconds() if seconds is None else seconds
    return DeadlineExceeded(
        f"{what} did not answer within {limit:.0f} s; {remedy} (the limit is {deadline.variable})"
    )


def call_within(fn: Callable[[], T], deadline: Deadline, what: str, remedy: str) -> T:
    """``fn()``, or :class:`DeadlineExceeded` once ``deadline`` passes without its return.

    For a library call that offers no timeout of its own (it may block on a socket forever):
    ``fn`` runs on a daemon thread that is left behind if it never returns; it dies with the
    process, and ``fn`` must hold nothing a caller needs released.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"deadline:{deadline.name}", daemon=True)
    thread.start()
    thread.join(deadline.seconds())
    if thread.is_alive():
        raise exceeded(what, deadline, remedy)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]  # a BaseException, raised as it came
    return outcome["value"]  # type: ignore[return-value]  # fn's own value
