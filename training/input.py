"""Per-rank input: each rank streams its own row groups of a Parquet split into tf.data.

Ranks are plain integers here; only the worker entry point asks Horovod for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq


@dataclass(frozen=True, kw_only=True)
class SplitLayout:
    """What the catalog says of a training split: equal row groups, counted."""

    rows_per_group: int
    num_row_groups: int

    def rows_of_rank(self, rank: int, num_ranks: int) -> int:
        # petastorm gives row group i to shard i % shard_count.
        return len(range(rank, self.num_row_groups, num_ranks)) * self.rows_per_group

    def steps_per_epoch(self, num_ranks: int, batch_size: int) -> int:
        """Steps every rank can take in one epoch: set by the rank with the fewest rows, so
        that no rank waits in an allreduce for a peer that ran out of data."""
        if self.num_row_groups < num_ranks:
            raise ValueError(
                f"{self.num_row_groups} row groups cannot feed {num_ranks} ranks; "
                "preprocess with smaller row groups or train on fewer ranks"
            )
        fewest = min(self.rows_of_rank(r, num_ranks) for r in range(num_ranks))
        steps = fewest // batch_size
        if steps == 0:
            raise ValueError(
                f"a rank holds {fewest} rows, fewer than one batch of {batch_size}; "
                "lower --batch-size"
            )
        return steps


def decode_images(image_shape: Sequence[int]) -> Any:
    import tensorflow as tf

    shape = [-1, *image_shape, 1] if len(image_shape) == 2 else [-1, *image_shape]

    def decode(batch: Any) -> tuple[Any, Any]:
        pixels = tf.io.decode_raw(batch.image, tf.uint8)
        images = tf.cast(tf.reshape(pixels, shape), tf.float32) / 255.0
        return images, batch.label

    return decode


def make_train_dataset(
    url: str,
    *,
    rank: int,
    num_ranks: int,
    batch_size: int,
    image_shape: Sequence[int],
    seed: int,
    shuffle_buffer: int,
) -> tuple[Any, Any]:
    """(petastorm reader, tf.data.Dataset of (images, labels) batches), repeating forever.

    The caller takes ``steps_per_epoch`` batches per epoch and must stop the reader.
    """
    import tensorflow as tf
    from petastorm import make_batch_reader
    from petastorm.tf_utils import make_petastorm_dataset

    reader = make_batch_reader(
        url,
        schema_fields=["image", "label"],
        cur_shard=rank,
        shard_count=num_ranks,
        num_epochs=None,
        shuffle_row_groups=True,
        seed=seed,
        reader_pool_type="thread",
        workers_count=2,
    )
    dataset = (
        make_petastorm_dataset(reader)
        .map(decode_images(image_shape), num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        .shuffle(shuffle_buffer, seed=seed + rank)
        .batch(batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    return reader, dataset


def load_split(directory: str | Path, image_shape: Sequence[int]) -> tuple[Any, Any]:
    """A whole (evaluation) split in memory: (float32 images, int64 labels)."""
    table = pq.read_table(directory, columns=["image", "label"])
    pixels = np.frombuffer(b"".join(table.column("image").to_pylist()), dtype=np.uint8)
    images = pixels.reshape(table.num_rows, *image_shape, 1).astype(np.float32) / 255.0
    labels = table.column("label").to_numpy()
    return images, labels
