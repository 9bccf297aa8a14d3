"""What a flow's Dask workers run around each task: the task, timed, its failure naming it.

Workers import this module and nothing of Prefect (:mod:`flows.passes` is the flow's side).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from preprocessing.driver import Result, TaskSpec

# How a failed task names itself on its exception: a note travels with the exception from
# the worker (pickled in its __dict__).
TASK_NOTE = "shardflow task: "


def timed_call(key: str, fn: Callable[..., Result], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` and the seconds it took; a failure carries ``key``."""
    started = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:
        exc.add_note(f"{TASK_NOTE}{key}")
        raise
    return {"result": result, "seconds": time.perf_counter() - started}


def timed_spec(spec: TaskSpec) -> TaskSpec:
    """``spec``, timed where it runs (a Dask worker, a thread or this process): its result
    is ``{"result": ..., "seconds": ...}``."""
    return replace(spec, fn=partial(timed_call, spec.key, spec.fn))


def failed_task(exc: BaseException) -> str | None:
    """The key of the task ``exc`` came from, when a task raised it."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, str) and note.startswith(TASK_NOTE):
            return note[len(TASK_NOTE) :]
    return None
