"""What the launcher hands every rank: :class:`WorkerConfig`, as ``worker.json`` in the run
directory (the launcher writes it, ``python -m training.worker`` reads it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from training.config import LaunchConfig, TrainConfig


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything a rank needs: the user's :class:`TrainConfig` and :class:`LaunchConfig`,
    and what the launcher derived from the processed version."""

    train: TrainConfig
    """What to compute, as the user chose it; ``train.model`` is resolved (not None)."""
    launch: LaunchConfig
    """Where and how the ranks run: threads, checkpoints, resume, the interfaces."""
    train_url: str
    """file:// URL of the training split, which petastorm streams."""
    test_dir: str
    """The test split, evaluated on rank 0 after training."""
    run_dir: str
    """Checkpoints, TensorBoard logs, model.keras, metrics.json and curves.png go here."""
    spec: dict[str, Any]
    """The processed version's :class:`training.input.InputSpec`, as a dict."""
    num_classes: int
    steps_per_epoch: int
    """Batches every rank takes per epoch, planned from the catalog's row counts."""
    evaluate: bool = True
    """Evaluate on the test split and save the model (benchmarks skip both)."""
    mean: list[float] | None = None
    """Normalisation statistics of the training split (the model's first layer)."""
    std: list[float] | None = None
    validation_dir: str | None = None
    """Evaluated after every epoch when the processed version has a validation split."""
    files: dict[str, list[str]] | None = None
    """Where the ranks read each split when the catalog keeps no folder of it (an object
    store, whose versions reference content-addressed objects): the URLs of the split's files,
    in path order, by split. None: the folders above."""

    def source(self, split: str) -> str | list[str]:
        """What the ranks open for ``split``: its files' URLs, or its folder."""
        if self.files is not None and split in self.files:
            return self.files[split]
        folder = {"train": self.train_url, "test": self.test_dir}.get(split)
        if folder is None:
            folder = self.validation_dir
        if folder is None:
            raise ValueError(f"no {split} split in this run's worker config")
        return folder

    def __post_init__(self) -> None:
        if self.train.model is None:
            raise ValueError("WorkerConfig.train.model is None: resolve the model first")

    @classmethod
    def load(cls, path: str | Path) -> WorkerConfig:
        values = json.loads(Path(path).read_text())
        train = values.pop("train")
        launch = values.pop("launch", None)
        if launch is None:
            # Written before LaunchConfig (4d1aaa5 and earlier): the launch fields inside
            # "train". The launcher reads such a file when it looks for a run of the same
            # configuration on another rank count (its threads_per_rank was the benchmark's).
            values.pop("threads_per_rank", None)
            launch = {f.name: train.pop(f.name) for f in fields(LaunchConfig) if f.name in train}
        return cls(**values, train=TrainConfig(**train), launch=LaunchConfig(**launch))

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))
