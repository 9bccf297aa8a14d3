"""Arrow schemas of the processed datasets: defined once, used by the writer and the reader."""

from __future__ import annotations

import pyarrow as pa

# One row per image. The pixels are raw bytes (rows * cols * channels uint8, row-major):
# petastorm's batch reader drops Arrow fixed_size_list columns from its inferred schema, while
# a binary column reaches tf.data intact as a tf.string to decode.
IMAGE_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64(), nullable=False),  # record number in the raw split
        pa.field("image", pa.binary(), nullable=False),
        pa.field("label", pa.int64(), nullable=False),
    ]
)

IMAGE_COLUMNS = tuple(IMAGE_SCHEMA.names)
