"""`shardflow experiment ranks-time --quick`: the MNIST CNN on 1, 2 and 4 namespaced hosts, as
`make test` runs it, judged by what a user opens afterwards."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ranks_time_quick_trains_on_1_2_and_4_hosts(
    shardflow: Callable[..., Result], shardflow_home: Path, real_mnist: Path
) -> None:
    run = shardflow(
        "experiment", "ranks-time", "--quick", "--json", "--mnist-source", str(real_mnist)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.json
    out = shardflow_home / "results" / "ranks-time"
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
    assert [Path(p).name for p in result["plots"]] == ["ranks_time.png"]
    assert (out / "ranks_time.png").read_bytes()[:8] == PNG_MAGIC

    rows = result["rows"]
    assert [r["num_ranks"] for r in rows] == [1, 2, 4]
    # One seed by default: each row is its one run, kept under "runs".
    assert [(r["num_ranks"], r["seed"]) for r in result["runs"]] == [(1, 0), (2, 0), (4, 0)]
    assert all(r["seeds"] == [0] for r in rows)
    for row in rows:
        assert row["epochs"] == 2
        assert row["seconds_per_epoch"] > 0
        assert row["samples_per_second"] > 0
        # 512 training images, 10 classes: one epoch of the CNN learns something.
        assert 0.1 <= row["test_accuracy"] <= 1.0
        assert row["test_rows"] == 128
        shown = shardflow("catalog", "show", row["model_version"], "--json")
        assert shown.returncode == 0, shown.stderr
        # Ranks on hosts of their own, one thread each: execution only, the same identity
        # as a run on localhost.
        assert shown.json["parameters"]["num_ranks"] == row["num_ranks"]
        assert "hosts" not in shown.json["parameters"]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    report = (out / "report.md").read_text()
    assert "(ranks_time.png)" in report
    for row in rows:
        assert row["model_version"] in report
