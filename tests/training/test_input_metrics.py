"""Per-rank input metrics: the test delay hook, the metered input, the flags across ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog, Manifest
from data_catalog.layout import ProcessedLayout
from tests.training.test_sharding import processed  # noqa: F401 (a fixture, used by name)
from training.input import InputSpec, as_url, epoch_batches, plan_steps
from training.input_metrics import (
    EPOCHS_FILE,
    INPUT_DELAY_ENV,
    ROLLING_STEPS,
    SLOWEST_IMBALANCE,
    SLOWEST_MIN_INPUT_BOUND,
    STALL_SECONDS,
    STALL_STEPS,
    EpochInput,
    EpochLog,
    InputMeter,
    RollingWindow,
    epoch_line,
    epoch_log_path,
    epoch_steps,
    epoch_table,
    input_delay,
    metered,
    rank_report,
    read_epoch_log,
    step_meter,
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


def rank(
    number: int, *, input_per_batch: float, step: float, longest: float, num_long: int = 1
) -> dict[str, Any]:
    """A rank of 20 timed steps of ``step`` s, ``num_long`` of them ``longest`` s instead."""
    record = EpochInput(epoch=0, seconds=input_per_batch * 20, batches=20, rows=640)
    # The first step (tracing) is left out.
    durations = [1.0] + [step] * (20 - num_long) + [longest] * num_long
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


def test_an_imbalance_below_the_threshold_names_no_slowest_rank() -> None:
    # As seen in a normal run: both ranks input-bound, one 1.26 times slower than the other.
    ranks = [
        rank(0, input_per_batch=0.1, step=0.13, longest=0.13),
        rank(1, input_per_batch=0.126, step=0.13, longest=0.13),
    ]
    summary = summarize(ranks)
    assert summary["input_imbalance"] == pytest.approx(1.26)
    assert summary["input_imbalance"] < SLOWEST_IMBALANCE
    assert summary["flags"] == {"0": ["input-bound"], "1": ["input-bound"]}
    assert summary["slowest_rank"] == 1  # still said, not flagged
    assert summary["slowest_flagged"] is False


def test_a_much_slower_input_that_the_prefetch_hides_is_not_flagged_slowest() -> None:
    # Three times the other rank's input, but a tenth of its step time.
    ranks = [
        rank(0, input_per_batch=0.001, step=0.1, longest=0.1),
        rank(1, input_per_batch=0.01, step=0.1, longest=0.1),
    ]
    assert ranks[1]["input_bound"] < SLOWEST_MIN_INPUT_BOUND
    summary = summarize(ranks)
    assert summary["input_imbalance"] == pytest.approx(10.0)
    assert summary["flags"] == {"0": [], "1": []}


def test_one_long_step_is_a_hiccup_not_a_stall() -> None:
    # As seen in a normal run: one 0.52 s step against a 0.046 s median.
    ranks = [
        rank(0, input_per_batch=0.001, step=0.046, longest=0.52),
        rank(1, input_per_batch=0.001, step=0.046, longest=0.046),
    ]
    summary = summarize(ranks)
    assert summary["stalled_steps"] == {"0": 1, "1": 0}
    assert summary["flags"] == {"0": [], "1": []}


def test_several_long_steps_flag_a_stall() -> None:
    ranks = [
        rank(0, input_per_batch=0.001, step=0.046, longest=0.52, num_long=STALL_STEPS),
        rank(1, input_per_batch=0.001, step=0.046, longest=0.52, num_long=STALL_STEPS - 1),
    ]
    summary = summarize(ranks)
    assert summary["stalled_steps"] == {"0": STALL_STEPS, "1": STALL_STEPS - 1}
    assert summary["flags"] == {"0": ["stalled"], "1": []}


def test_one_step_of_several_seconds_flags_a_stall() -> None:
    ranks = [
        rank(0, input_per_batch=0.001, step=0.046, longest=STALL_SECONDS),
        rank(1, input_per_batch=0.001, step=0.046, longest=0.046),
    ]
    assert summarize(ranks)["flags"] == {"0": ["stalled"], "1": []}


def test_a_record_without_its_longest_steps_counts_its_longest_one() -> None:
    # Versions trained before ranks kept their longest steps: only max_step_seconds.
    old = rank(0, input_per_batch=0.001, step=0.046, longest=0.52, num_long=STALL_STEPS)
    del old["longest_step_seconds"]
    other = rank(1, input_per_batch=0.001, step=0.046, longest=0.046)
    assert summarize([old, other])["flags"] == {"0": [], "1": []}


def test_the_rolling_window_keeps_the_last_steps_only() -> None:
    window = RollingWindow(4)
    for _ in range(10):
        window.add(1.0, 1.0)  # input-bound, slow: left behind by the window
    for _ in range(4):
        window.add(0.1, 0.025)
    figures = window.figures(rows_per_batch=32)
    assert len(window.step_seconds) == len(window.input_seconds) == 4
    assert (figures.window, figures.steps) == (4, 4)
    assert figures.mean_step_seconds == pytest.approx(0.1)
    assert figures.batches_per_second == pytest.approx(10.0)
    assert figures.rows_per_second == pytest.approx(320.0)
    assert figures.input_bound == pytest.approx(0.25)
    assert RollingWindow().size == ROLLING_STEPS
    with pytest.raises(ValueError, match="at least 1 step"):
        RollingWindow(0)


def test_a_rank_record_carries_the_rolling_window_of_its_last_epoch() -> None:
    window = RollingWindow(3)
    epochs = []
    for epoch, step in enumerate([0.2, 0.1]):
        record = EpochInput(epoch=epoch, seconds=0.05 * 5, batches=5, rows=160)
        for _ in range(5):
            window.add(step, 0.05)
        epochs.append(
            epoch_steps(
                epoch, [step] * 5, record, first_step_input=None, rolling=window.figures(32)
            )
        )
    report = rank_report(0, epochs, 0.0)
    assert report["rolling"]["mean_step_seconds"] == pytest.approx(0.1)
    assert report["rolling"]["input_bound"] == pytest.approx(0.5)
    assert [e["rolling"]["mean_step_seconds"] for e in report["epochs"]] == pytest.approx(
        [0.2, 0.1]
    )
    json.dumps(report)  # travels as JSON


def test_the_epoch_log_holds_every_finished_epoch_after_each(tmp_path: Path) -> None:
    path = tmp_path / EPOCHS_FILE
    log = EpochLog(path)
    for epoch in range(2):
        ranks = [
            rank(0, input_per_batch=0.002, step=0.1, longest=0.1),
            rank(1, input_per_batch=0.2, step=0.1, longest=0.1),
        ]
        log.add(epoch, ranks)
        written = read_epoch_log(path)
        assert [e["epoch"] for e in written] == list(range(epoch + 1))
        assert written[-1]["input_by_rank"] == ranks
        assert written[-1]["input_summary"]["flags"] == {"0": [], "1": ["input-bound", "slowest"]}
        assert [p.name for p in tmp_path.iterdir()] == [EPOCHS_FILE]  # no temporary left
    table = epoch_table(read_epoch_log(path)[-1])
    assert [(row["epoch"], row["rank"], row["flags"]) for row in table] == [
        (2, 0, ""),
        (2, 1, "input-bound, slowest"),
    ]
    path.write_text(json.dumps({"format_version": 99, "epochs": []}))
    with pytest.raises(ValueError, match="format_version 99"):
        read_epoch_log(path)


def test_the_epoch_line_names_the_file_through_horovodruns_prefix(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "a model" / EPOCHS_FILE
    line = epoch_line(2, path)
    assert line.startswith("input metrics of epoch 3: ")
    assert epoch_log_path(line) == path
    assert epoch_log_path(f"[1,0]<stdout>:{line}\n") == path
    assert epoch_log_path("Epoch 3/3") is None


def test_the_step_meter_publishes_each_epoch_with_its_rolling_window() -> None:
    # The Keras callback driven by hand, as fit would: 2 epochs of 6 steps.
    meter = InputMeter()
    published: list[tuple[int, dict[str, Any]]] = []
    callback = step_meter(meter, 1, window=4, on_epoch=lambda e, r: published.append((e, r)))
    for epoch in range(2):
        callback.on_epoch_begin(epoch)
        record = meter.epoch(epoch)
        for batch in range(6):
            callback.on_train_batch_begin(batch)
            record.seconds += 0.001
            record.batches += 1
            record.rows += 32
            callback.on_train_batch_end(batch)
        callback.on_epoch_end(epoch)
    assert [e for e, _r in published] == [0, 1]
    for epoch, record in published:
        assert record["rank"] == 1
        assert [e["epoch"] for e in record["epochs"]] == [epoch]
        assert record["rows_per_second"] > 0
    # The run's first step (tracing) is out of the window; after that, the last 4 steps.
    assert published[0][1]["rolling"]["steps"] == 4
    assert published[1][1]["rolling"]["steps"] == 4
    assert published[1][1]["rolling"]["input_bound"] > 0
    assert len(callback.window.step_seconds) == 4
    assert [e["rolling"]["window"] for e in callback.report()["epochs"]] == [4, 4]


def test_a_metered_epoch_counts_whole_row_groups_and_keeps_the_batch_order(
    processed: tuple[Catalog, Manifest],  # noqa: F811 (the fixture imported above)
) -> None:
    catalog, manifest = processed
    url = str(as_url(catalog.split_dir(manifest, "train")))
    processed_layout = ProcessedLayout.of(manifest)
    layout = processed_layout.train
    spec = InputSpec.of(processed_layout)
    steps = plan_steps(layout, 2, 32)

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
