"""ranks-time's report over seeds: each row is the mean of its seeds' runs with the min-max
beside it, the ratios are of the means, and the plot is drawn (no training: hand-made runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lab.experiments.ranks_time import (
    _plots,
    folded_rows,
    render,
    seed_efficiencies,
    summary,
    with_efficiency,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    num_ranks: int, seed: int, seconds: float, samples: float, accuracy: float
) -> dict[str, Any]:
    return {
        "num_ranks": num_ranks,
        "seed": seed,
        "epochs": 6,
        "epoch_seconds": [seconds * 2, seconds],
        "first_epoch_seconds": seconds * 2,
        "seconds_per_epoch": seconds,
        "samples_per_second": samples,
        "test_accuracy": accuracy,
        "test_rows": 1000,
        "dataset_version": "mnist-processed@d",
        "model_version": f"mnist-cnn@r{num_ranks}s{seed}",
    }


RUNS = [
    _run(1, 0, 2.4, 1500.0, 0.950),
    _run(1, 1, 2.6, 1400.0, 0.960),
    _run(1, 2, 2.5, 1300.0, 0.955),
    _run(2, 0, 1.3, 2800.0, 0.940),
    _run(2, 1, 1.5, 2600.0, 0.970),
    _run(2, 2, 1.4, 2700.0, 0.955),
]


def _result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "quick": False,
        "rows": with_efficiency(folded_rows(runs), cores=2),
        "runs": runs,
        "cores": 2,
        "batch_size": 128,
        "load_average": [1.0, 1.0, 1.0],
        "source": ".cache/mnist_5k.csv.gz",
        "raw_version": "mnist@r",
    }


def test_each_row_is_the_mean_over_its_seeds_with_the_min_max(tmp_path: Path) -> None:
    result = _result(RUNS)
    one, two = result["rows"]
    assert (one["num_ranks"], two["num_ranks"]) == (1, 2)
    assert one["seeds"] == two["seeds"] == [0, 1, 2]
    assert two["seconds_per_epoch"] == pytest.approx(1.4)
    assert two["test_accuracy_sd"] == pytest.approx(0.015)
    # The speed-up is of the means: 2700 / 1400, not a mean of each seed's ratio.
    assert two["speedup"] == pytest.approx(2700 / 1400)
    assert two["efficiency"] == pytest.approx(2700 / 1400 / 2)

    report = render(result)
    table_row = next(line for line in report.splitlines() if line.startswith("| 2 |"))
    assert "| 0, 1, 2 |" in table_row
    assert "1.40 (1.30-1.50)" in table_row  # s/epoch
    assert "2700 (2600-2800)" in table_row  # samples/s
    assert "0.9550 (0.9400-0.9700)" in table_row  # test accuracy
    assert "| 1.93 |" in table_row  # speed-up of the means
    for seed in (0, 1, 2):
        assert f"`mnist-cnn@r2s{seed}`" in table_row
    assert "each of 3 seeds" in report
    assert "test accuracy by up to 3.0 points" in report
    assert "one seed" not in report.lower()
    assert summary(result["rows"])[1].startswith(
        "2 rank(s), seed(s) 0, 1, 2: 1.40 (1.30-1.50) s/epoch, 2700 (2600-2800) samples/s"
    )
    # Each seed's own efficiency, against its own 1-rank run: the plot's dots.
    assert seed_efficiencies(result["rows"])[2] == pytest.approx(
        [2800 / 1500 / 2, 2600 / 1400 / 2, 2700 / 1300 / 2]
    )
    (path,) = _plots(tmp_path, result["rows"])
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_one_seed_is_one_value_and_the_report_says_there_is_no_spread() -> None:
    report = render(_result([r for r in RUNS if r["seed"] == 0]))
    table_row = next(line for line in report.splitlines() if line.startswith("| 2 |"))
    assert "| 1.30 |" in table_row and "(" not in table_row
    assert "one run, seed 0: no spread" in report
