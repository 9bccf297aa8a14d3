"""Arrow schemas of the processed datasets: defined once, used by the writer and the reader."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
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


def image_unischema(image_shape: Sequence[int]) -> Any:
    """The Petastorm schema of an image split: the same columns as :data:`IMAGE_SCHEMA`, with
    the pixels an ndarray (rows, cols, channels) stored by petastorm's NdarrayCodec."""
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.unischema import Unischema, UnischemaField
    from pyspark.sql.types import LongType

    return Unischema(
        "ImageSchema",
        [
            UnischemaField("index", np.int64, (), ScalarCodec(LongType()), False),
            UnischemaField("image", np.uint8, tuple(image_shape), NdarrayCodec(), False),
            UnischemaField("label", np.int64, (), ScalarCodec(LongType()), False),
        ],
    )


@functools.cache
def _image_field(image_shape: tuple[int, ...]) -> Any:
    return image_unischema(image_shape).image


def encode_image(image_shape: Sequence[int], pixels: npt.NDArray[np.uint8]) -> bytes:
    """One image's bytes in the Petastorm column, encoded by the schema's own codec."""
    shape = tuple(image_shape)
    field = _image_field(shape)
    return bytes(field.codec.encode(field, pixels.reshape(shape)))


# SDSS: star/galaxy/QSO features. Colours are differences of adjacent bands' magnitudes.
SDSS_CLASSES = ("STAR", "GALAXY", "QSO")
_BANDS = ("u", "g", "r", "i", "z")
# The photometric features every SDSS source gives; the Petrosian ones only sources that
# carry petroMag_* and petroRad_* (the seed query's), not the DR14 sample of shared/data.
SDSS_PHOTOMETRY = (*_BANDS, "u_g", "g_r", "r_i", "i_z")
SDSS_PETROSIAN = (*(f"petroMag_{b}" for b in _BANDS), *(f"petroRad_{b}" for b in _BANDS))
SDSS_FEATURES = (*SDSS_PHOTOMETRY, *SDSS_PETROSIAN)


def sdss_schema(stored: tuple[str, ...] = SDSS_FEATURES) -> pa.Schema:
    """A processed SDSS file: the ``stored`` features (float32), then label, redshift, ids."""
    return pa.schema(
        [
            *(pa.field(name, pa.float32(), nullable=False) for name in stored),
            pa.field("label", pa.int64(), nullable=False),  # index into SDSS_CLASSES
            pa.field("redshift", pa.float64(), nullable=False),
            pa.field("objid", pa.uint64(), nullable=False),
            pa.field("specobjid", pa.uint64(), nullable=False),
        ]
    )


SDSS_SCHEMA = sdss_schema()
