"""One retry policy for every HTTP call of the sources: the fetcher and the SkyServer client.

```
call(attempt) ──► Transient? ──no──► result (or its error, never retried)
                     │ yes: attempts left?  no ──► the last Transient, for the caller to word
                     ▼
        wait = max(Retry-After the server sent, backoff · 2^(n-1) + jitter), at most max_wait
        (a server asking for longer than max_wait: give up now and say so) ──► on_retry ──► again
```

tenacity runs the loop (stop after ``attempts``, retry only :class:`Transient`); the wait is
tenacity's exponential backoff with jitter (so that clients that failed together do not all
come back together), raised to what the server asked for in ``Retry-After`` (delta-seconds or
an HTTP date; SkyServer is a shared public service: a 429 or 503 that says when is obeyed).
Each attempt keeps its own deadlines (``data_catalog.deadlines``), applied by the caller.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import tenacity

T = TypeVar("T")

# Statuses worth asking again besides every 5xx: the server is busy or timed out on its side.
TRANSIENT_STATUS = frozenset({408, 425, 429})


def is_transient_status(status: int) -> bool:
    """Whether an HTTP status says another attempt may succeed."""
    return status >= 500 or status in TRANSIENT_STATUS


class Transient(Exception):
    """A failure another attempt may not meet: its one-line description, and the seconds the
    server asked to wait (``Retry-After``), if it did."""

    def __init__(self, description: str, *, retry_after: float | None = None) -> None:
        super().__init__(description)
        self.retry_after = retry_after


class ServerAsksTooLong(Transient):
    """The server's ``Retry-After`` is past the policy's ``max_wait``: not waited for."""


def retry_after_seconds(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (RFC 9110: delta-seconds or an HTTP date);
    None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long to try again."""

    attempts: int
    """Tries in all (1: never retried)."""
    backoff: float
    """The wait before the second try; doubled before each next one."""
    jitter: float | None = None
    """Up to this many seconds added at random to each backoff; None: up to one ``backoff``."""
    max_backoff: float = 60.0
    max_wait: float = 300.0
    """The longest wait, Retry-After included; a server asking for more is given up on."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not all(math.isfinite(x) and x >= 0 for x in (self.backoff, self.jitter or 0.0)):
            raise ValueError("backoff and jitter must be finite and not negative")

    def call(
        self,
        attempt: Callable[[int], T],
        *,
        on_retry: Callable[[int, Transient, float], None],
        sleep: Callable[[float], None] | None = None,
    ) -> T:
        """``attempt(n)`` for n = 1, 2, ... until it returns or raises anything but a
        :class:`Transient`; ``on_retry(n, failure, wait)`` before each wait. Raises the last
        Transient when the attempts are spent (or a :class:`ServerAsksTooLong`)."""
        backoff = tenacity.wait_exponential_jitter(
            multiplier=max(self.backoff, 1e-9),
            max=self.max_backoff,
            jitter=self.backoff if self.jitter is None else self.jitter,
        )

        def wait(state: tenacity.RetryCallState) -> float:
            failure = state.outcome.exception() if state.outcome is not None else None
            asked = failure.retry_after if isinstance(failure, Transient) else None
            seconds = backoff(state) if self.backoff > 0 else 0.0
            if asked is not None:
                if asked > self.max_wait:
                    raise ServerAsksTooLong(
                        f"{failure}; the server asks to retry after {asked:.0f} s, longer than "
                        f"{self.max_wait:.0f} s"
                    ) from failure
                seconds = max(seconds, asked)
            return min(seconds, self.max_wait)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            failure = state.outcome.exception() if state.outcome is not None else None
            assert isinstance(failure, Transient) and state.next_action is not None
            on_retry(state.attempt_number, failure, state.next_action.sleep)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=wait,
            retry=tenacity.retry_if_exception_type(Transient),
            before_sleep=before_sleep,
            # Looked up at each wait, so that a test's patched time.sleep is the one used.
            sleep=sleep if sleep is not None else lambda seconds: time.sleep(seconds),
            reraise=True,
        )
        tries = 0

        def next_attempt() -> T:
            nonlocal tries
            tries += 1
            return attempt(tries)

        return retrying(next_attempt)
