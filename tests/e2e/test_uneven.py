"""Row groups that ranks cannot share evenly: every rank still takes the same steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e


def test_seven_row_groups_train_to_the_end_on_2_and_3_ranks(
    shardflow: Callable[..., Result], fashion_subset: Path
) -> None:
    assert shardflow("ingest", "fashion-mnist", "--source", str(fashion_subset)).returncode == 0
    processed = shardflow(
        "preprocess",
        "fashion-mnist",
        "--rank-multiple",
        "7",
        "--validation-fraction",
        "0",
        "--json",
    )
    assert processed.returncode == 0, processed.stderr[-2000:]
    train = processed.json["splits"]["train"]
    assert train["num_row_groups"] == 7
    assert train["rows_per_group"] == 285
    assert train["dropped_rows"] == 5  # counted, never silent

    # 2 ranks hold 4 and 3 groups, 3 ranks 3, 2 and 2: the smallest share sets the steps.
    for num_ranks, smallest_share in ((2, 3), (3, 2)):
        trained = shardflow(
            "train", "fashion-mnist", "--np", str(num_ranks), "--epochs", "2", "--json", timeout=300
        )
        assert trained.returncode == 0, trained.stderr[-3000:]
        result = trained.json
        assert result["num_ranks"] == num_ranks
        assert result["steps_per_epoch"] == smallest_share * 285 // 32
        assert len(result["history"]["loss"]) == 2
        shown = shardflow("catalog", "show", f"fashion-mnist-cnn@{result['version']}", "--json")
        by_rank = shown.json["extra"]["row_groups_by_rank"]
        assert sorted(len(groups) for groups in by_rank.values()) == sorted(
            len(range(r, 7, num_ranks)) for r in range(num_ranks)
        )
