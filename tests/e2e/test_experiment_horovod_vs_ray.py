"""`shardflow experiment horovod-vs-ray --quick`: the Fashion-MNIST CNN on 2 workers with
Horovod and with Ray Train, as `make test` runs it, judged by what a user opens afterwards."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_horovod_vs_ray_quick_trains_with_both_engines(
    shardflow: Callable[..., Result], shardflow_home: Path
) -> None:
    pytest.importorskip("ray.train.tensorflow", reason="the ray extra: pip install .[ray]")
    run = shardflow("experiment", "horovod-vs-ray", "--quick", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.json
    out = shardflow_home / "results" / "horovod-vs-ray"
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
    assert (out / "horovod_vs_ray.png").read_bytes()[:8] == PNG_MAGIC

    rows = result["rows"]
    assert [r["engine"] for r in rows] == ["horovod", "ray"]
    horovod, ray = rows
    # The same data, budget and steps on both sides.
    assert horovod["steps_per_epoch"] == ray["steps_per_epoch"] >= 1
    assert horovod["test_rows"] == ray["test_rows"] == 256
    for row in rows:
        assert len(row["epoch_seconds"]) == 2
        # 448 training images, 10 classes, two epochs: well above chance (0.1).
        assert row["test_accuracy"] >= 0.25, row
        # Two workers exchanging gradients over their own loopback, and real work done.
        assert row["loopback_bytes"] > 1_000_000, row
        assert row["cpu_seconds"] > 1.0, row
    assert ray["ray_version"] == "2.55.1"
    # The Horovod side is an ordinary model version of the prepared data.
    shown = shardflow("catalog", "show", horovod["model_version"], "--json")
    assert shown.returncode == 0, shown.stderr
    assert shown.json["parameters"]["num_ranks"] == 2

    report = (out / "report.md").read_text()
    assert "| Horovod 0.28.1 (Gloo) |" in report
    assert "| Ray Train |" in report
    assert "(horovod_vs_ray.png)" in report
    assert horovod["model_version"] in report or result["processed_version"] in report
