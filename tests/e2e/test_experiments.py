"""`shardflow experiment models-datasets --quick`: the whole experiment on tiny real subsets,
one epoch, as `make test` runs it, judged by what a user opens afterwards."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CASES = {("resnet50", "mnist"), ("mobilenetv2", "fashion-mnist"), ("dnn", "sdss")}


def test_models_datasets_quick_writes_report_plots_and_model_versions(
    shardflow: Callable[..., Result],
    shardflow_home: Path,
    real_mnist: Path,
    fashion_subset: Path,
) -> None:
    run = shardflow(
        "experiment",
        "models-datasets",
        "--quick",
        "--json",
        "--mnist-source",
        str(real_mnist),
        "--fashion-mnist-source",
        str(fashion_subset),
    )
    assert run.returncode == 0, run.stderr
    result = run.json
    out = shardflow_home / "results" / "models-datasets"
    assert Path(result["report"]) == out / "report.md"
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
    assert {Path(p).name for p in result["plots"]} == {
        "accuracy.png",
        "iterations_per_second.png",
    }
    for plot in result["plots"]:
        assert Path(plot).read_bytes()[:8] == PNG_MAGIC

    rows = result["rows"]
    # --quick: the heavy image models on 1 rank, the DNN on 1 and 2.
    assert sorted((r["model"], r["dataset"], r["num_ranks"]) for r in rows) == sorted(
        [*((model, dataset, 1) for model, dataset in CASES), ("dnn", "sdss", 2)]
    )
    for row in rows:
        assert 0.0 <= row["test_accuracy"] <= 1.0
        assert row["epochs"] == 1
        assert row["iterations_per_second"] > 0
        # No quick row has the paper's data (subsets, synthetic SDSS): none claims to beat it.
        assert row["beats_paper"] is None, row
        assert row["not_comparable_because"]
        assert row["seeds"] == [0]
        shown = shardflow("catalog", "show", row["model_version"], "--json")
        assert shown.returncode == 0, shown.stderr
        # The model version's parent is the dataset version the table names.
        name, version = row["dataset_version"].split("@")
        assert shown.json["parents"] == [{"name": name, "version": version}]
    assert {r["paper_accuracy"] for r in rows} == {0.902, 0.729, 0.738}
    assert [r["synthetic"] for r in rows if r["dataset"] == "sdss"] == [True, True]

    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) == 4
    for row in rows:
        assert row["model_version"] in report
    assert "synthetic" in report
    assert "not comparable (synthetic data)" in report
    assert "under 3 seeds: no spread to read" in report
    assert str(real_mnist) in report
    assert "(accuracy.png)" in report
