"""The 20 real CIFAR-10 test images inside foolbox's wheel as a pool for ``shardflow synth
cifar10``: all of them in ``test_batch.bin``, and all of them again across the five training
batches (4 each).

foolbox 3.3.4's wheel ── foolbox/data/cifar10_NN_L.png (the first 20 test images, L = label)
    ▼
OUT/test_batch.bin (the 20) + data_batch_1..5.bin (the same 20, 4 each) + batches.meta.txt

So ``synth cifar10``, which draws training images from the pool's training batches and test
images from its test batch, draws both from the same 20 pictures (with different seeded shifts
and flips): what a model learns of a picture can be tested. A pool that split them, 10 for
training and 10 for test, made the hybrid-parallel report's test accuracy chance: 3 of the 6
test classes had no training image, and no test picture was ever trained on.

    python -m lab.cifar10_pool .cache/wheels/foolbox-3.3.4-py3-none-any.whl .cache/cifar10-pool
"""

from __future__ import annotations

import argparse
import io
import zipfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from data_catalog.errors import ShardflowError
from preprocessing.sources.cifar10 import CLASS_NAMES

__all__ = ["read_foolbox_cifar10", "write_pool"]

NUM_IMAGES = 20


def read_foolbox_cifar10(wheel: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(images [20, 32, 32, 3] uint8, labels [20]) from foolbox's wheel, in file-name order."""
    from PIL import Image

    try:
        with zipfile.ZipFile(wheel) as archive:
            names = sorted(n for n in archive.namelist() if "/cifar10_" in n and n.endswith(".png"))
            images = [
                np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB"), np.uint8)
                for n in names
            ]
    except (OSError, zipfile.BadZipFile) as exc:
        raise ShardflowError(f"{wheel}: not foolbox's wheel: {exc}") from exc
    if len(images) != NUM_IMAGES or any(i.shape != (32, 32, 3) for i in images):
        raise ShardflowError(f"{wheel}: expected {NUM_IMAGES} CIFAR-10 PNGs of 32 x 32 RGB")
    labels = np.array([int(n.rsplit("_", 1)[1].split(".")[0]) for n in names], dtype=np.uint8)
    return np.stack(images), labels


def write_pool(wheel: Path, out: Path) -> Path:
    """The pool folder ``out`` (CIFAR-10 binary batches), from foolbox's wheel."""
    images, labels = read_foolbox_cifar10(wheel)
    out.mkdir(parents=True, exist_ok=True)
    planes = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    records = np.concatenate([labels[:, None], planes], axis=1).astype(np.uint8)
    for number, part in enumerate(np.array_split(records, 5), start=1):
        (out / f"data_batch_{number}.bin").write_bytes(part.tobytes())
    (out / "test_batch.bin").write_bytes(records.tobytes())
    (out / "batches.meta.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("wheel", type=Path, help="foolbox-3.3.4-py3-none-any.whl")
    parser.add_argument("out", type=Path, help="the pool folder to write")
    args = parser.parse_args()
    try:
        print(write_pool(args.wheel, args.out))
    except ShardflowError as exc:
        raise SystemExit(f"shardflow: {exc}") from None


if __name__ == "__main__":
    main()
