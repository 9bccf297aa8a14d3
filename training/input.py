"""Per-rank input: each rank streams its own row groups of a split through petastorm into tf.data.

Every epoch is planned, not sampled:

- which row groups a rank reads is petastorm's sharding (row group ``i`` goes to rank
  ``i % num_ranks``), the same set every epoch;
- the order it reads them in changes every epoch and is a pure function of (seed, epoch, rank
  count): one petastorm reader per epoch, seeded from (seed, epoch), with one reading thread so
  that row groups arrive in the order the reader planned (:func:`row_group_order` reproduces it
  for the lineage);
- rows are shuffled within a bounded window by a generator seeded from (seed, epoch, rank);
- every rank yields exactly ``steps_per_epoch`` batches per epoch, planned from the catalog's
  row counts, so no rank waits in an allreduce for a peer that ran out of data.

Ranks are plain integers here; only the worker entry point asks Horovod for them.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq

from data_catalog import Manifest
from data_catalog.layout import ProcessedLayout, SplitLayout

if TYPE_CHECKING:
    from training.input_metrics import EpochInput, InputMeter


def group_rows(
    split: SplitLayout, manifest: Manifest | None = None, name: str = "train"
) -> list[int]:
    """Rows of each row group of split ``name``, in petastorm's order (the files' path order):
    all equal for a split of equal row groups; else every group of a file holds
    ``rows_per_group`` rows but its last, which holds the rest (``manifest`` tells each
    file's rows and groups)."""
    if split.equal_row_groups:
        return [split.rows_per_group] * split.num_row_groups
    if manifest is None:
        raise ValueError(
            f"the {name} split's files end in shorter row groups: count them in its manifest"
        )
    per_group = split.rows_per_group
    sizes: list[int] = []
    for entry in ProcessedLayout.of(manifest).split_entries(manifest, name):
        groups, rows = int(entry.row_groups or 0), int(entry.rows or 0)
        if groups:
            sizes += [per_group] * (groups - 1) + [rows - per_group * (groups - 1)]
    return sizes


def _groups(split: SplitLayout | Sequence[int]) -> Sequence[int]:
    return group_rows(split) if isinstance(split, SplitLayout) else split


def rows_of_rank(split: SplitLayout | Sequence[int], rank: int, num_ranks: int) -> int:
    """Rows ``rank`` reads of a split (its layout when its row groups are equal, else
    :func:`group_rows`), every epoch."""
    # petastorm gives row group i to shard i % shard_count.
    return sum(_groups(split)[rank::num_ranks])


def plan_steps(split: SplitLayout | Sequence[int], num_ranks: int, batch_size: int) -> int:
    """Steps every rank can take in one epoch of ``split`` (its layout when its row groups
    are equal, else :func:`group_rows`): set by the rank with the fewest rows, so that no rank
    waits in an allreduce for a peer that ran out of data. A rank with more rows leaves some
    of them unread each epoch: which ones changes with every epoch's order."""
    groups = _groups(split)
    if len(groups) < num_ranks:
        raise ValueError(
            f"{len(groups)} row groups cannot feed {num_ranks} ranks; "
            "preprocess with smaller row groups or train on fewer ranks"
        )
    fewest = min(rows_of_rank(groups, r, num_ranks) for r in range(num_ranks))
    steps = fewest // batch_size
    if steps == 0:
        raise ValueError(
            f"a rank holds {fewest} rows, fewer than one batch of {batch_size}; lower --batch-size"
        )
    return steps


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """How to turn a processed split's rows into (inputs, labels), from its layout; the
    launcher hands it to the ranks as a dict (``WorkerConfig.spec``)."""

    kind: str = "images"
    """"images" or "tabular"."""
    format: str = "parquet"
    """"parquet" (make_batch_reader) or "petastorm" (make_reader, Unischema)."""
    image_shape: list[int] = field(default_factory=list)
    """(rows, cols, channels) for images."""
    feature_columns: list[str] = field(default_factory=list)
    label_column: str = "label"

    @classmethod
    def of(cls, layout: ProcessedLayout) -> InputSpec:
        """The spec of a processed version, from its layout."""
        return cls(
            kind=layout.kind,
            format=layout.format,
            image_shape=list(layout.pixel_shape),
            feature_columns=list(layout.feature_columns or ()),
            label_column=layout.label_column,
        )

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.image_shape) if self.kind == "images" else (len(self.feature_columns),)

    @property
    def columns(self) -> list[str]:
        if self.kind == "images":
            return ["image", self.label_column]
        return [*self.feature_columns, self.label_column]

    def arrays(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, int64 labels) of a petastorm batch (columnar namedtuple): float32 features,
        or uint8 pixels (rows, cols, channels), which image models take as they are."""
        labels = np.asarray(getattr(batch, self.label_column), dtype=np.int64)
        if self.kind == "tabular":
            features = np.stack(
                [np.asarray(getattr(batch, c), dtype=np.float32) for c in self.feature_columns],
                axis=1,
            )
            return features, labels
        images = batch.image
        if isinstance(images, np.ndarray) and images.dtype == np.uint8:
            pixels = images  # petastorm format: decoded ndarrays
        else:
            pixels = np.frombuffer(b"".join(images), dtype=np.uint8)
        return pixels.reshape(len(labels), *self.image_shape), labels

    @property
    def stream_dtype(self) -> Any:
        return np.uint8 if self.kind == "images" else np.float32


def epoch_seed(seed: int, epoch: int) -> int:
    """The petastorm seed of one epoch: never 0 (petastorm treats seed 0 as "unseeded" and
    shuffles from the global numpy state, which no rank shares)."""
    return (seed * 1_000_003 + epoch * 7_919) % (2**31 - 2) + 1


def row_group_order(num_row_groups: int, rank: int, num_ranks: int, seed: int) -> list[int]:
    """The row groups (global indexes, in path order) ``rank`` reads in one epoch, in reading
    order, when petastorm is seeded with ``seed``: what petastorm 0.13.1's Reader does with
    ``cur_shard``, ``shard_count``, ``seed`` and ``shuffle_row_groups`` (its sharding shuffles
    then keeps indexes ``i % shard_count == cur_shard``; its ventilator permutes them once)."""
    indexes = list(range(num_row_groups))
    random.Random(seed).shuffle(indexes)
    mine = [i for i in indexes if i % num_ranks == rank]
    return [int(i) for i in np.random.default_rng(seed).permutation(mine)]


def _reader(
    url: str | list[str],
    spec: InputSpec,
    *,
    rank: int,
    num_ranks: int,
    seed: int,
    columns: list[str] | None = None,
) -> Any:
    from petastorm import make_batch_reader, make_reader

    options: dict[str, Any] = {
        "schema_fields": columns or spec.columns,
        "cur_shard": rank,
        "shard_count": num_ranks,
        "num_epochs": 1,
        "shuffle_row_groups": True,
        "seed": seed,
        # Read in the calling thread, row group after row group, in the planned order: tf.data
        # runs this generator in a thread of its own and prefetches. Through petastorm's thread
        # pool (even with one worker) a rank's reader came back short or reordered now and
        # then under horovodrun (docs/STACK.md).
        "reader_pool_type": "dummy",
    }
    with warnings.catch_warnings():
        # pyarrow's legacy dataset API (FutureWarning) and a note that schema_fields are
        # matched as regular expressions (our names are plain identifiers, matched whole).
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="schema_fields behavior has changed")
        first = url[0] if isinstance(url, list) else url
        if not first.startswith("file://"):
            options["filesystem"] = legacy_filesystem(first)
        if spec.format == "petastorm":
            return make_reader(url, **options)
        return make_batch_reader(url, **options)


def legacy_filesystem(url: str) -> Any:
    """The fsspec filesystem of ``url`` (s3://...) in the form petastorm 0.13.1 can read with
    pyarrow 14.

    petastorm opens a dataset with ``pq.ParquetDataset(..., validate_schema=False)``, which
    pyarrow 14 accepts only on its legacy code path, and takes that path only for a legacy
    ``pyarrow.filesystem.FileSystem``. For any other URL petastorm hands pyarrow a plain fsspec
    filesystem, and every read fails with "Keyword 'validate_schema' is not yet supported with
    the new Dataset API". pyarrow's own ``S3FSWrapper`` calls s3fs's ``_ls``, a coroutine since
    s3fs 2021; ``DaskFileSystem`` wraps any fsspec filesystem but leaves ``isdir``, ``isfile``
    and ``walk`` unimplemented: they are filled in here from fsspec's (docs/STACK.md).
    """
    import warnings

    import fsspec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyarrow.filesystem is deprecated
        from pyarrow.filesystem import DaskFileSystem

    class FsspecAsLegacy(DaskFileSystem):  # type: ignore[misc]
        def isdir(self, path: str) -> bool:
            return bool(self.fs.isdir(path))

        def isfile(self, path: str) -> bool:
            return bool(self.fs.isfile(path))

        def walk(self, path: str) -> Any:
            return self.fs.walk(path)

    filesystem, _path = fsspec.core.url_to_fs(url)
    return FsspecAsLegacy(filesystem)


# Rows of make_reader gathered into one chunk (petastorm's reader yields one row at a time).
PETASTORM_BLOCK = 256


def _batches(reader: Any, spec: InputSpec) -> Iterator[tuple[Any, Any]]:
    if spec.format == "petastorm":
        block: list[Any] = []
        for row in reader:
            block.append(row)
            if len(block) == PETASTORM_BLOCK:
                yield _stack_rows(block, spec)
                block = []
        if block:
            yield _stack_rows(block, spec)
        return
    for batch in reader:
        yield spec.arrays(batch)


def _stack_rows(rows: list[Any], spec: InputSpec) -> tuple[Any, Any]:
    images = np.stack([r.image for r in rows])
    labels = np.array([getattr(r, spec.label_column) for r in rows], dtype=np.int64)
    return images.reshape(len(rows), *spec.image_shape), labels


def row_group_chunks(
    url: str | list[str],
    spec: InputSpec,
    *,
    rank: int,
    num_ranks: int,
    seed: int,
    direct: bool | None = None,
) -> Iterator[tuple[Any, Any]]:
    """The rank's row groups in petastorm's planned order (:func:`row_group_order`), read with
    pyarrow (training.row_groups; with direct I/O when ``direct``, None: where the split is
    larger than the memory that could cache it): one chunk per row group, as petastorm's batch
    reader hands them over; for the petastorm format, blocks of :data:`PETASTORM_BLOCK` rows,
    as :func:`_batches` gathers make_reader's rows."""
    from training.row_groups import read_groups, split_files

    files = split_files(tuple(url) if isinstance(url, list) else url)
    order = row_group_order(len(files.groups), rank, num_ranks, seed)
    groups = read_groups(files, order, spec, direct=direct)
    if spec.format == "petastorm":
        return _reblocked(groups, PETASTORM_BLOCK)
    return groups


def _reblocked(chunks: Iterator[tuple[Any, Any]], rows: int) -> Iterator[tuple[Any, Any]]:
    """``chunks`` as blocks of ``rows`` rows (the last shorter), in the same order."""
    held_x: list[Any] = []
    held_y: list[Any] = []
    held = 0
    try:
        for x, y in chunks:
            held_x.append(x)
            held_y.append(y)
            held += len(y)
            if held < rows:
                continue
            x_all, y_all = np.concatenate(held_x), np.concatenate(held_y)
            whole = held - held % rows
            for start in range(0, whole, rows):
                yield x_all[start : start + rows], y_all[start : start + rows]
            held_x, held_y, held = [x_all[whole:]], [y_all[whole:]], held - whole
        if held:
            yield np.concatenate(held_x), np.concatenate(held_y)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _petastorm_chunks(
    url: str | list[str], spec: InputSpec, *, rank: int, num_ranks: int, seed: int
) -> Iterator[tuple[Any, Any]]:
    """The same chunks as :func:`row_group_chunks`, read through petastorm's own reader."""
    reader = _reader(url, spec, rank=rank, num_ranks=num_ranks, seed=seed)
    try:
        yield from _batches(reader, spec)
    finally:
        reader.stop()
        reader.join()


READERS = {"pyarrow": row_group_chunks, "petastorm": _petastorm_chunks}
"""The rank's reader: pyarrow's row groups in petastorm's planned order (training.row_groups),
or petastorm's own reader (kept to check that the two agree, and to compare them)."""


def epoch_batches(
    url: str | list[str],
    spec: InputSpec,
    *,
    rank: int,
    num_ranks: int,
    seed: int,
    epoch: int,
    batch_size: int,
    steps: int,
    shuffle_buffer: int,
    record: EpochInput | None = None,
    reader: str = "pyarrow",
    direct: bool | None = None,
) -> Iterator[tuple[Any, Any]]:
    """One rank's rows for one epoch, deterministically shuffled, as chunks of whole batches
    adding up to exactly ``steps`` batches: row groups in the epoch's order, rows mixed within
    windows of ``shuffle_buffer`` rows by a generator seeded from (seed, epoch, rank); what the
    reader (:data:`READERS`) handed over is counted in ``record`` when given. ``direct``: the
    pyarrow reader's direct I/O (:func:`row_group_chunks`)."""
    rng = np.random.default_rng([seed, epoch, rank, num_ranks])
    where = {"rank": rank, "num_ranks": num_ranks, "seed": epoch_seed(seed, epoch)}
    if reader == "pyarrow":
        chunks = row_group_chunks(url, spec, direct=direct, **where)
    else:
        chunks = READERS[reader](url, spec, **where)
    left = steps * batch_size
    pending_x: list[Any] = []
    pending_y: list[Any] = []
    held = 0

    window: list[Any] = []  # the window's rows, in one buffer kept across windows

    def drain() -> Iterator[tuple[Any, Any]]:
        nonlocal pending_x, pending_y, held, left
        y = np.concatenate(pending_y)
        order = rng.permutation(len(y))
        usable = min(len(y) - len(y) % batch_size, left)
        taken, rest = order[:usable], order[usable:]
        if _row_by_row(pending_x):
            # Large rows (ImageNet-size images): each row copied once, from the row group
            # it was read in straight into the batch; the rows left over stay views.
            rows = [row for part in pending_x for row in part]
            batch = _gathered_rows(rows, taken) if usable else None
            pending_x = [[rows[i] for i in rest]] if len(rest) else []
        else:
            first = pending_x[0]
            if not window or len(window[0]) < len(y) or window[0].dtype != first.dtype:
                window[:] = [np.empty((len(y), *first.shape[1:]), first.dtype)]
            x = np.concatenate(pending_x, out=window[0][: len(y)])
            # One gather into memory TensorFlow can take without a copy (aligned).
            batch = _gathered(x, taken) if usable else None
            pending_x = [x[rest]]
        left -= usable
        pending_y = [y[rest]]
        held = len(y) - usable
        if batch is not None:
            yield batch, y[taken]

    try:
        for x, y in chunks:
            if record is not None:
                record.read(len(y), x.nbytes + y.nbytes, row_group=True)
            pending_x.append(x)
            pending_y.append(y)
            held += len(y)
            if held >= max(shuffle_buffer, batch_size):
                yield from drain()
            if left <= 0:
                return
        if held and left > 0:
            yield from drain()
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    if left > 0:
        raise RuntimeError(f"rank {rank} ran out of rows in epoch {epoch}: {left} short")


# TensorFlow wraps a numpy array's memory without copying it when it is aligned to this.
_ALIGNMENT = 64


# Rows at least this large are gathered one by one from the row groups they were read in:
# a row's copy then costs far more than the Python loop's step (a 150 KB ImageNet-size image:
# about 25 us against 1), and the window's concatenation, a second copy of every row, is
# skipped. Smaller rows (Fashion-MNIST's 784 bytes) are gathered in one numpy call.
_ROW_BY_ROW_BYTES = 16 * 1024


def _row_by_row(parts: list[Any]) -> bool:
    first = next((part for part in parts if len(part)), None)
    return first is not None and first[0].nbytes >= _ROW_BY_ROW_BYTES


def _aligned(rows: int, row_shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised (rows, *row_shape) array whose memory TensorFlow takes as it is."""
    nbytes = rows * int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(rows, *row_shape)


def _gathered(x: Any, order: Any) -> Any:
    """``x[order]``, written into a buffer aligned for TensorFlow."""
    out = _aligned(len(order), x.shape[1:], x.dtype)
    # mode="clip": with "raise" numpy gathers into a temporary and copies it (the indexes
    # are a permutation, always in range).
    np.take(x, order, axis=0, out=out, mode="clip")
    return out


def _gathered_rows(rows: list[Any], order: Any) -> Any:
    """``rows[i] for i in order`` stacked into a buffer aligned for TensorFlow, each row
    copied once."""
    out = _aligned(len(order), rows[0].shape, rows[0].dtype)
    for position, i in enumerate(order.tolist()):
        out[position] = rows[i]
    return out


@dataclass(frozen=True, kw_only=True)
class PartialEpoch:
    """The rest of an epoch a resumed run finishes first (training.checkpoints.plan_resume)."""

    skip: int = 0
    """Same rank count: the batches of the epoch each rank skips (already trained on)."""
    sources: list[tuple[int, int]] | None = None
    """Another rank count: (old rank, old step) of each batch this rank feeds, in order, from
    the plan of ``old_num_ranks`` ranks taking ``old_steps`` steps per epoch."""
    old_num_ranks: int = 0
    old_steps: int = 0


def skip_batches(
    chunks: Iterator[tuple[Any, Any]], batches: int, batch_size: int
) -> Iterator[tuple[Any, Any]]:
    """``chunks`` (of whole batches) without their first ``batches`` batches; what follows is
    unchanged, in the same order."""
    rows = batches * batch_size
    for x, y in chunks:
        if rows >= len(y):
            rows -= len(y)
            continue
        yield (x[rows:], y[rows:]) if rows else (x, y)
        rows = 0


# The most bytes of one chunk handed to tf.data: whole batches of small images by the
# hundred, of ImageNet-size ones a few at a time.
CHUNK_BYTES = 16 * 2**20


def bounded_chunks(
    chunks: Iterator[tuple[Any, Any]], batch_size: int, max_bytes: int
) -> Iterator[tuple[Any, Any]]:
    """Chunks of whole batches cut (as views) into chunks of at most ``max_bytes`` of inputs,
    or one batch where a batch is larger."""
    for x, y in chunks:
        row_bytes = x.nbytes // len(y) if len(y) else 1
        rows = max(1, max_bytes // (row_bytes * batch_size)) * batch_size
        if len(y) <= rows:
            yield x, y
            continue
        for start in range(0, len(y), rows):
            yield x[start : start + rows], y[start : start + rows]


def split_batches(chunks: Iterator[tuple[Any, Any]], batch_size: int) -> Iterator[tuple[Any, Any]]:
    """Chunks of whole batches as one batch at a time."""
    for x, y in chunks:
        for start in range(0, len(y), batch_size):
            yield x[start : start + batch_size], y[start : start + batch_size]


def regathered_batches(
    url: str | list[str],
    spec: InputSpec,
    *,
    sources: Sequence[tuple[int, int]],
    old_num_ranks: int,
    old_steps: int,
    seed: int,
    epoch: int,
    batch_size: int,
    shuffle_buffer: int,
    record: EpochInput | None = None,
) -> Iterator[tuple[Any, Any]]:
    """The batches ``sources`` names ((old rank, old step), steps increasing per old rank) of
    the plan of ``old_num_ranks`` ranks for ``epoch``, in that order: each old rank's stream is
    replayed (its deterministic order) up to the batches wanted."""
    streams: dict[int, Iterator[tuple[Any, Any]]] = {}
    positions: dict[int, int] = {}
    try:
        for old_rank, old_step in sources:
            if old_rank not in streams:
                streams[old_rank] = split_batches(
                    epoch_batches(
                        url,
                        spec,
                        rank=old_rank,
                        num_ranks=old_num_ranks,
                        seed=seed,
                        epoch=epoch,
                        batch_size=batch_size,
                        steps=old_steps,
                        shuffle_buffer=shuffle_buffer,
                        record=record,
                    ),
                    batch_size,
                )
                positions[old_rank] = 0
            while True:
                batch = next(streams[old_rank])
                positions[old_rank] += 1
                if positions[old_rank] > old_step:
                    yield batch
                    break
    finally:
        for stream in streams.values():
            stream.close()  # type: ignore[attr-defined]


def row_ids(inputs: Any, labels: Any) -> list[str]:
    """A short digest of each row (its input bytes and label): which rows a batch held."""
    import hashlib

    return [
        hashlib.blake2b(
            np.ascontiguousarray(x).tobytes() + bytes([int(y) % 256]), digest_size=6
        ).hexdigest()
        for x, y in zip(inputs, labels, strict=True)
    ]


def make_train_dataset(
    url: str | list[str],
    spec: InputSpec,
    *,
    rank: int,
    num_ranks: int,
    batch_size: int,
    steps_per_epoch: int,
    seed: int,
    shuffle_buffer: int,
    first_epoch: int = 0,
    epochs: int | None = None,
    meter: InputMeter | None = None,
    test_delay: float = 0.0,
    partial: PartialEpoch | None = None,
    record_rows: Path | None = None,
) -> Any:
    """tf.data.Dataset of (inputs, labels) batches: epoch ``first_epoch`` onwards (forever when
    ``epochs`` is None), ``steps_per_epoch`` batches each, prefetched; with ``partial``, the
    first of them is only the rest of that epoch (a mid-epoch resume). With ``meter``, each
    epoch's input is timed and counted there; ``test_delay`` (seconds per batch, tests only:
    :data:`training.input_metrics.INPUT_DELAY_ENV`) slows this metered input on purpose;
    ``record_rows`` (tests only) gets a JSON line per batch: epoch, step, :func:`row_ids`."""
    import itertools

    import tensorflow as tf

    def epoch_input(epoch: int, record: EpochInput | None) -> tuple[int, Iterator[Any]]:
        """(the epoch's first step, its chunks)."""
        if partial is not None and epoch == first_epoch and partial.sources is not None:
            chunks = regathered_batches(
                url,
                spec,
                sources=partial.sources,
                old_num_ranks=partial.old_num_ranks,
                old_steps=partial.old_steps,
                seed=seed,
                epoch=epoch,
                batch_size=batch_size,
                shuffle_buffer=shuffle_buffer,
                record=record,
            )
            return 0, chunks
        chunks = epoch_batches(
            url,
            spec,
            rank=rank,
            num_ranks=num_ranks,
            seed=seed,
            epoch=epoch,
            batch_size=batch_size,
            steps=steps_per_epoch,
            shuffle_buffer=shuffle_buffer,
            record=record,
        )
        if partial is not None and epoch == first_epoch and partial.skip:
            # The epoch's order is replayed and its first batches dropped, not re-planned:
            # what follows is exactly what the uninterrupted run fed.
            return partial.skip, skip_batches(chunks, partial.skip, batch_size)
        return 0, chunks

    def generate() -> Iterator[tuple[Any, Any]]:
        last = itertools.count(first_epoch) if epochs is None else range(first_epoch, epochs)
        for epoch in last:
            record = meter.epoch(epoch) if meter is not None else None
            first_step, chunks = epoch_input(epoch, record)
            if record is not None:
                from training.input_metrics import metered

                chunks = metered(chunks, record, batch_size=batch_size, delay=test_delay)
            if record_rows is None:
                yield from bounded_chunks(chunks, batch_size, CHUNK_BYTES)
                continue
            step = first_step
            with record_rows.open("a") as log:
                for x, y in split_batches(chunks, batch_size):
                    ids = row_ids(x, y)
                    log.write(json.dumps({"epoch": epoch, "step": step, "rows": ids}) + "\n")
                    log.flush()
                    step += 1
                    yield x, y

    signature = (
        tf.TensorSpec(shape=(None, *spec.input_shape), dtype=tf.as_dtype(spec.stream_dtype)),
        tf.TensorSpec(shape=(None,), dtype=tf.int64),
    )

    def as_batches(x: Any, y: Any) -> Any:
        # A chunk of k whole batches seen as k batches (a reshape, no copy), each sliced once,
        # not row by row and batched again; pixels stay uint8 (the model scales them).
        return tf.data.Dataset.from_tensor_slices(
            (
                tf.reshape(x, (-1, batch_size, *spec.input_shape)),
                tf.reshape(y, (-1, batch_size)),
            )
        )

    # The generator hands over chunks of whole batches (one Python call per few thousand rows,
    # not per batch); tf.data cuts them into batches and prefetches.
    return without_autotuning(
        tf.data.Dataset.from_generator(generate, output_signature=signature)
        .flat_map(as_batches)
        .prefetch(tf.data.AUTOTUNE)
    )


def without_autotuning(dataset: Any) -> Any:
    """``dataset`` without tf.data's autotuning thread.

    With TensorFlow 2.15, deleting an iterator (Keras does it when ``fit``, ``evaluate`` or
    ``predict`` returns) now and then waits for that thread to sleep out its optimisation
    period, which doubles up to 60 s over a long run: ``fit`` returned up to 54 s after its last
    epoch on one rank or the other (docs/training.md, "Evaluation"). Without it, ``prefetch``
    still grows its buffer as the consumer waits (its legacy autotuner), and epochs take as long.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def in_batches(arrays: Any, batch_size: int) -> Any:
    """In-memory arrays (a tuple for (inputs, labels)) as a tf.data.Dataset of batches in row
    order, for ``evaluate`` and ``predict``: the batches Keras cuts from arrays itself, without
    the autotuning thread it would start."""
    import tensorflow as tf

    return without_autotuning(tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size))


def as_url(location: str | Path | list[str]) -> str | list[str]:
    """A split as the URL(s) petastorm opens: ``file://`` for a local folder, the URL itself
    under an object-store catalog (``s3://...``: petastorm's resolver opens it with s3fs,
    which takes its credentials and endpoint from the environment horovodrun forwards); a list
    of files' URLs stays as it is."""
    if isinstance(location, list):
        return location
    text = str(location)
    if "://" in text:
        return text
    # Not Path.as_uri(): it percent-encodes "=" (split=train -> split%3Dtrain), and petastorm
    # opens a file:// URL's path as it is spelled, without unquoting it.
    return f"file://{Path(text).resolve()}"


def load_split(directory: str | Path | list[str], spec: InputSpec) -> tuple[Any, Any]:
    """A whole (evaluation) split in memory: (inputs as models take them, uint8 pixels or
    float32 features; int64 labels); ``directory`` is a local folder, a URL (s3://...), or the
    URLs of the split's files."""
    if spec.format == "petastorm":
        # The order petastorm's reader of seed 1 gave (training.row_groups reads it).
        parts = list(row_group_chunks(as_url(directory), spec, rank=0, num_ranks=1, seed=1))
        inputs = np.concatenate([p[0] for p in parts])
        return inputs, np.concatenate([p[1] for p in parts])
    if isinstance(directory, list) or "://" in str(directory):
        import fsspec

        urls = directory if isinstance(directory, list) else [str(directory)]
        filesystem, _ = fsspec.core.url_to_fs(urls[0])
        paths: Any = [fsspec.core.url_to_fs(u)[1] for u in urls]
        if not isinstance(directory, list):
            paths = paths[0]
        table = pq.read_table(paths, columns=spec.columns, filesystem=filesystem)
    else:
        table = pq.read_table(directory, columns=spec.columns)

    class Columns:
        def __getattr__(self, name: str) -> Any:
            column = table.column(name)
            return column.to_pylist() if name == "image" else column.to_numpy()

    inputs, labels = spec.arrays(Columns())
    return inputs, labels


def describe_orders(
    num_row_groups: int, num_ranks: int, seed: int, epochs: Sequence[int]
) -> dict[str, dict[str, list[int]]]:
    """{epoch: {rank: row groups in reading order}} for the lineage."""
    return {
        str(epoch + 1): {
            str(rank): row_group_order(num_row_groups, rank, num_ranks, epoch_seed(seed, epoch))
            for rank in range(num_ranks)
        }
        for epoch in epochs
    }
