"""`shardflow bench prefect --quick`: the sides run against a real Prefect server, and what one
flow run leaves in the server's database is a task run per pass, whatever its tasks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import Result


@pytest.mark.e2e
def test_bench_prefect_quick_split(shardflow: Callable[..., Result]) -> None:
    run = shardflow("bench", "prefect", "sdss", "--quick", "--split", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.json
    assert [r["side"] for r in result["rounds"]] == ["plain", "import", "flow"]
    assert result["ratio"]["wall"] > 0 and result["ratio"]["cpu"] > 0
    # One round a side: its median is its best.
    assert result["ratio_median"] == pytest.approx(result["ratio"])
    paired = result["ratio_paired"]  # one turn: its ratio is the median, least and most
    assert paired["cpu"] == pytest.approx(
        dict.fromkeys(("median", "min", "max"), result["ratio"]["cpu"])
    )
    flow = result["rounds"][2]
    assert flow["server_cpu_seconds"] > 0  # the server's share is counted
    assert result["rounds"][1]["server_cpu_seconds"] == 0  # the import side has no server
    assert len(result["load_average"]["before"]) == 3
    # The flow's extra cost, split at the import side: the two parts add up to it.
    cpu, split = result["cpu_seconds"], result["split"]
    assert split["prefect_import"]["cpu"] == pytest.approx(cpu["import"] - cpu["plain"])
    assert split["flow_run"]["cpu"] == pytest.approx(cpu["flow"] - cpu["import"])
    # 20 exports, 20 Dask tasks: one flow run, one task run, three artifacts.
    per_run = result["prefect_database"]["per_flow_run"]
    assert (per_run["flow_run"], per_run["task_run"], per_run["artifact"]) == (1, 1, 3)
    assert 0 < per_run["events"] < 100


def test_split_is_for_the_sdss_ingest_only(shardflow: Callable[..., Result]) -> None:
    refused = shardflow("bench", "prefect", "fashion-mnist", "--split")
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardflow: "), refused.stderr
    assert "--split measures the sdss ingest only" in lines[0]
