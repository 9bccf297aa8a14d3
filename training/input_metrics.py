"""Per-rank input metrics: how long each rank's input takes to make its batches, how long its
steps take, and from both whether the rank waits on its input.

    tf.data thread (input.py generator)        main thread (Keras fit)
    ───────────────────────────────────        ───────────────────────
    metered(): seconds spent producing          step_meter(): wall time of every step,
      each epoch's chunks, rows, batches;         on_train_batch_begin → end (a step
      epoch_batches(): row groups and the         includes waiting on the prefetch
      bytes the reader handed over                buffer when it is empty)
                  │                                          │
                  └──────────► EpochInput per epoch ◄────────┘
                                         │ after fit: allgather to rank 0
                                         ▼
                               metrics.json "input_by_rank", summarize() → flags

What "input-bound" means here: the share of a rank's step time its input needed to produce
the batches, ``min(1, input seconds / step seconds)`` over an epoch (and over the run). The
generator runs ahead of the steps behind tf.data's prefetch, so a rank whose input takes less
time than its steps never waits for it; one whose input takes as long as its steps (or longer)
is paced by it. With synchronous allreduce every rank's steps take about as long as the slowest
rank's, so step time does not tell ranks apart; the input's own seconds per batch do, and the
slowest rank is the one with the most (its step imbalance, slowest/fastest mean step time, is
reported too and stays near 1 in synchronous training).

Nothing here adds work to a step but two clock readings; the ranks' records travel once, after
training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

INPUT_DELAY_ENV = "SHARDFLOW_TEST_INPUT_DELAY"
"""Test hook: ``RANK:SECONDS[,RANK:SECONDS...]`` makes that rank's input sleep SECONDS before
every batch it hands over, to slow one rank on purpose. Not for real runs."""

INPUT_BOUND_THRESHOLD = 0.5
"""A rank is flagged input-bound when its input needed more than this share of its step time."""
STALL_FACTOR = 10.0
"""A rank is flagged stalled when one of its steps took more than this many times the median
step of all ranks (the first step of a run, which traces the model, is left out)."""


def input_delay(rank: int, environ: Mapping[str, str]) -> float:
    """Seconds of deliberate delay per batch for ``rank`` from :data:`INPUT_DELAY_ENV`
    (0.0 when unset or naming other ranks); ValueError on a malformed value."""
    text = environ.get(INPUT_DELAY_ENV, "").strip()
    delay = 0.0
    for item in filter(None, (part.strip() for part in text.split(","))):
        who, sep, seconds = item.partition(":")
        try:
            if not sep:
                raise ValueError
            chosen, value = int(who), float(seconds)
        except ValueError:
            raise ValueError(
                f"{INPUT_DELAY_ENV}={text!r}: expected RANK:SECONDS[,RANK:SECONDS...]"
            ) from None
        if value < 0:
            raise ValueError(f"{INPUT_DELAY_ENV}={text!r}: seconds must be >= 0")
        if chosen == rank:
            delay = value
    return delay


@dataclass(kw_only=True)
class EpochInput:
    """What one rank's input did in one epoch (filled in by the tf.data thread)."""

    epoch: int
    seconds: float = 0.0
    """Time the generator spent producing this epoch's chunks (reading, decoding, shuffling,
    and any test delay), not the time it sat suspended waiting for tf.data to ask."""
    batches: int = 0
    rows: int = 0
    row_groups_read: int = 0
    """Reader items: row groups for the parquet format (petastorm's batch reader hands one row
    group at a time); rows, not row groups, for the petastorm format: 0 there."""
    bytes_read: int = 0
    """Bytes of the arrays the reader handed over (decoded pixels or features, and labels)."""

    def read(self, rows: int, nbytes: int, *, row_group: bool) -> None:
        """One reader item: ``rows`` rows of ``nbytes`` bytes, a whole row group or not."""
        self.bytes_read += nbytes
        self.row_groups_read += int(row_group)


class InputMeter:
    """Every epoch's :class:`EpochInput` of one rank, by epoch number."""

    def __init__(self) -> None:
        self.epochs: dict[int, EpochInput] = {}

    def epoch(self, epoch: int) -> EpochInput:
        return self.epochs.setdefault(epoch, EpochInput(epoch=epoch))


def metered(
    chunks: Iterator[tuple[Any, Any]],
    record: EpochInput,
    *,
    batch_size: int,
    delay: float = 0.0,
) -> Iterator[tuple[Any, Any]]:
    """``chunks`` (arrays of whole batches) as they are, timing how long each took to make.

    With a test ``delay``, chunks are handed over one batch at a time, each after sleeping
    ``delay`` seconds: the same batches in the same order (tf.data cuts chunks into batches
    anyway), at a pace the test chooses.
    """
    try:
        started = time.perf_counter()
        for x, y in chunks:
            pieces = (
                [
                    (x[i : i + batch_size], y[i : i + batch_size])
                    for i in range(0, len(y), batch_size)
                ]
                if delay
                else [(x, y)]
            )
            for piece_x, piece_y in pieces:
                if delay:
                    time.sleep(delay)
                record.seconds += time.perf_counter() - started
                record.batches += len(piece_y) // batch_size
                record.rows += len(piece_y)
                yield piece_x, piece_y
                started = time.perf_counter()
        record.seconds += time.perf_counter() - started
    finally:
        close: Callable[[], None] | None = getattr(chunks, "close", None)
        if close is not None:
            close()


@dataclass(kw_only=True)
class EpochSteps:
    """One rank's steps in one epoch, with what its input did for them."""

    epoch: int
    steps: int
    timed_steps: int
    """Steps timed: all but the run's first, which traces the model (its own seconds apart)."""
    step_seconds: float
    """Of the timed steps."""
    median_step_seconds: float
    max_step_seconds: float
    input_seconds: float
    """All the epoch's input time (its batches' production)."""
    timed_input_seconds: float
    """Input time while the timed steps ran (what was spent during the first step left out)."""
    batches: int
    rows: int
    row_groups_read: int
    bytes_read: int
    input_bound: float


def epoch_steps(
    epoch: int, durations: list[float], record: EpochInput, *, first_step_input: float | None
) -> EpochSteps:
    """Summarise one epoch's step ``durations`` with its input ``record``.

    In the epoch holding the run's first step, ``first_step_input`` is the input time spent
    by the end of that step: the step (tracing the model, seconds on a busy machine) and the
    input made while it ran are both left out, so that neither hides the rest.
    """
    first = first_step_input is not None
    counted = durations[1:] if first else durations
    total = sum(counted)
    timed_input = max(0.0, record.seconds - (first_step_input or 0.0))
    return EpochSteps(
        epoch=epoch,
        steps=len(durations),
        timed_steps=len(counted),
        step_seconds=total,
        median_step_seconds=statistics.median(counted) if counted else 0.0,
        max_step_seconds=max(counted, default=0.0),
        input_seconds=record.seconds,
        timed_input_seconds=timed_input,
        batches=record.batches,
        rows=record.rows,
        row_groups_read=record.row_groups_read,
        bytes_read=record.bytes_read,
        input_bound=min(1.0, timed_input / total) if total > 0 else 0.0,
    )


def rank_report(rank: int, epochs: list[EpochSteps], first_step_seconds: float) -> dict[str, Any]:
    """One rank's record for metrics.json: its epochs and their totals."""
    steps = sum(e.steps for e in epochs)
    timed_steps = sum(e.timed_steps for e in epochs)
    step_seconds = sum(e.step_seconds for e in epochs)
    input_seconds = sum(e.input_seconds for e in epochs)
    timed_input_seconds = sum(e.timed_input_seconds for e in epochs)
    batches = sum(e.batches for e in epochs)
    rows = sum(e.rows for e in epochs)
    medians = [e.median_step_seconds for e in epochs if e.steps]
    return {
        "rank": rank,
        "steps": steps,
        "step_seconds": step_seconds,
        "mean_step_seconds": step_seconds / timed_steps if timed_steps else 0.0,
        "median_step_seconds": statistics.median(medians) if medians else 0.0,
        "max_step_seconds": max((e.max_step_seconds for e in epochs), default=0.0),
        "first_step_seconds": first_step_seconds,
        "input_seconds": input_seconds,
        "input_seconds_per_batch": input_seconds / batches if batches else 0.0,
        "input_bound": min(1.0, timed_input_seconds / step_seconds) if step_seconds > 0 else 0.0,
        "batches_per_second": timed_steps / step_seconds if step_seconds > 0 else 0.0,
        "rows_per_second": rows / step_seconds if step_seconds > 0 else 0.0,
        "input_rows_per_second": rows / input_seconds if input_seconds > 0 else 0.0,
        "bytes_read": sum(e.bytes_read for e in epochs),
        "row_groups_read": sum(e.row_groups_read for e in epochs),
        "epochs": [asdict(e) for e in epochs],
    }


def summarize(
    input_by_rank: list[dict[str, Any]],
    *,
    input_bound_threshold: float = INPUT_BOUND_THRESHOLD,
    stall_factor: float = STALL_FACTOR,
) -> dict[str, Any]:
    """Across ranks: the slowest rank (most input seconds per batch), imbalances, and each
    rank's flags ("input-bound", "stalled", "slowest")."""
    if not input_by_rank:
        return {"ranks": [], "flags": {}}

    def ratio(values: list[float]) -> float | None:
        return max(values) / min(values) if values and min(values) > 0 else None

    medians = [r["median_step_seconds"] for r in input_by_rank if r["median_step_seconds"] > 0]
    median_step = statistics.median(medians) if medians else 0.0
    slowest = max(input_by_rank, key=lambda r: r["input_seconds_per_batch"])["rank"]
    flags: dict[str, list[str]] = {}
    for r in input_by_rank:
        mine = []
        if r["input_bound"] > input_bound_threshold:
            mine.append("input-bound")
        if median_step > 0 and r["max_step_seconds"] > stall_factor * median_step:
            mine.append("stalled")
        if r["rank"] == slowest and len(input_by_rank) > 1:
            mine.append("slowest")
        flags[str(r["rank"])] = mine
    return {
        "slowest_rank": slowest,
        "step_imbalance": ratio([r["mean_step_seconds"] for r in input_by_rank]),
        "input_imbalance": ratio([r["input_seconds_per_batch"] for r in input_by_rank]),
        "median_step_seconds": median_step,
        "input_bound_threshold": input_bound_threshold,
        "stall_factor": stall_factor,
        "flags": flags,
    }


def step_meter(meter: InputMeter, rank: int, log_dir: str | None = None) -> Any:
    """A Keras callback timing every training step of this rank and, at each epoch's end,
    joining the steps with ``meter``'s record of the epoch (``.epochs``, ``.report()``);
    with ``log_dir``, the epoch's input scalars go to TensorBoard there."""
    import tensorflow as tf

    class StepMeter(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            # Keras hands this callback its logs as they are, without converting them to
            # numpy (which would wait for the step's results): it does not read them.
            self._supports_tf_logs = True
            self.epochs: list[EpochSteps] = []
            self.first_step_seconds = 0.0
            self._first_step_input: float | None = None
            self._epoch = 0
            self._durations: list[float] = []
            self._started = 0.0
            self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch = epoch
            self._durations = []

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._durations.append(time.perf_counter() - self._started)
            if not self.epochs and len(self._durations) == 1:
                self.first_step_seconds = self._durations[0]
                self._first_step_input = meter.epoch(self._epoch).seconds

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            summary = epoch_steps(
                epoch,
                self._durations,
                meter.epoch(epoch),
                first_step_input=self._first_step_input if not self.epochs else None,
            )
            self.epochs.append(summary)
            if self._writer is not None:
                with self._writer.as_default(step=epoch + 1):
                    tf.summary.scalar("input/input_bound", summary.input_bound)
                    tf.summary.scalar("input/input_seconds", summary.input_seconds)
                    tf.summary.scalar("input/step_seconds", summary.step_seconds)
                    tf.summary.scalar(
                        "input/batches_per_second",
                        summary.timed_steps / summary.step_seconds if summary.step_seconds else 0.0,
                    )
                    tf.summary.scalar("input/bytes_read", float(summary.bytes_read))
                    tf.summary.scalar("input/row_groups_read", float(summary.row_groups_read))
                self._writer.flush()

        def report(self) -> dict[str, Any]:
            return rank_report(rank, self.epochs, self.first_step_seconds)

    return StepMeter()
