"""pairwise-averaging over seeds: each configuration's runs folded into one row of the report,
every accuracy, time and measured byte count the mean with its min-max, the ratios from the
means (no training: hand-made runs of the shape ``row_of`` gives)."""

from __future__ import annotations

from typing import Any

import pytest

from lab.experiments import pairwise_averaging as pa

MB = 1e6


def _run(variant: pa.Variant, seed: int, accuracy: float, mb_per_step: float) -> dict[str, Any]:
    """One seed's run of ``variant`` on 3 ranks, 2 epochs of 10 steps."""
    predicted = 0.6 * MB if variant.sync == "pairwise" else 1.2 * MB
    return {
        "variant": variant.label,
        "seed": seed,
        "sync": variant.sync,
        "num_ranks": 3,
        "passes": variant.passes,
        "average_every": variant.average_every,
        "epochs": 2,
        "steps_per_epoch": 10,
        "iterations": 20,
        "model_bytes": 900_000,
        "bytes_per_step_per_rank": mb_per_step * MB,
        "bytes_per_step_by_rank": [mb_per_step * MB] * 3,
        "bytes_per_step_without_headers": 0.95 * mb_per_step * MB,
        "predicted_bytes_per_step_per_rank": predicted,
        "measured_over_predicted": mb_per_step * MB / predicted,
        "measured_epochs": [2],
        "total_bytes_all_ranks": 60 * mb_per_step * MB,
        "final_average_bytes_per_rank": 0.0,
        "test_accuracy": accuracy,
        "test_rows": 10_000,
        "train_seconds": 10.0 + seed,
        "dataset_version": "fashion-mnist@d",
        "model_version": f"cnn@{variant.sync}{variant.average_every}s{seed}",
    }


def _result() -> dict[str, Any]:
    allreduce = pa.Variant(sync="allreduce")
    every = {e: pa.Variant(sync="pairwise", average_every=e) for e in pa.AVERAGE_EVERY}
    runs = [
        _run(allreduce, 0, 0.80, 1.25),
        _run(allreduce, 1, 0.82, 1.27),
        _run(every[1], 0, 0.78, 0.62),
        _run(every[1], 1, 0.80, 0.64),
        _run(every[2], 0, 0.805, 0.31),
        _run(every[2], 1, 0.815, 0.33),
    ]
    rows = [pa.folded_row(runs[i : i + 2]) for i in range(0, len(runs), 2)]
    return {
        "quick": False,
        "seeds": [0, 1],
        "rows": rows,
        "runs": runs,
        "recovery": [pa.recovery(rows, 3, e) for e in pa.AVERAGE_EVERY],
        "epochs": 2,
        "cores": 2,
        "source": "debian",
        "processed_version": "fashion-mnist@p",
    }


def test_a_row_over_two_seeds_reports_means_with_their_spread_and_ratios_of_the_means() -> None:
    result = _result()
    allreduce, every_step, _ = result["rows"]
    assert allreduce["seeds"] == [0, 1]
    assert allreduce["test_accuracy"] == pytest.approx(0.81)
    assert allreduce["test_accuracy_sd"] == pytest.approx(0.0141421, rel=1e-4)
    assert allreduce["model_versions"] == ["cnn@allreduce1s0", "cnn@allreduce1s1"]
    # measured / model is the ratio of the means.
    assert allreduce["measured_over_predicted"] == pytest.approx(1.26 / 1.2)
    assert allreduce["bytes_per_step_by_rank"] == pytest.approx([1.26 * MB] * 3)

    report = pa.render(result)
    table = [line for line in report.splitlines() if line.startswith("| 3 |") and "`" in line]
    assert len(table) == 3
    cells = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert cells[4] == "0, 1"  # the seeds
    assert cells[5] == "1.260 (1.250-1.270)"  # MB/step/rank measured
    assert cells[9] == "0.8100 (0.8000-0.8200)"  # test accuracy
    assert cells[10] == "10.5 (10.0-11.0)"  # train seconds
    assert "`cnn@allreduce1s0`, `cnn@allreduce1s1`" in cells[11]
    # Pairwise every step at the mean: 0.79 against 0.81, not within a point; every 2: 0.81.
    text = " ".join(report.split())
    assert "allreduce 81.00 % (80.00-82.00) after 20 iterations" in text
    assert "20 iterations: 79.00 % (78.00-80.00): **not within 1 point**" in text
    assert f"every 1: {0.63 / 1.26:.3f}" in text
    assert "the mean over 2 seeds (0, 1" in text
    assert "One seed per configuration" not in text
    assert every_step["test_accuracy_by_seed"] == [0.78, 0.80]


def test_one_seed_says_so_and_shows_no_spread() -> None:
    allreduce = pa.Variant(sync="allreduce")
    rows = [pa.folded_row([_run(allreduce, 0, 0.80, 1.25)])]
    result = {**_result(), "rows": rows, "recovery": [], "seeds": [0]}
    report = pa.render(result)
    row = next(line for line in report.splitlines() if line.startswith("| 3 |") and "`" in line)
    assert "| 1.250 |" in row and "| 0.8000 |" in row and "(" not in row
    assert "One seed per configuration" in report
