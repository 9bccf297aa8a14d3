"""Synthetic image sets made from a real pool, for scale tests and benchmarks.

Every image is a seeded, cheap transform of a real one: a shift of up to 2 pixels, and a
horizontal mirror where the dataset allows it (clothes yes, digits never). No output image is
a byte-identical copy of its source, so compression and storage figures stay honest. Classes
keep the pool's balance. The output folder holds the four IDX files and SYNTHETIC.json, which
ingest records as the version's provenance.
"""

from __future__ import annotations

import itertools
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
    out = image[:, ::-1] if flip else image  # mirrors columns, for 2-D and HWC images alike
    shifted = np.zeros_like(out)
    rows, cols = out.shape[:2]
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


def write_cifar10_set(
    pool: str, dest: Path, *, train_rows: int, test_rows: int, seed: int = 0
) -> list[Path]:
    """CIFAR-10 binary batches (data_batch_1..5.bin, test_batch.bin) of synthetic images made
    from the real images in ``pool`` (anything `shardflow ingest cifar10` reads)."""
    from preprocessing.sources.cifar10 import CLASS_NAMES, read_cifar10

    if train_rows < 5 or test_rows < 1:
        raise ShardflowError("cifar10 needs --rows of at least 5 (five training batches)")
    real = read_cifar10(pool)
    # A pool may hold test images only (the 20 real ones at hand): then both splits draw on it.
    train_pool = real["train"] if len(real["train"][1]) else real["test"]
    rng = np.random.default_rng(seed)
    dest.mkdir(parents=True, exist_ok=True)
    train_images, train_labels = _split(rng, *train_pool, train_rows, flips=True)
    test_images, test_labels = _split(rng, *real["test"], test_rows, flips=True)
    written = []
    bounds = np.linspace(0, train_rows, 6).astype(int)
    batches = [
        (f"data_batch_{i + 1}.bin", train_images[a:b], train_labels[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    batches.append(("test_batch.bin", test_images, test_labels))
    for name, images, labels in batches:
        records = np.concatenate(
            [labels.reshape(-1, 1), images.transpose(0, 3, 1, 2).reshape(len(labels), -1)], axis=1
        ).astype(np.uint8)
        path = dest / name
        path.write_bytes(records.tobytes())  # 1 label byte + 3,072 channel-major pixels each
        written.append(path)
    meta = dest / "batches.meta.txt"
    meta.write_text("\n".join(CLASS_NAMES) + "\n")
    marker = dest / MARKER
    marker.write_text(
        json.dumps(
            {
                "synthetic": True,
                "dataset": "cifar10",
                "pool": pool,
                "seed": seed,
                "transforms": "shift up to 2 px, flip",
            },
            indent=2,
        )
    )
    return [*written, meta, marker]
