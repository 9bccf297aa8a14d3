"""`shardflow bench prefect --quick`: both sides run against a real Prefect server, and what one
flow run leaves in the server's database is a task run per pass, whatever its tasks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e


def test_bench_prefect_quick(shardflow: Callable[..., Result]) -> None:
    run = shardflow("bench", "prefect", "sdss", "--quick", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.json
    assert [r["side"] for r in result["rounds"]] == ["plain", "flow"]
    assert result["ratio"]["wall"] > 0 and result["ratio"]["cpu"] > 0
    # One round a side: its median is its best.
    assert result["ratio_median"] == pytest.approx(result["ratio"])
    flow = result["rounds"][1]
    assert flow["server_cpu_seconds"] > 0  # the server's share is counted
    assert len(result["load_average"]["before"]) == 3
    # 20 exports, 20 Dask tasks: one flow run, one task run, three artifacts.
    per_run = result["prefect_database"]["per_flow_run"]
    assert (per_run["flow_run"], per_run["task_run"], per_run["artifact"]) == (1, 1, 3)
    assert 0 < per_run["events"] < 100
