"""hybrid-parallel over seeds: each configuration's runs become one row of means with their
min-max, and the report derives its ratios from the means (no training: hand-made runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from lab.experiments.hybrid_parallel import VARIANTS, folded_rows, render, row_of, summary
from training.config import TrainConfig

MIB = 2**20


@dataclass(frozen=True)
class Trained:
    """What row_of reads of a training run's result."""

    num_ranks: int
    epochs: int
    train_seconds: float
    test_accuracy: float
    test_rows: int
    dataset_version: str
    model_version: str


def device(stage: int, total_mib: int) -> dict[str, Any]:
    return {
        "stage": stage,
        "device": f"/CPU:{stage}",
        "layers": 10,
        "first_layer": "a",
        "last_layer": "b",
        "parameters": 1000,
        "flops_per_sample": 5000,
        "weight_bytes": MIB,
        "gradient_bytes": MIB,
        "optimizer_bytes": 2 * MIB,
        "activation_bytes": MIB,
        "total_bytes": total_mib * MIB,
        "sent_bytes_per_step": MIB if stage == 0 else 0,
    }


def a_run(variant_key: str, seed: int, steady: float, accuracy: float) -> dict[str, Any]:
    """One seed's row of ``variant_key`` on 2 ranks, as the experiment's row_of makes it."""
    variant = next(v for v in VARIANTS if v.key == variant_key)
    config = TrainConfig(
        num_ranks=2,
        epochs=2,
        batch_size=32,
        model="mobilenetv2",
        model_stages=variant.model_stages,
        micro_batches=variant.micro_batches,
        seed=seed,
    )
    devices = [device(0, 90)] if variant.model_stages == 1 else [device(0, 48), device(1, 42)]
    peak = (200 + seed) * MIB
    metrics = {
        "epoch_seconds": [3 * steady, steady],
        "steps_per_epoch": 59,
        "global_batch_size": 64,
        "memory_by_device_modelled": devices,
        "memory_by_rank": [{"allocator_peak_bytes": {"/CPU:0": peak}, "peak_rss_bytes": 1000 * MIB}]
        * 2,
        "history": {"accuracy": [0.5, accuracy - 0.05]},
    }
    trained = Trained(
        num_ranks=2,
        epochs=2,
        train_seconds=4 * steady,
        test_accuracy=accuracy,
        test_rows=800,
        dataset_version="cifar10-processed@d",
        model_version=f"cifar10-mobilenetv2@{variant_key}-{seed}",
    )
    return row_of(variant, config, trained, metrics)  # type: ignore[arg-type]


def test_the_report_shows_each_row_as_its_mean_over_seeds_with_the_min_max() -> None:
    runs = [
        run
        for seed, (dp_seconds, dp_accuracy, hy_seconds, hy_accuracy) in enumerate(
            [(10.0, 0.90, 24.0, 0.70), (12.0, 0.92, 30.0, 0.80), (14.0, 0.94, 36.0, 0.75)]
        )
        for run in (
            a_run("data-parallel", seed, dp_seconds, dp_accuracy),
            a_run("hybrid", seed, hy_seconds, hy_accuracy),
        )
    ]
    rows = folded_rows(runs)
    assert [(r["variant"], r["seeds"]) for r in rows] == [
        ("data-parallel", [0, 1, 2]),
        ("hybrid", [0, 1, 2]),
    ]
    data_parallel, hybrid = rows
    assert data_parallel["test_accuracy"] == pytest.approx(0.92)
    assert data_parallel["test_accuracy_sd"] == pytest.approx(0.02)
    assert hybrid["epoch_seconds_steady_by_seed"] == [24.0, 30.0, 36.0]
    assert hybrid["model_versions"] == [f"cifar10-mobilenetv2@hybrid-{s}" for s in range(3)]
    assert hybrid["epoch_seconds_by_seed"] == [[72.0, 24.0], [90.0, 30.0], [108.0, 36.0]]

    result = {
        "quick": False,
        "seeds": [0, 1, 2],
        "rows": rows,
        "runs": runs,
        "cores": 2,
        "data": {
            "source": "hand-made",
            "synthetic": True,
            "raw_version": "cifar10@r",
            "processed_version": "cifar10-processed@d",
            "rows": {"train": 3776, "test": 800},
        },
    }
    report = render(result)
    table = {line.split(" | ")[0]: line for line in report.splitlines() if "`cifar10-" in line}
    dp_line, hy_line = table["| data parallel"], table["| hybrid (2 stages, 4 micro-batches)"]
    # Mean (min-max) of every figure that varies with the seed; the seeds listed.
    assert " | 0, 1, 2 | 12.0 (10.0-14.0) | 36.0 (30.0-42.0) | " in dp_line
    assert "| 0.9200 (0.9000-0.9400) |" in dp_line
    assert "| 201.0 (200.0-202.0) |" in dp_line  # the allocator peak, MiB
    assert "| 0.7500 (0.7000-0.8000) |" in hy_line
    assert "| 48.0 / 42.0 |" in hy_line  # modelled: the same for every seed, no spread
    assert all(f"`cifar10-mobilenetv2@hybrid-{s}`" in hy_line for s in range(3))
    # Ratios from the means: 30 / 12 (the first seed's would be 24 / 10 = 2.40x).
    assert "time per epoch 2.50x" in report
    assert "test accuracy -0.1700" in report
    assert "computed from the means over the seeds" in report
    assert "mean over 3 seeds" in report
    assert "one seed" not in report.lower()
    assert "![test accuracy](test_accuracy.png)" in report
    assert "12.0 (10.0-14.0) s per epoch" in summary(rows)[0]


def test_one_seed_is_reported_as_one_run_without_a_spread() -> None:
    rows = folded_rows([a_run("data-parallel", 0, 10.0, 0.9), a_run("hybrid", 0, 20.0, 0.8)])
    assert rows[0]["seeds"] == [0]
    assert summary(rows)[0].endswith(
        "10.0 s per epoch, memory per device 90.0 MiB (modelled), test accuracy 0.9000"
    )
