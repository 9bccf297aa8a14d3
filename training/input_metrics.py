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
                       and RollingWindow: the last ROLLING_STEPS steps
                                         │
             each epoch's end ───────────┴─────────── after fit
             allgather to rank 0                      allgather to rank 0
                    ▼                                        ▼
             EpochLog: input-epochs.json              metrics.json "input_by_rank",
             (the caller reads it while               summarize() → flags
             training runs)

What "input-bound" means here: the share of a rank's step time its input needed to produce
the batches, ``min(1, input seconds / step seconds)`` over an epoch (and over the run). The
generator runs ahead of the steps behind tf.data's prefetch, so a rank whose input takes less
time than its steps never waits for it; one whose input takes as long as its steps (or longer)
is paced by it. With synchronous allreduce every rank's steps take about as long as the slowest
rank's, so step time does not tell ranks apart; the input's own seconds per batch do, and the
slowest rank is the one with the most (its step imbalance, slowest/fastest mean step time, is
reported too and stays near 1 in synchronous training).

Nothing here adds work to a step but two clock readings and two appends to bounded deques; the
ranks' records travel once per epoch (a small gather, for the per-epoch file) and once after
training.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

INPUT_DELAY_ENV = "SHARDFLOW_TEST_INPUT_DELAY"
"""Test hook: ``RANK:SECONDS[,RANK:SECONDS...]`` makes that rank's input sleep SECONDS before
every batch it hands over, to slow one rank on purpose. Not for real runs."""

INPUT_BOUND_THRESHOLD = 0.5
"""A rank is flagged input-bound when its input needed more than this share of its step time."""
SLOWEST_IMBALANCE = 1.5
"""A rank is flagged slowest only when its input seconds per batch are at least this many
times the fastest rank's: some rank always has the most, and ranks reading the same amount of
data differ by 10-30 % on a busy machine (1.26 was seen in a normal 2-rank run)."""
SLOWEST_MIN_INPUT_BOUND = 0.25
"""...and only when that input takes at least this share of the rank's step time: below a
quarter, the prefetch buffer hides the input four times over and which rank is slowest does
not matter yet."""
STALL_FACTOR = 10.0
"""A step "stalled" when it took more than this many times the median step of all ranks (the
first step of a run, which traces the model, is left out)."""
STALL_STEPS = 3
"""A rank is flagged stalled when at least this many of its steps stalled: one long step is a
hiccup of a busy machine (0.52 s against a 0.046 s median was seen in a normal run)..."""
STALL_SECONDS = 5.0
"""...or when one stalled step also lasted at least this many seconds: a wait no hiccup
explains (a lost file system, a swapping host)."""
LONGEST_STEPS_KEPT = 10
"""How many of its longest steps each rank keeps for :func:`summarize` (at least
:data:`STALL_STEPS`)."""
ROLLING_STEPS = 50
"""The rolling window: each rank's last this many steps (across epoch ends)."""
EPOCHS_FILE = "input-epochs.json"
"""In the run folder: every finished epoch's input figures of every rank, written by rank 0."""
EPOCHS_FORMAT_VERSION = 1
EPOCH_LINE = "input metrics of epoch"
"""Rank 0 prints ``<EPOCH_LINE> N: <path of EPOCHS_FILE>`` once the file holds epoch N."""


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
    """Reader items: row groups (the rank's reader hands over one row group at a time; the
    petastorm format's in blocks of rows, each counted as one)."""
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
class RollingFigures:
    """A rank's last ``steps`` steps (at most ``window``), as of the end of an epoch."""

    window: int
    steps: int
    mean_step_seconds: float
    batches_per_second: float
    rows_per_second: float
    input_bound: float
    """``min(1, input seconds / step seconds)`` over the window's steps."""


class RollingWindow:
    """The durations of a rank's last ``size`` timed steps and the input time made during each:
    two bounded deques of floats, nothing else per step."""

    def __init__(self, size: int = ROLLING_STEPS) -> None:
        if size < 1:
            raise ValueError(f"a rolling window holds at least 1 step, not {size}")
        self.size = size
        self.step_seconds: deque[float] = deque(maxlen=size)
        self.input_seconds: deque[float] = deque(maxlen=size)

    def add(self, step_seconds: float, input_seconds: float) -> None:
        self.step_seconds.append(step_seconds)
        self.input_seconds.append(input_seconds)

    def figures(self, rows_per_batch: float) -> RollingFigures:
        """The window now; ``rows_per_batch`` turns steps into rows."""
        steps = len(self.step_seconds)
        total = sum(self.step_seconds)
        return RollingFigures(
            window=self.size,
            steps=steps,
            mean_step_seconds=total / steps if steps else 0.0,
            batches_per_second=steps / total if total > 0 else 0.0,
            rows_per_second=steps * rows_per_batch / total if total > 0 else 0.0,
            input_bound=min(1.0, sum(self.input_seconds) / total) if total > 0 else 0.0,
        )


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
    longest_step_seconds: list[float]
    """The epoch's longest timed steps, longest first (at most :data:`LONGEST_STEPS_KEPT`)."""
    input_seconds: float
    """All the epoch's input time (its batches' production)."""
    timed_input_seconds: float
    """Input time while the timed steps ran (what was spent during the first step left out)."""
    batches: int
    rows: int
    row_groups_read: int
    bytes_read: int
    input_bound: float
    rolling: RollingFigures | None = None
    """The rank's rolling window as of this epoch's end."""


def epoch_steps(
    epoch: int,
    durations: list[float],
    record: EpochInput,
    *,
    first_step_input: float | None,
    rolling: RollingFigures | None = None,
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
        longest_step_seconds=heapq.nlargest(LONGEST_STEPS_KEPT, counted),
        input_seconds=record.seconds,
        timed_input_seconds=timed_input,
        batches=record.batches,
        rows=record.rows,
        row_groups_read=record.row_groups_read,
        bytes_read=record.bytes_read,
        input_bound=min(1.0, timed_input / total) if total > 0 else 0.0,
        rolling=rolling,
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
        "longest_step_seconds": heapq.nlargest(
            LONGEST_STEPS_KEPT, (s for e in epochs for s in e.longest_step_seconds)
        ),
        "first_step_seconds": first_step_seconds,
        "input_seconds": input_seconds,
        "input_seconds_per_batch": input_seconds / batches if batches else 0.0,
        "input_bound": min(1.0, timed_input_seconds / step_seconds) if step_seconds > 0 else 0.0,
        "batches_per_second": timed_steps / step_seconds if step_seconds > 0 else 0.0,
        "rows_per_second": rows / step_seconds if step_seconds > 0 else 0.0,
        "input_rows_per_second": rows / input_seconds if input_seconds > 0 else 0.0,
        "bytes_read": sum(e.bytes_read for e in epochs),
        "row_groups_read": sum(e.row_groups_read for e in epochs),
        # The window as of the last epoch's end; each epoch's is in "epochs".
        "rolling": asdict(epochs[-1].rolling) if epochs and epochs[-1].rolling else None,
        "epochs": [asdict(e) for e in epochs],
    }


def summarize(
    input_by_rank: list[dict[str, Any]],
    *,
    input_bound_threshold: float = INPUT_BOUND_THRESHOLD,
    slowest_imbalance: float = SLOWEST_IMBALANCE,
    slowest_min_input_bound: float = SLOWEST_MIN_INPUT_BOUND,
    stall_factor: float = STALL_FACTOR,
    stall_steps: int = STALL_STEPS,
    stall_seconds: float = STALL_SECONDS,
) -> dict[str, Any]:
    """Across ranks: the slowest rank (most input seconds per batch), imbalances, and each
    rank's flags.

    - "input-bound": its input needed more than ``input_bound_threshold`` of its step time.
    - "slowest": the slowest rank, when there are several, its input seconds per batch are at
      least ``slowest_imbalance`` times the fastest rank's, and it is at least
      ``slowest_min_input_bound`` input-bound (see :data:`SLOWEST_IMBALANCE`).
    - "stalled": at least ``stall_steps`` of its steps took over ``stall_factor`` times the
      median step of all ranks, or one of them also lasted ``stall_seconds`` or more (see
      :data:`STALL_STEPS`). Ranks count from the longest steps they kept
      (:data:`LONGEST_STEPS_KEPT`); older records that kept only their longest count that one.
    """
    if not input_by_rank:
        return {"ranks": [], "flags": {}}
    assert stall_steps <= LONGEST_STEPS_KEPT  # ranks keep no more long steps than that

    def ratio(values: list[float]) -> float | None:
        return max(values) / min(values) if values and min(values) > 0 else None

    medians = [r["median_step_seconds"] for r in input_by_rank if r["median_step_seconds"] > 0]
    median_step = statistics.median(medians) if medians else 0.0
    slowest = max(input_by_rank, key=lambda r: r["input_seconds_per_batch"])
    fastest_per_batch = min(r["input_seconds_per_batch"] for r in input_by_rank)
    slowest_per_batch = slowest["input_seconds_per_batch"]
    slowest_flagged = (
        len(input_by_rank) > 1
        and slowest_per_batch > 0
        # Fastest at 0 s a batch (all its input made during the first step): any is a lot more.
        and slowest_per_batch >= slowest_imbalance * fastest_per_batch
        and slowest["input_bound"] >= slowest_min_input_bound
    )
    flags: dict[str, list[str]] = {}
    stalled_steps: dict[str, int] = {}
    for r in input_by_rank:
        mine = []
        if r["input_bound"] > input_bound_threshold:
            mine.append("input-bound")
        longest = r.get("longest_step_seconds", [r["max_step_seconds"]])
        stalls = [s for s in longest if s > stall_factor * median_step] if median_step > 0 else []
        stalled_steps[str(r["rank"])] = len(stalls)
        if len(stalls) >= stall_steps or any(s >= stall_seconds for s in stalls):
            mine.append("stalled")
        if slowest_flagged and r["rank"] == slowest["rank"]:
            mine.append("slowest")
        flags[str(r["rank"])] = mine
    return {
        "slowest_rank": slowest["rank"],
        "slowest_flagged": slowest_flagged,
        "step_imbalance": ratio([r["mean_step_seconds"] for r in input_by_rank]),
        "input_imbalance": ratio([r["input_seconds_per_batch"] for r in input_by_rank]),
        "median_step_seconds": median_step,
        "input_bound_threshold": input_bound_threshold,
        "slowest_imbalance": slowest_imbalance,
        "slowest_min_input_bound": slowest_min_input_bound,
        "stall_factor": stall_factor,
        "stall_steps": stall_steps,
        "stall_seconds": stall_seconds,
        # Counted among the longest steps each rank kept (at most LONGEST_STEPS_KEPT).
        "stalled_steps": stalled_steps,
        "flags": flags,
    }


class EpochLog:
    """:data:`EPOCHS_FILE`: every finished epoch's per-rank records (:func:`rank_report` of
    that epoch alone) and their :func:`summarize`, rewritten whole after each epoch (a temporary
    file, then ``os.replace``: a reader sees the previous epochs or the new ones, never half)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.epochs: list[dict[str, Any]] = []

    def add(self, epoch: int, input_by_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """Epoch ``epoch`` (from 0) of every rank, in rank order; returns its entry."""
        entry = {
            "epoch": epoch,
            "input_by_rank": input_by_rank,
            "input_summary": summarize(input_by_rank),
        }
        self.epochs.append(entry)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(
            json.dumps({"format_version": EPOCHS_FORMAT_VERSION, "epochs": self.epochs})
        )
        os.replace(temporary, self.path)
        return entry


def read_epoch_log(path: Path) -> list[dict[str, Any]]:
    """The epochs :class:`EpochLog` wrote to ``path``, oldest first; ValueError for another
    format version."""
    document = json.loads(path.read_text())
    if document.get("format_version") != EPOCHS_FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {document.get('format_version')!r}, "
            f"expected {EPOCHS_FORMAT_VERSION}"
        )
    return list(document["epochs"])


def epoch_line(epoch: int, path: Path) -> str:
    """What rank 0 prints once ``path`` holds epoch ``epoch`` (from 0)."""
    return f"{EPOCH_LINE} {epoch + 1}: {path}"


_EPOCH_LINE = re.compile(re.escape(EPOCH_LINE) + r" \d+: (?P<path>\S.*\S|\S)\s*$")


def epoch_log_path(line: str) -> Path | None:
    """The path in an :func:`epoch_line` (horovodrun's rank prefix allowed before it); None
    for any other line."""
    found = _EPOCH_LINE.search(line)
    return Path(found["path"]) if found else None


def epoch_table(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank of an :class:`EpochLog` entry: the epoch's figures, the rolling
    window's and the flags."""
    flags = entry["input_summary"]["flags"]
    rows = []
    for r in entry["input_by_rank"]:
        rolling = r.get("rolling") or {}
        rows.append(
            {
                "epoch": entry["epoch"] + 1,
                "rank": r["rank"],
                "rows/s": round(r["rows_per_second"]),
                "batches/s": round(r["batches_per_second"], 1),
                "input-bound %": round(100 * r["input_bound"], 1),
                "mean step ms": round(1000 * r["mean_step_seconds"], 2),
                "input ms/batch": round(1000 * r["input_seconds_per_batch"], 2),
                "window rows/s": round(rolling.get("rows_per_second", 0.0)),
                "window input-bound %": round(100 * rolling.get("input_bound", 0.0), 1),
                "window mean step ms": round(1000 * rolling.get("mean_step_seconds", 0.0), 2),
                "MB read": round(r["bytes_read"] / 1e6, 1),
                "row groups read": r["row_groups_read"],
                "flags": ", ".join(flags.get(str(r["rank"]), [])),
            }
        )
    return rows


def step_meter(
    meter: InputMeter,
    rank: int,
    log_dir: str | None = None,
    *,
    window: int = ROLLING_STEPS,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
) -> Any:
    """A Keras callback timing every training step of this rank and, at each epoch's end,
    joining the steps with ``meter``'s record of the epoch (``.epochs``, ``.report()``), with
    the rolling figures of the last ``window`` steps; with ``log_dir``, the epoch's input
    scalars go to TensorBoard there; with ``on_epoch``, it is called with the epoch (from 0)
    and this rank's :func:`rank_report` of that epoch alone."""
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
            self.window = RollingWindow(window)
            self._record = meter.epoch(0)
            self._input_before = 0.0
            self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch = epoch
            self._durations = []
            self._record = meter.epoch(epoch)
            # Input made for this epoch before its first step (prefetched) goes to that step.
            self._input_before = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            duration = time.perf_counter() - self._started
            self._durations.append(duration)
            # The input made while this step ran (the tf.data thread adds to it meanwhile).
            input_now = self._record.seconds
            made, self._input_before = input_now - self._input_before, input_now
            if not self.epochs and len(self._durations) == 1:
                self.first_step_seconds = duration
                self._first_step_input = input_now
            else:
                self.window.add(duration, made)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            record = meter.epoch(epoch)
            summary = epoch_steps(
                epoch,
                self._durations,
                record,
                first_step_input=self._first_step_input if not self.epochs else None,
                rolling=self.window.figures(
                    record.rows / record.batches if record.batches else 0.0
                ),
            )
            self.epochs.append(summary)
            if on_epoch is not None:
                on_epoch(epoch, rank_report(rank, [summary], self.first_step_seconds))
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
