"""Per-rank input metrics: the test delay hook, the metered input, the flags across ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog, Manifest
from tests.training.test_sharding import processed  # noqa: F401 (a fixture, used by name)
from training.input import InputSpec, SplitLayout, epoch_batches
from training.input_metrics import (
    INPUT_DELAY_ENV,
    EpochInput,
    epoch_steps,
    input_delay,
    metered,
    rank_report,
    summarize,
)


def test_the_delay_hook_names_one_rank_and_is_off_by_default() -> None:
    assert input_delay(0, {}) == 0.0
    assert input_delay(1, {INPUT_DELAY_ENV: "1:0.05"}) == 0.05
    assert input_delay(0, {INPUT_DELAY_ENV: "1:0.05"}) == 0.0
    assert input_delay(2, {INPUT_DELAY_ENV: "1:0.05, 2:0.5"}) == 0.5


@pytest.mark.parametrize("text", ["1", "one:0.1", "1:fast", "1:-1"])
def test_a_malformed_delay_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=INPUT_DELAY_ENV):
        input_delay(1, {INPUT_DELAY_ENV: text})


def chunks() -> list[tuple[Any, Any]]:
    rows = np.arange(96 * 2).reshape(96, 2)
    return [(rows[:64], np.arange(64)), (rows[64:], np.arange(64, 96))]


@pytest.mark.parametrize("delay", [0.0, 0.001])
def test_metering_hands_over_the_same_rows_in_the_same_order(delay: float) -> None:
    record = EpochInput(epoch=0)
    out = list(metered(iter(chunks()), record, batch_size=32, delay=delay))
    assert np.array_equal(np.concatenate([y for _x, y in out]), np.arange(96))
    assert np.array_equal(np.concatenate([x for x, _y in out]), np.arange(192).reshape(96, 2))
    # Without the delay the chunks pass whole; with it, one batch at a time.
    assert [len(y) for _x, y in out] == ([32, 32, 32] if delay else [64, 32])
    assert (record.batches, record.rows) == (3, 96)
    assert record.seconds > 0


def test_stopping_early_closes_the_epoch_reader() -> None:
    closed = []

    def epoch() -> Any:
        try:
            yield from chunks()
        finally:
            closed.append(True)

    stream = metered(epoch(), EpochInput(epoch=0), batch_size=32)
    next(stream)
    stream.close()
    assert closed == [True]


def rank(number: int, *, input_per_batch: float, step: float, longest: float) -> dict[str, Any]:
    record = EpochInput(epoch=0, seconds=input_per_batch * 10, batches=10, rows=320)
    durations = [1.0] + [step] * 9 + [longest]  # the first step (tracing) is left out
    return rank_report(number, [epoch_steps(0, durations, record, first_step_input=0.0)], 1.0)


def test_the_slow_input_rank_is_flagged_input_bound_and_slowest_the_other_not() -> None:
    # Synchronous allreduce: both ranks' steps take as long as the slow rank's input.
    ranks = [
        rank(0, input_per_batch=0.002, step=0.1, longest=0.1),
        rank(1, input_per_batch=0.2, step=0.1, longest=0.1),
    ]
    assert ranks[1]["input_bound"] > 0.5 > ranks[0]["input_bound"]
    assert ranks[0]["max_step_seconds"] == 0.1  # not the 1 s first step
    summary = summarize(ranks)
    assert summary["flags"] == {"0": [], "1": ["input-bound", "slowest"]}
    assert summary["slowest_rank"] == 1
    assert summary["input_imbalance"] == pytest.approx(100.0)
    assert summary["step_imbalance"] == pytest.approx(1.0, rel=0.05)


def test_a_step_over_ten_times_the_median_flags_a_stall() -> None:
    ranks = [
        rank(0, input_per_batch=0.001, step=0.01, longest=0.5),
        rank(1, input_per_batch=0.001, step=0.01, longest=0.05),
    ]
    assert "stalled" in summarize(ranks)["flags"]["0"]
    assert "stalled" not in summarize(ranks)["flags"]["1"]


def test_a_metered_epoch_counts_whole_row_groups_and_keeps_the_batch_order(
    processed: tuple[Catalog, Manifest],  # noqa: F811 (the fixture imported above)
) -> None:
    catalog, manifest = processed
    url = (catalog.version_dir(manifest.name, manifest.version) / "train").as_uri()
    spec = InputSpec.of(manifest.schema)
    stats = manifest.statistics["train"]
    layout = SplitLayout(
        rows_per_group=stats["rows_per_group"], num_row_groups=stats["num_row_groups"]
    )
    steps = layout.steps_per_epoch(2, 32)

    def epoch(record: EpochInput | None, delay: float) -> list[int]:
        chunks = epoch_batches(
            url,
            spec,
            rank=1,
            num_ranks=2,
            seed=3,
            epoch=0,
            batch_size=32,
            steps=steps,
            shuffle_buffer=256,
            record=record,
        )
        if record is not None:
            chunks = metered(chunks, record, batch_size=32, delay=delay)
        return [int(v) for _x, y in chunks for v in y]

    plain = epoch(None, 0.0)
    record = EpochInput(epoch=0)
    assert epoch(record, 0.001) == plain  # the test delay changes the pace, never the rows
    assert (record.batches, record.rows) == (steps, steps * 32)
    # Every reader item is one whole row group of 28x28 pixels and an int64 label per row.
    assert 0 < record.row_groups_read <= len(range(1, layout.num_row_groups, 2))
    assert record.bytes_read == record.row_groups_read * layout.rows_per_group * (28 * 28 + 8)
