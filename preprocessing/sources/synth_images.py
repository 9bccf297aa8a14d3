"""Synthetic image sets made from a real pool, for scale tests and benchmarks.

Every image is a seeded, cheap transform of a real one: a shift of up to 2 pixels, and a
horizontal mirror where the dataset allows it (clothes yes, digits never). No output image is
a byte-identical copy of its source, so compression and storage figures stay honest. Classes
keep the pool's balance. The output folder holds the four IDX files and SYNTHETIC.json, which
ingest records as the version's provenance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt

from data_catalog.errors import ShardflowError
from preprocessing.sources import idx
from preprocessing.sources.mnist import FILE_STEMS, image_set

MARKER = "SYNTHETIC.json"
MAX_SHIFT = 2


def _transform(
    rng: np.random.Generator, image: npt.NDArray[np.uint8], *, flips: bool
) -> npt.NDArray[np.uint8]:
    while True:
        dy, dx = (int(v) for v in rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=2))
        flip = flips and bool(rng.integers(0, 2))
        if dy or dx or flip:
            break  # never an unchanged copy
    out = image[:, ::-1] if flip else image
    shifted = np.zeros_like(out)
    rows, cols = out.shape
    shifted[max(dy, 0) : rows + min(dy, 0), max(dx, 0) : cols + min(dx, 0)] = out[
        max(-dy, 0) : rows + min(-dy, 0), max(-dx, 0) : cols + min(-dx, 0)
    ]
    return shifted


def _split(
    rng: np.random.Generator,
    images: npt.NDArray[np.uint8],
    labels: npt.NDArray[np.uint8],
    rows: int,
    *,
    flips: bool,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    # Sources drawn uniformly from the pool keep its class balance.
    picks = rng.integers(0, len(labels), size=rows)
    out = np.empty((rows, *images.shape[1:]), dtype=np.uint8)
    for i, pick in enumerate(picks):
        out[i] = _transform(rng, images[pick], flips=flips)
    return out, labels[picks].astype(np.uint8)


def write_image_set(
    dataset: str, pool: Path, dest: Path, *, train_rows: int, test_rows: int, seed: int = 0
) -> list[Path]:
    """Write ``train_rows`` + ``test_rows`` synthetic images of ``dataset`` into ``dest``,
    drawn from the real IDX files in ``pool`` (train images from the pool's training split,
    test images from its test split, so the two never share a source)."""
    spec = image_set(dataset)
    if train_rows < 1 or test_rows < 1:
        raise ShardflowError("--rows and --test-rows must be at least 1")
    files = {}
    for stem in FILE_STEMS:
        found = [p for p in (pool / f"{stem}.gz", pool / stem) if p.exists()]
        if not found:
            raise ShardflowError(f"{pool} lacks {stem} (raw or .gz): not a pool of real images")
        files[stem] = found[0]
    rng = np.random.default_rng(seed)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for split, rows in (("train", train_rows), ("t10k", test_rows)):
        pair = idx.check_pair(
            files[f"{split}-images-idx3-ubyte"],
            files[f"{split}-labels-idx1-ubyte"],
            num_classes=spec.num_classes,
        )
        images = idx.read_records(pair.images)
        labels = idx.read_records(pair.labels)
        out_images, out_labels = _split(rng, images, labels, rows, flips=spec.flips_allowed)
        for stem, array in (
            (f"{split}-images-idx3-ubyte", out_images),
            (f"{split}-labels-idx1-ubyte", out_labels),
        ):
            path = dest / f"{stem}.gz"
            idx.write(path, array, compress=True)
            written.append(path)
    marker = dest / MARKER
    marker.write_text(
        json.dumps(
            {
                "synthetic": True,
                "dataset": dataset,
                "pool": str(pool.resolve()),
                "seed": seed,
                "transforms": f"shift up to {MAX_SHIFT} px"
                + (", horizontal flip" if spec.flips_allowed else ""),
            },
            indent=2,
        )
    )
    return [*written, marker]
