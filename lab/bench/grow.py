"""A training split grown for ``shardflow bench storage``: as many rows as a cold-cache run
needs (five times the memory limit), made from a processed version's real training images,
optionally at another size (224x224x3: ImageNet-size samples), in the processed layout the
ranks read (Parquet, an ``image`` binary column and a ``label``, equal row groups, in the
encodings the processed writer uses: ``preprocessing.shard_files.encodings``).

Every row group is a seeded transform of real images, never an unchanged copy: resized
(bilinear) when asked, shifted by up to 2 pixels (16 at 224), mirrored where the source is
colour (CIFAR-10's classes allow it). The folder holds _GROWN.json, saying so; a folder that
already holds the same request is reused (a 10 GB split is written once for several runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from preprocessing.shard_files import encodings
from training.input import InputSpec, as_url, row_group_chunks

# Underscored: readers (petastorm, training.row_groups) take it for metadata, not data.
MARKER = "_GROWN.json"
GROUPS_PER_FILE = 16


def _resize_matrix(source: int, target: int) -> np.ndarray[Any, Any]:
    """(target, source) bilinear interpolation weights."""
    centres = (np.arange(target) + 0.5) * source / target - 0.5
    low = np.clip(np.floor(centres).astype(int), 0, source - 1)
    high = np.clip(low + 1, 0, source - 1)
    weight = np.clip(centres - low, 0.0, 1.0)
    matrix = np.zeros((target, source), np.float32)
    matrix[np.arange(target), low] += 1 - weight
    matrix[np.arange(target), high] += weight
    return matrix


def resized(images: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
    """(n, h, w, c) uint8 images as (n, size, size, 3), bilinear; grey ones in three channels."""
    rows = _resize_matrix(images.shape[1], size)
    cols = _resize_matrix(images.shape[2], size)
    out = np.einsum("yh,nhwc,xw->nyxc", rows, images.astype(np.float32), cols, optimize=True)
    out = np.clip(np.rint(out), 0, 255).astype(np.uint8)
    return np.repeat(out, 3, axis=3) if out.shape[3] == 1 else out


def _shifted(block: np.ndarray[Any, Any], dy: int, dx: int) -> np.ndarray[Any, Any]:
    out = np.zeros_like(block)
    h, w = block.shape[1:3]
    out[:, max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = block[
        :, max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


def _request(source: str, rows: int, rows_per_group: int, shape: tuple[int, ...]) -> dict[str, Any]:
    return {
        "synthetic": True,
        "source": source,
        "rows": rows,
        "rows_per_group": rows_per_group,
        "image_shape": list(shape),
        # The processed writer's encodings (images plain since images writer 3, not
        # compressed since 4): a folder grown before them is grown again.
        "encodings": "shard_files, images writer 4",
    }


def grow_split(
    source: str | Path,
    spec: InputSpec,
    out: Path,
    *,
    rows: int,
    rows_per_group: int,
    image_size: int | None = None,
    seed: int = 0,
) -> tuple[str, InputSpec]:
    """Write ``rows`` rows (whole row groups of ``rows_per_group``) grown from the real
    images of the training split at ``source`` into ``out``; returns (its URL, its spec)."""
    if spec.kind != "images":
        raise ValueError("only image sets grow (their rows are images)")
    shape = (image_size, image_size, 3) if image_size else tuple(spec.image_shape)
    groups = max(1, rows // rows_per_group)
    request = _request(str(source), groups * rows_per_group, rows_per_group, shape)
    grown_spec = InputSpec(kind="images", format="parquet", image_shape=list(shape))
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == request:
        return as_url(out), grown_spec  # type: ignore[return-value]
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.parquet"):
        stale.unlink()
    marker.unlink(missing_ok=True)
    chunks = list(row_group_chunks(as_url(source), spec, rank=0, num_ranks=1, seed=1))
    images = np.concatenate([x for x, _y in chunks])[: max(256, rows_per_group) * 4]
    labels = np.concatenate([y for _x, y in chunks])[: len(images)]
    if image_size:
        images = resized(images, image_size)
    rng = np.random.default_rng(seed)
    reach = max(2, shape[0] // 14)
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64())])
    writer: pq.ParquetWriter | None = None
    for group in range(groups):
        if group % GROUPS_PER_FILE == 0:
            if writer is not None:
                writer.close()
            writer = pq.ParquetWriter(
                out / f"part-{group // GROUPS_PER_FILE:05d}.parquet", schema, **encodings(schema)
            )
        picks = rng.integers(0, len(images), rows_per_group)
        dy, dx = 0, 0
        while not (dy or dx):
            dy, dx = (int(v) for v in rng.integers(-reach, reach + 1, 2))
        block = _shifted(images[picks], dy, dx)
        if shape[2] == 3 and rng.integers(0, 2):
            block = block[:, :, ::-1]
        flat = np.ascontiguousarray(block).reshape(rows_per_group, -1)
        row_bytes = flat.shape[1]
        offsets = pa.array(np.arange(rows_per_group + 1, dtype=np.int32) * row_bytes)
        column = pa.BinaryArray.from_buffers(
            pa.binary(), rows_per_group, [None, offsets.buffers()[1], pa.py_buffer(flat)]
        )
        table = pa.table([column, pa.array(labels[picks], pa.int64())], schema=schema)
        assert writer is not None
        writer.write_table(table, row_group_size=rows_per_group)
    if writer is not None:
        writer.close()
    marker.write_text(json.dumps(request, indent=2))
    return as_url(out), grown_spec  # type: ignore[return-value]
