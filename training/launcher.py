"""Train on a processed dataset with ``horovodrun`` and commit the model to the catalog.

processed version (train/ and test/ Parquet, equal row groups)
    │  steps per epoch planned from the catalog's row counts
    ▼
horovodrun -np N -H localhost:N --gloo python -m training.worker run/worker.json
    │  rank r streams row groups r, r+N, ...; rank 0 writes model + metrics.json
    ▼
model version "<dataset>-<model>" (parent: the processed version)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest, code_version, version_id
from data_catalog.errors import ShardflowError
from training import models
from training.input import SplitLayout
from training.worker import WorkerConfig

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train; every field is part of the model version's identity except ``hosts``."""

    num_ranks: int = 2
    epochs: int = 3
    batch_size: int = 32
    """Per rank; the global batch is batch_size * num_ranks."""
    model: str = "cnn"
    learning_rate: float = 0.001
    """For one rank; scaled by the number of ranks."""
    warmup_epochs: int = 1
    seed: int = 0
    shuffle_buffer: int = 4096
    hosts: str | None = None
    """horovodrun -H value (host:slots,...); default localhost:num_ranks."""

    def __post_init__(self) -> None:
        checks = {
            "--np": self.num_ranks,
            "--epochs": self.epochs,
            "--batch-size": self.batch_size,
        }
        for flag, value in checks.items():
            if value < 1:
                raise ShardflowError(f"{flag} must be at least 1, got {value}")
        if self.model not in models.MODELS:
            raise ShardflowError(f"unknown model {self.model!r}; known: {', '.join(models.MODELS)}")
        if self.learning_rate <= 0:
            raise ShardflowError(f"--lr must be positive, got {self.learning_rate}")


def model_name(dataset: str, model: str) -> str:
    return f"{dataset}-{model}"


def horovodrun() -> str:
    """The horovodrun of this environment (beside its python), else the one on PATH."""
    local = Path(sys.executable).parent / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if found is None:
        raise ShardflowError("horovodrun not found: install Horovod (make setup)")
    return found


def _split_dir(catalog: Catalog, manifest: Manifest, split: str) -> Path:
    return catalog.version_dir(manifest.name, manifest.version) / split


def train(
    catalog: Catalog,
    dataset: str,
    *,
    config: TrainConfig,
    runs_dir: Path,
    progress: Progress = lambda _msg: None,
) -> tuple[Manifest, dict[str, Any]]:
    """Train on the latest processed version of ``dataset``; returns (model version, metrics).

    The same processed version, configuration and code give the same model version: a rerun
    returns the committed one without training again.
    """
    from preprocessing.images import processed_name

    processed = catalog.get(processed_name(dataset))
    train_stats = processed.statistics["train"]
    layout = SplitLayout(
        rows_per_group=int(train_stats["rows_per_group"]),
        num_row_groups=int(train_stats["num_row_groups"]),
    )
    try:
        steps = layout.steps_per_epoch(config.num_ranks, config.batch_size)
    except ValueError as exc:
        raise ShardflowError(str(exc)) from exc
    name = model_name(dataset, config.model)
    parameters = {k: v for k, v in asdict(config).items() if k != "hosts"}
    parents = [processed.ref]
    version = version_id(
        name=name,
        kind="model",
        parents=parents,
        sources=(),
        parameters=parameters,
        code_version=code_version(),
    )
    if catalog.exists(name, version):
        progress(f"{name}@{version} already in the catalog; not training again")
        manifest = catalog.get(name, version)
        return manifest, dict(manifest.statistics)

    run_dir = runs_dir / f"{name}-{version}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    worker_config = WorkerConfig(
        train_url=_split_dir(catalog, processed, "train").resolve().as_uri(),
        test_dir=str(_split_dir(catalog, processed, "test")),
        run_dir=str(run_dir),
        image_shape=list(processed.schema["image_shape"]),
        num_classes=int(processed.schema["num_classes"]),
        model=config.model,
        epochs=config.epochs,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        seed=config.seed,
        steps_per_epoch=steps,
        shuffle_buffer=config.shuffle_buffer,
        warmup_epochs=min(config.warmup_epochs, config.epochs),
    )
    worker_config.dump(run_dir / "worker.json")
    progress(
        f"train: {config.num_ranks} ranks x {steps} steps x {config.batch_size} per batch, "
        f"{config.epochs} epochs, on {processed.name}@{processed.version}"
    )
    _launch(config, run_dir / "worker.json", progress)
    metrics = json.loads((run_dir / "metrics.json").read_text())

    with catalog.stage(name, kind="model") as stage:
        shutil.copy2(run_dir / "model.keras", stage.path / "model.keras")
        shutil.copy2(run_dir / "metrics.json", stage.path / "metrics.json")
        manifest = stage.commit(
            parents=parents,
            parameters=parameters,
            schema={
                "format": "keras",
                "model": config.model,
                "input_shape": worker_config.image_shape,
                "num_classes": worker_config.num_classes,
            },
            statistics=metrics,
            rows=layout.rows_of_rank(0, 1),
            extra={"run_dir": str(run_dir)},
        )
    return manifest, metrics


def _launch(config: TrainConfig, worker_json: Path, progress: Progress) -> None:
    hosts = config.hosts or f"localhost:{config.num_ranks}"
    command = [
        horovodrun(),
        "-np",
        str(config.num_ranks),
        "-H",
        hosts,
        "--gloo",
        sys.executable,
        "-m",
        "training.worker",
        str(worker_json),
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    progress("$ " + " ".join(command))
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            progress(line)
        returncode = proc.wait()
    if returncode != 0:
        last = next((t for t in reversed(tail) if "Error" in t), tail[-1] if tail else "")
        raise ShardflowError(f"horovodrun exited with {returncode}: {last.strip()}")
