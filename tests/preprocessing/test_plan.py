"""The shard plan: equal row groups that 1..rank_multiple ranks divide evenly."""

from __future__ import annotations

import pytest

from data_catalog.errors import ConfigError
from data_catalog.layout import SplitLayout
from preprocessing.plan import PlanConfig, plan_evaluation_split, plan_training_split
from training.input import plan_steps, rows_of_rank


@pytest.mark.parametrize("rows", [60_000, 2_000, 4_000, 5_003, 60_001, 64])
def test_training_split_has_equal_groups_for_every_rank_count(rows: int) -> None:
    config = PlanConfig()
    plan = plan_training_split("train", rows, config)
    assert plan.num_row_groups % config.rank_multiple == 0
    assert plan.rows == plan.rows_per_group * plan.num_row_groups
    assert plan.rows + plan.dropped_rows == rows
    assert sum(s.rows for s in plan.shards) == plan.rows
    # Shards tile the kept rows in order, each a whole number of row groups.
    offset = 0
    for shard in plan.shards:
        assert shard.start == offset
        assert shard.rows % plan.rows_per_group == 0
        offset += shard.rows
    layout = plan.layout()
    for num_ranks in (1, 2, 4, 8, 16, 32, 64):
        counts = {rows_of_rank(layout, r, num_ranks) for r in range(num_ranks)}
        assert counts == {plan.rows // num_ranks}


def test_full_fashion_mnist_drops_nothing() -> None:
    plan = plan_training_split("train", 60_000, PlanConfig(rank_multiple=8))
    assert plan.dropped_rows == 0
    assert plan.shards[0].path == "split=train/part-00000.parquet"


def test_plan_is_deterministic() -> None:
    config = PlanConfig(target_rows_per_group=500, target_rows_per_shard=3_000)
    assert plan_training_split("train", 12_345, config) == plan_training_split(
        "train", 12_345, config
    )


def test_evaluation_split_is_whole() -> None:
    plan = plan_evaluation_split("test", 10_001, PlanConfig())
    assert plan.rows == 10_001
    assert sum(s.rows for s in plan.shards) == 10_001


def test_too_few_rows_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="cannot fill 64 equal row groups") as refused:
        plan_training_split("train", 63, PlanConfig())
    assert refused.value.field == "rank_multiple"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank_multiple": 0}, "rank_multiple"),
        ({"target_rows_per_group": -1}, "target_rows_per_group"),
        ({"target_rows_per_shard": 0}, "target_rows_per_shard"),
        ({"remainder": "middle"}, "remainder"),
    ],
)
def test_bad_plan_fields_are_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as refused:
        PlanConfig(**kwargs)  # type: ignore[arg-type]
    assert refused.value.field == field


@pytest.mark.parametrize("rows", [63, 5_003, 60_001, 1_000_003])
def test_pad_fills_equal_groups_and_keeps_every_row(rows: int) -> None:
    plan = plan_training_split("train", rows, PlanConfig(remainder="pad"))
    assert plan.num_row_groups % 64 == 0
    assert plan.rows == plan.rows_per_group * plan.num_row_groups
    assert plan.dropped_rows == 0
    assert plan.rows == rows + plan.padded_rows
    assert plan.padded_rows < plan.num_row_groups  # less than one row per group
    assert plan.layout().policy == "pad"
    assert sum(s.rows for s in plan.shards) == plan.rows


def test_uneven_groups_plan_equal_steps() -> None:
    # 7 row groups over 2 ranks: rank 0 has 4, rank 1 has 3; both take rank 1's step count.
    layout = SplitLayout(
        rows=700,
        source_rows=700,
        rows_per_group=100,
        num_row_groups=7,
        num_shards=1,
        dropped_rows=0,
        padded_rows=0,
        policy="drop",
    )
    assert plan_steps(layout, 2, 32) == 300 // 32
    with pytest.raises(ValueError, match="cannot feed 8 ranks"):
        plan_steps(layout, 8, 32)
