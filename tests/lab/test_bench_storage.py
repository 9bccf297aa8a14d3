"""bench storage's parts that need no accelerator and no root: the emulated accelerators'
table, sizes, grown splits; and ``shardflow bench storage --quick`` end to end, asserting
what it reports (never how fast)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_catalog.errors import ShardflowError
from lab.bench.accelerators import ACCELERATORS, lookup
from lab.bench.grow import MARKER, grow_split, resized
from lab.bench.storage import parse_size
from tests.conftest import Result
from training.input import InputSpec
from training.row_groups import split_files


def test_every_emulated_accelerator_names_its_source() -> None:
    assert all(row.source and row.us_per_sample > 0 for row in ACCELERATORS)
    keys = [(r.accelerator, r.model, r.sample_shape, r.batch_size) for r in ACCELERATORS]
    assert len(keys) == len(set(keys))


def test_the_issues_h200_and_mlperf_storage_rows() -> None:
    h200 = lookup("h200", "cnn", (28, 28, 1), 256)
    assert h200.samples_per_second == pytest.approx(134_600, rel=0.01)
    a100 = lookup("a100", "resnet50", (224, 224, 3), None)
    assert a100.batch_size == 400 and a100.step_seconds == pytest.approx(0.435)
    assert lookup("h100", "resnet50", (224, 224, 3), None).step_seconds == pytest.approx(0.224)
    assert lookup("a100", "cnn", (28, 28, 1), None).batch_size == 32  # shardflow's default


def test_a_missing_row_is_one_line_naming_what_there_is() -> None:
    with pytest.raises(ShardflowError, match="not 64: give one of them with --batch-size"):
        lookup("h200", "cnn", (28, 28, 1), 64)
    with pytest.raises(ShardflowError, match="no emulated a100 for resnet50 on 28x28x1"):
        lookup("a100", "resnet50", (28, 28, 1), None)


@pytest.mark.parametrize(
    ("text", "size"),
    [("512M", 512 * 2**20), ("2G", 2 * 2**30), ("1.5GiB", 3 * 2**29), ("1000", 1000)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "two", "-1G", "3X"])
def test_a_bad_size_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.fixture
def real_split(tmp_path: Path) -> tuple[Path, InputSpec]:
    """A small Parquet training split of 28x28x1 images (random pixels stand in here)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    folder = tmp_path / "train"
    folder.mkdir()
    images = rng.integers(0, 256, (300, 784), np.uint8)
    table = pa.table(
        {"image": [row.tobytes() for row in images], "label": rng.integers(0, 10, 300)}
    )
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=100)
    return folder, InputSpec(kind="images", image_shape=[28, 28, 1])


def test_a_grown_split_holds_whole_row_groups_of_transformed_images(
    real_split: tuple[Path, InputSpec], tmp_path: Path
) -> None:
    folder, spec = real_split
    url, grown = grow_split(folder, spec, tmp_path / "grown", rows=1_000, rows_per_group=64)
    files = split_files(url)
    assert [g.rows for g in files.groups] == [64] * 15
    assert grown.image_shape == [28, 28, 1]
    source = {row for row in pq.read_table(folder).column("image").to_pylist()}
    assert not source & set(pq.read_table(tmp_path / "grown").column("image").to_pylist())
    marker = json.loads((tmp_path / "grown" / MARKER).read_text())
    assert marker["synthetic"] is True and marker["rows"] == 960
    before = (tmp_path / "grown" / "part-00000.parquet").stat().st_mtime_ns
    grow_split(folder, spec, tmp_path / "grown", rows=1_000, rows_per_group=64)
    assert (tmp_path / "grown" / "part-00000.parquet").stat().st_mtime_ns == before  # reused


def test_imagenet_size_samples_from_small_images(
    real_split: tuple[Path, InputSpec], tmp_path: Path
) -> None:
    folder, spec = real_split
    _url, grown = grow_split(
        folder, spec, tmp_path / "big", rows=256, rows_per_group=128, image_size=224
    )
    assert grown.image_shape == [224, 224, 3]
    table = pq.read_table(tmp_path / "big")
    assert table.num_rows == 256 and {len(v) for v in table.column("image").to_pylist()} == {
        224 * 224 * 3
    }


def test_resizing_keeps_a_flat_image_flat() -> None:
    flat = np.full((2, 32, 32, 3), 77, np.uint8)
    assert (resized(flat, 224) == 77).all()


@pytest.mark.e2e
def test_bench_storage_quick_reports_every_figure(
    shardflow: Callable[..., Result], fashion_home: Path
) -> None:
    # fashion_home: the subset ingested and preprocessed, where `shardflow` runs.
    run = shardflow(
        "bench", "storage", "fashion-mnist", "--accelerator", "a100", "--quick", "--json"
    )
    assert run.returncode == 0, run.stderr
    result = run.json
    for field in ("au", "max_accelerators", "delivered_mb_s", "device_read_mb_s",
                  "read_table_ratio", "binding"):  # fmt: skip
        assert field in result
    assert 0 < result["au"] <= 1.0
    assert result["binding"] in ("disk", "cpu", "decode", "reader")
    assert isinstance(result["max_accelerators"], int) and result["max_accelerators"] >= 0
    assert result["delivered_mb_s"] > 0 and result["read_table_ratio"] > 0
    assert result["read_table_ratio_median"] > 0 and result["cpu_per_row_ratio_median"] > 0
    assert result["device_read_mb_s"] is None or result["device_read_mb_s"] > 0
    assert result["accelerator"]["accelerator"] == "a100" and result["batch_size"] == 32
    assert [r["rank"] for r in result["per_rank"]] == [0]
    assert result["cold"] is False and result["memory_limit"] is None

    wrong = shardflow("bench", "storage", "fashion-mnist", "--model", "resnet50", "--quick")
    assert wrong.returncode == 1
    assert wrong.stderr.strip().count("\n") == 0 and "no emulated a100 for resnet50" in wrong.stderr


@pytest.mark.parametrize("most", [0, 1, 3, 5, 8, 12])
@pytest.mark.parametrize("predicted", [0, 1, 4, 20])
def test_the_search_finds_the_most_accelerators_kept_busy(
    monkeypatch: pytest.MonkeyPatch, most: int, predicted: int
) -> None:
    from types import SimpleNamespace

    from lab.bench import storage

    launched: list[int] = []

    def trial(*args: object) -> float:
        n = int(args[3])  # type: ignore[call-overload]
        launched.append(n)
        return 0.95 if n <= most else 0.6

    monkeypatch.setattr(storage, "_trial", trial)
    request = SimpleNamespace(max_ranks=8)
    found, tried = storage.search_accelerators(
        request,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        SimpleNamespace(accelerator="a100"),  # type: ignore[arg-type]
        predicted,
        Path("."),
        None,
        lambda _m: None,
    )
    assert found == min(most, 8)
    # Doubling, then bisecting: never a count twice, at most 2 log2(8) launches.
    assert len(launched) == len(set(launched)) <= 6
    assert set(tried) == {str(n) for n in launched}


def test_one_lucky_round_moves_the_best_ratios_not_the_median_ones() -> None:
    import statistics

    from lab.bench import storage

    def phase(cpu: float, wall: float) -> dict[str, object]:
        return {"ranks": [{"cpu": cpu, "rows": 1000, "wall": wall}]}

    steady = {"reader": phase(1.2, 1.0), "read_table": phase(1.0, 1.0)}
    lucky = {"reader": phase(1.2, 1.0), "read_table": phase(0.5, 0.5)}
    rounds = [steady, lucky, steady]
    cpu = storage._cpu_per_row
    assert cpu(rounds, "reader", 0, min) / cpu(rounds, "read_table", 0, min) == pytest.approx(2.4)
    median = cpu(rounds, "reader", 0, statistics.median)
    assert median / cpu(rounds, "read_table", 0, statistics.median) == pytest.approx(1.2)
    rates = storage._median_rate(rounds, "reader", 0) / storage._median_rate(
        rounds, "read_table", 0
    )
    assert rates == pytest.approx(1.0)
