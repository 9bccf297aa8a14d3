"""Rows over seeds: ``shardflow experiment --seeds N`` reports each figure as the mean with its
spread, and a wrong count is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from data_catalog.errors import ConfigError
from lab.experiments import ExperimentRequest
from lab.experiments.report import folded, with_spread


def test_a_row_over_seeds_is_the_mean_with_its_spread() -> None:
    runs: list[dict[str, Any]] = [
        {"seed": 0, "test_accuracy": 0.90, "train_seconds": 10.0, "model_version": "m@a"},
        {"seed": 1, "test_accuracy": 0.94, "train_seconds": 14.0, "model_version": "m@b"},
        {"seed": 2, "test_accuracy": 0.92, "train_seconds": None, "model_version": "m@c"},
    ]
    row = folded(runs, ["test_accuracy", "train_seconds"])
    assert row["seeds"] == [0, 1, 2]
    assert row["test_accuracy"] == pytest.approx(0.92)
    assert (row["test_accuracy_min"], row["test_accuracy_max"]) == (0.90, 0.94)
    assert row["test_accuracy_sd"] == pytest.approx(0.02)
    assert row["test_accuracy_by_seed"] == [0.90, 0.94, 0.92]
    assert row["train_seconds"] == pytest.approx(12.0)  # the run without it is left out
    assert row["model_versions"] == ["m@a", "m@b", "m@c"] and row["model_version"] == "m@a"
    assert "seed" not in row
    assert with_spread(row, "test_accuracy") == "0.9200 (0.9000-0.9400)"


def test_one_seed_is_one_value_without_a_spread() -> None:
    row = folded([{"seed": 0, "test_accuracy": 0.5}], ["test_accuracy"])
    assert row["test_accuracy_sd"] == 0.0
    assert with_spread(row, "test_accuracy") == "0.5000"


@pytest.mark.parametrize("seeds", [0, -1, True])
def test_seeds_must_be_a_whole_number_of_at_least_one(seeds: int) -> None:
    with pytest.raises(ConfigError, match="seeds"):
        ExperimentRequest(out=Path("x"), seeds=seeds)
    assert ExperimentRequest(out=Path("x"), seeds=3).seed_list == [0, 1, 2]


def test_models_datasets_reports_each_row_over_its_seeds() -> None:
    """The committed report's rows are means over seeds 0-2: rendered with their min-max and
    no warning; a row of one seed brings the warning back."""
    import json

    from lab.experiments import models_datasets

    committed = Path(__file__).parents[2] / "docs" / "results" / "models-datasets"
    result = json.loads((committed / "results.json").read_text())
    report = models_datasets.render(result)
    assert "0.9483 (0.9420-0.9540)" in report  # ResNet50 + MNIST on 1 rank, seeds 0, 1, 2
    assert "no spread to read" not in report
    result["rows"][0] = folded(
        [{**result["rows"][0], "seed": 0, "test_accuracy": 0.9}], ["test_accuracy"]
    )
    assert "**1 of these 6 rows are under 3 seeds" in models_datasets.render(result)


def test_scaling_refuses_seeds_before_it_starts_anything(tmp_path: Path) -> None:
    """scaling trains no model: --seeds is refused in one line, before any host starts."""
    from lab.experiments import scaling

    with pytest.raises(ConfigError, match="does not apply to scaling"):
        scaling.run(ExperimentRequest(out=tmp_path / "out", seeds=2), pipeline=None)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
