"""``shardflow bench callbacks`` end to end on real Fashion-MNIST images: what it reports
(never how fast), and its --json alone on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result


@pytest.mark.e2e
def test_bench_callbacks_reports_both_sides_and_stdout_is_its_json(
    shardflow: Callable[..., Result], fashion_home: Path
) -> None:
    # fashion_home: the subset ingested and preprocessed, where `shardflow` runs.
    run = shardflow("bench", "callbacks", "fashion-mnist", "--steps", "40", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)  # rank 0's "input metrics of epoch N" lines go to stderr
    assert "input metrics of epoch" in run.stderr
    assert result["steps"] == 40 and result["batch_size"] == 32
    assert {"DivergenceGuard", "StepMeter", "EpochCheckpoint"} <= set(result["callbacks"])
    assert len(result["seconds"]["with"]) == len(result["seconds"]["without"]) == 5
    assert len(result["cpu_seconds_by_round"]["with"]) == 5
    assert result["ratio"] > 0 and result["cpu_ratio_median"] > 0
    assert 0 < result["hook_share"] < 1 and 0 < result["hook_cpu_share"] < 1
    assert 0 < result["batch_hook_cpu_seconds_per_step"] < result["hook_cpu_seconds_per_step"]
    assert isinstance(result["keras_slow_callback_warnings"], list)
