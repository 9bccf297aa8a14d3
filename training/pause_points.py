"""A test hook: stop a training run at a named point, so that a test can kill it exactly there.

``SHARDFLOW_TEST_PAUSE_AT=<point>`` makes the process that reaches ``<point>`` print
``paused at <point>`` and sleep until it is killed. The points:

    trained    rank 0, training done (the last epoch's checkpoints written), before the figures
               are gathered
    evaluate   rank 0, before the test split is evaluated and model.keras saved

Unset (always, outside tests), :func:`pause_point` does nothing.
"""

from __future__ import annotations

import os
import time

PAUSE_ENV = "SHARDFLOW_TEST_PAUSE_AT"
POINTS = ("trained", "evaluate")


def pause_point(point: str) -> None:
    assert point in POINTS, point
    if os.environ.get(PAUSE_ENV) != point:
        return
    print(f"paused at {point}", flush=True)
    while True:
        time.sleep(60)
