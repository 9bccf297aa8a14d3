"""One rank of ``shardflow bench storage``: ``python -m lab.bench.storage_rank CONFIG``.

It reads one JSON command a line on stdin and answers each with one JSON line on stdout, so
that the bench can drop the page cache between phases while every rank waits:

- ``read_table``: ``pq.ParquetFile.read_row_groups`` (what ``pq.read_table`` runs per file) →
  numpy of the row groups this rank's reader will read in the phase, the baseline;
- ``reader``: the rank's reader (training.input.epoch_batches: the plan, the epoch order, the
  reader threads, the shuffle window) as fast as it goes: decoded rows, against the baseline;
- ``input``: the rank's whole input into TensorFlow (make_train_dataset: the reader, tf.data's
  batches, prefetched) as fast as it goes: what accelerators could be fed;
- ``emulate``: the same input feeding an emulated accelerator, which computes each batch for
  ``step_seconds`` while the host fetches the next (at most two steps queued, as on a GPU);
  AU = compute time ÷ wall time, as MLPerf Storage counts it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.input import InputSpec, epoch_seed, row_group_order
from training.row_groups import binary_pixels, split_files


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank reads in every phase (the bench writes it as JSON)."""

    url: str | list[str]
    spec: dict[str, Any]
    rank: int
    num_ranks: int
    batch_size: int
    steps: int
    """Steps of every epoch of a phase (at most the plan's steps per epoch)."""
    epochs: int
    seed: int
    shuffle_buffer: int
    step_seconds: float
    """The emulated accelerator's compute time of one batch."""


def _cpu() -> float:
    return time.process_time()


def _source(plan: RankPlan) -> str | tuple[str, ...]:
    return tuple(plan.url) if isinstance(plan.url, list) else plan.url


def _phase_groups(plan: RankPlan, first_epoch: int) -> list[int]:
    """The row groups the reader reads in a phase, in order: each epoch's groups holding its
    ``steps`` batches (the shuffle window reads a little past them: one group more)."""
    files = split_files(_source(plan))
    wanted: list[int] = []
    for epoch in range(first_epoch, first_epoch + plan.epochs):
        order = row_group_order(
            len(files.groups), plan.rank, plan.num_ranks, epoch_seed(plan.seed, epoch)
        )
        rows = 0
        for i in order:
            if rows >= plan.steps * plan.batch_size + plan.shuffle_buffer:
                break
            wanted.append(i)
            rows += files.groups[i].rows
    return wanted


def read_table(plan: RankPlan, first_epoch: int) -> dict[str, Any]:
    """The baseline: the phase's row groups, file by file, into numpy (uint8 pixels viewed in
    place, labels), with pyarrow's own threads."""
    spec = InputSpec(**plan.spec)
    files = split_files(_source(plan))
    groups = _phase_groups(plan, first_epoch)
    by_file: dict[str, list[int]] = {}
    for i in groups:
        by_file.setdefault(files.groups[i].path, []).append(files.groups[i].index)
    row_bytes = int(np.prod(spec.input_shape)) * np.dtype(spec.stream_dtype).itemsize
    cpu, started = _cpu(), time.perf_counter()
    rows = 0
    for path, indexes in by_file.items():
        table = files.open(path).read_row_groups(indexes, columns=spec.columns)
        labels = table.column(spec.label_column).to_numpy()
        if spec.kind == "images" and spec.format == "parquet":
            binary_pixels(table.column("image").combine_chunks(), row_bytes)
        else:
            for column in spec.columns:
                table.column(column).to_numpy()
        rows += len(labels)
        del table
    wall, cpu = time.perf_counter() - started, _cpu() - cpu
    return {"rows": rows, "bytes": rows * row_bytes, "wall": wall, "cpu": cpu}


def _batches(plan: RankPlan, first_epoch: int) -> Iterator[Any]:
    from training.input import make_train_dataset

    dataset = make_train_dataset(
        plan.url,
        InputSpec(**plan.spec),
        rank=plan.rank,
        num_ranks=plan.num_ranks,
        batch_size=plan.batch_size,
        steps_per_epoch=plan.steps,
        seed=plan.seed,
        shuffle_buffer=plan.shuffle_buffer,
        first_epoch=first_epoch,
        epochs=first_epoch + plan.epochs,
    )
    return iter(dataset)


def reader(plan: RankPlan, first_epoch: int) -> dict[str, Any]:
    """The rank's reader alone (training.input.epoch_batches: the plan, the epoch order, the
    reader threads, the shuffle window) over the phase's epochs, as fast as it goes: the rows
    it decoded (what it read, counted by the input meter; a few past the last batch handed
    over) and the rows it handed over."""
    from training.input import epoch_batches
    from training.input_metrics import EpochInput

    spec = InputSpec(**plan.spec)
    row_bytes = int(np.prod(spec.input_shape)) * np.dtype(spec.stream_dtype).itemsize
    label_bytes = np.dtype(np.int64).itemsize
    cpu, started = _cpu(), time.perf_counter()
    handed = 0
    read = EpochInput(epoch=first_epoch)
    for epoch in range(first_epoch, first_epoch + plan.epochs):
        for _x, y in epoch_batches(
            plan.url,
            spec,
            rank=plan.rank,
            num_ranks=plan.num_ranks,
            seed=plan.seed,
            epoch=epoch,
            batch_size=plan.batch_size,
            steps=plan.steps,
            shuffle_buffer=plan.shuffle_buffer,
            record=read,
        ):
            handed += len(y)
    wall, cpu = time.perf_counter() - started, _cpu() - cpu
    rows = read.bytes_read // (row_bytes + label_bytes)
    return {"rows": rows, "handed": handed, "bytes": rows * row_bytes, "wall": wall, "cpu": cpu}


def fed(plan: RankPlan, first_epoch: int, *, emulate: bool) -> dict[str, Any]:
    """The rank's whole input (make_train_dataset: the reader into tf.data's batches) over
    the phase's epochs, as fast as it goes (``emulate`` False) or feeding the emulated
    accelerator: it computes batch i from when it is free and has the batch, for
    ``step_seconds``. The host hands batch i over and, as a framework does with a GPU's queue
    (prefetching to the device), runs at most two steps ahead: it waits for step i-1 to start,
    then fetches batch i+1 while steps i-1 and i are queued. On a host whose cores are all busy,
    a thread waking from its wait can be late by a scheduler slice; two steps of slack keep that
    lateness from counting as the input's."""
    spec = InputSpec(**plan.spec)
    row_bytes = int(np.prod(spec.input_shape)) * np.dtype(spec.stream_dtype).itemsize
    batches = _batches(plan, first_epoch)
    cpu, started = _cpu(), time.perf_counter()
    done = previous_start = started  # the accelerator's last step: its end; the one before: start
    steps = 0
    for _x, _y in batches:
        if emulate:
            start = max(done, time.perf_counter())
            done = start + plan.step_seconds
            pause = previous_start - time.perf_counter()
            previous_start = start
            if pause > 0:
                time.sleep(pause)
        steps += 1
    end = max(time.perf_counter(), done)
    wall, cpu = end - started, _cpu() - cpu
    rows = steps * plan.batch_size
    result = {"rows": rows, "bytes": rows * row_bytes, "wall": wall, "cpu": cpu, "steps": steps}
    if emulate:
        compute = steps * plan.step_seconds
        result.update(compute=compute, au=compute / wall if wall > 0 else 0.0)
    return result


PHASES = ("read_table", "reader", "input", "emulate")


def main(argv: list[str]) -> int:
    plan = RankPlan(**json.loads(Path(argv[0]).read_text()))
    import tensorflow as tf  # noqa: F401  (loaded before the first phase is timed)

    print(json.dumps({"ready": plan.rank}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        phase, first_epoch = command["phase"], int(command["first_epoch"])
        if phase == "warmup":
            # TensorFlow's first dataset of the process (kernels, tracing), untimed.
            for _batch in itertools.islice(_batches(plan, 10**6), 3):
                pass
            result = {}
        elif phase == "read_table":
            result = read_table(plan, first_epoch)
        elif phase == "reader":
            result = reader(plan, first_epoch)
        else:
            result = fed(plan, first_epoch, emulate=phase == "emulate")
        print(json.dumps({"rank": plan.rank, "phase": phase, **result}), flush=True)
    return 0


if __name__ == "__main__":
    # Keep TensorFlow's start-up lines off the bench's output.
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main(sys.argv[1:]))
