"""`shardflow experiment hybrid-parallel --quick`: data parallel vs hybrid (2 pipelined stages
per rank) on synthetic CIFAR-10, as `make test` runs it, judged by what a user opens after."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from lab.cifar10_pool import write_pool
from tests.conftest import Result
from tests.preprocessing.sources.conftest import FOOLBOX_WHEEL, PREFETCH
from tests.preprocessing.sources.test_cifar10 import decode_png

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cifar10_pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 20 real CIFAR-10 test images of foolbox's wheel, as the experiment's docs make the
    pool (lab.cifar10_pool: all 20 on both the training and the test side)."""
    if not FOOLBOX_WHEEL.exists():
        pytest.fail(f"{FOOLBOX_WHEEL} is missing: run `{PREFETCH}` (or `make test`, which does)")
    pool = write_pool(FOOLBOX_WHEEL, tmp_path_factory.mktemp("cifar10-pool") / "batches")
    # The same pictures on both sides, as decoded by the tests' own PNG reader.
    with zipfile.ZipFile(FOOLBOX_WHEEL) as wheel:
        names = sorted(n for n in wheel.namelist() if "/cifar10_" in n and n.endswith(".png"))
        first = decode_png(wheel.read(names[0]))
    test = np.frombuffer((pool / "test_batch.bin").read_bytes(), np.uint8).reshape(20, -1)
    train = np.concatenate(
        [np.frombuffer((pool / f"data_batch_{i}.bin").read_bytes(), np.uint8) for i in range(1, 6)]
    ).reshape(20, -1)
    assert (test == train).all()
    assert (test[0, 1:].reshape(3, 32, 32).transpose(1, 2, 0) == first).all()
    return pool


def test_hybrid_parallel_quick_compares_the_variants_on_the_same_ranks(
    shardflow: Callable[..., Result], shardflow_home: Path, cifar10_pool: Path, tmp_path: Path
) -> None:
    source = tmp_path / "cifar10-synthetic"
    made = shardflow(
        "synth", "cifar10", "--source", str(cifar10_pool), "--rows", "320", "--test-rows", "64",
        "--out", str(source),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    run = shardflow(
        "experiment", "hybrid-parallel", "--quick", "--json", "--cifar10-source", str(source)
    )
    assert run.returncode == 0, run.stderr
    result = run.json
    out = shardflow_home / "results" / "hybrid-parallel"
    assert Path(result["report"]) == out / "report.md"
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
    assert {Path(p).name for p in result["plots"]} == {
        "epoch_seconds.png",
        "test_accuracy.png",
        "memory_per_device.png",
    }
    for plot in result["plots"]:
        assert Path(plot).read_bytes()[:8] == PNG_MAGIC
    assert result["data"]["synthetic"] is True

    rows = {(r["variant"], r["num_ranks"]): r for r in result["rows"]}
    assert sorted(rows) == [("data-parallel", 2), ("hybrid", 2)]
    # The default of one seed: each row is its one run (kept under "runs").
    assert result["seeds"] == [0]
    assert [(r["variant"], r["seed"]) for r in result["runs"]] == [
        ("data-parallel", 0),
        ("hybrid", 0),
    ]
    data_parallel, hybrid = rows["data-parallel", 2], rows["hybrid", 2]
    for row in rows.values():
        assert row["epochs"] == 1
        assert row["epoch_seconds_steady"] > 0
        assert 0.0 <= row["test_accuracy"] <= 1.0
        assert row["seeds"] == [0]
        (measured,) = row["memory_by_rank_measured_by_seed"]
        assert [r["peak_rss_bytes"] > 0 for r in measured] == [True, True]
        # The ranks kept CPU allocator statistics (the experiment asks for a BFC allocator).
        assert row["allocator_peak_bytes_per_rank"] > 0
    # One device holds the whole model; the hybrid's two hold a part each.
    assert len(data_parallel["modelled_bytes_by_device"]) == 1
    assert len(hybrid["modelled_bytes_by_device"]) == 2
    assert max(hybrid["modelled_bytes_by_device"]) < data_parallel["modelled_bytes_by_device"][0]
    assert hybrid["sent_bytes_per_step_between_stages"] > 0
    # The cnn has no BatchNorm: the pipelined maths is the batch's, so the same accuracy (a
    # test row's prediction may flip on rounding, hence not exactly).
    assert abs(hybrid["test_accuracy"] - data_parallel["test_accuracy"]) <= 2 / 64
    # Training and test images are transforms of the same 20 pictures: far above chance (a
    # pool that kept them apart gave about 0.2 here).
    for row in rows.values():
        assert row["test_accuracy"] >= 0.5, row["test_accuracy"]

    for row in rows.values():
        shown = shardflow("catalog", "show", row["model_version"], "--json")
        assert shown.returncode == 0, shown.stderr
        name, version = row["dataset_version"].split("@")
        assert shown.json["parents"] == [{"name": name, "version": version}]
        parameters = shown.json["parameters"]
        # At their defaults (1, 1) they stay out of the identity (TrainConfig.parameters).
        assert (parameters.get("model_stages", 1), parameters.get("micro_batches", 1)) == (
            row["model_stages"],
            row["micro_batches"],
        )
    assert (hybrid["model_stages"], hybrid["micro_batches"]) == (2, 4)

    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) == 2
    for row in rows.values():
        assert row["model_version"] in report
    assert "**synthetic**" in report
    assert "7,250 s" in report and "1,451 s" in report  # the paper's figures beside ours
    assert "modelled" in report
    assert "(epoch_seconds.png)" in report and "(memory_per_device.png)" in report
    assert "(test_accuracy.png)" in report
