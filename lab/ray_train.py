"""The model of ``shardflow train`` trained with Ray Train instead of Horovod: a program of its
own (``python -m lab.ray_train CONFIG.json``), for the horovod-vs-ray experiment.

    catalog: the processed version's train and test files (Catalog.files), its layout
      └ ray.init: a local head, one CPU per worker, 127.0.0.1 only, no dashboard
          └ TensorflowTrainer, N workers: MultiWorkerMirroredStrategy (gRPC collectives)
              each worker: its rows (every N-th) of the train split, the same model and
              optimizer as the Horovod ranks, epochs timed; test accuracy on the whole test split
      └ ray.shutdown (in a finally); the result as one JSON line on stdout

What is the same as ``shardflow train``: the data (the same version's Parquet files), the model
(training.models.build with the version's normalisation), Adam with the learning rate scaled by
the workers, the batch per worker, the steps per epoch, the thread pools of a rank. What differs:
each worker takes every N-th row of the split in memory (the Horovod ranks stream their row
groups) and there is no learning-rate warm-up.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

RUN_NAME = "horovod-vs-ray"
# Rows per batch when testing: inference only.
TEST_BATCH = 1024


@dataclass(frozen=True, kw_only=True)
class RayTrainConfig:
    """One Ray Train run."""

    catalog_root: str
    dataset: str
    version: str
    num_workers: int
    epochs: int
    batch_size: int
    """Rows per step on each worker, as ``shardflow train --batch-size``."""
    steps_per_epoch: int | None
    """None: planned as ``shardflow train`` plans them (training.input.plan_steps)."""
    learning_rate: float
    seed: int
    model: str = "cnn"

    def __post_init__(self) -> None:
        for name in ("num_workers", "epochs", "batch_size", "steps_per_epoch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _train_loop_per_worker(loop: dict[str, Any]) -> None:
    """One Ray Train worker: TF_CONFIG is set by Ray's TensorFlow backend."""
    import numpy as np
    import tensorflow as tf
    from ray import train

    from training import models
    from training.input import InputSpec, load_split
    from training.rank.setup import configure_threads

    context = train.get_context()
    rank, num_workers = context.get_world_rank(), context.get_world_size()
    # The thread pools of a Horovod rank sharing the host's cores (threads_per_rank 0).
    configure_threads(context.get_local_world_size(), 0)
    tf.keras.utils.set_random_seed(loop["seed"])
    spec = InputSpec(**loop["spec"])
    inputs, labels = load_split(loop["train_files"], spec)
    # Ray: this worker's rows, every N-th of the split.
    inputs, labels = inputs[rank::num_workers], labels[rank::num_workers]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = models.build(
            loop["model"],
            input_shape=spec.input_shape,
            num_classes=loop["num_classes"],
            mean=loop["mean"],
            std=loop["std"],
        )
        # As the Horovod ranks: Adam, the learning rate scaled by the workers.
        model.compile(
            optimizer=tf.keras.optimizers.legacy.Adam(loop["learning_rate"] * num_workers),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    def worker_data(_: Any) -> Any:
        data = tf.data.Dataset.from_tensor_slices((inputs, labels))
        data = data.shuffle(len(labels), seed=loop["seed"] + rank, reshuffle_each_iteration=True)
        return data.repeat().batch(loop["batch_size"], drop_remainder=True).prefetch(2)

    # Ray: each worker feeds its own rows, batch_size per step (no re-batching, no auto-shard).
    distributed = strategy.distribute_datasets_from_function(worker_data)
    epoch_seconds: list[float] = []

    class EpochTimes(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            epoch_seconds.append(time.perf_counter() - self.start)

    step_seconds: list[list[float]] = []

    class StepTimes(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
        """Each step's wall time, by epoch: as the Horovod rank's input meter times them."""

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            step_seconds.append([])

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step_seconds[-1].append(time.perf_counter() - self.start)

    history = model.fit(
        distributed,
        epochs=loop["epochs"],
        steps_per_epoch=loop["steps_per_epoch"],
        callbacks=[EpochTimes(), StepTimes()],
        verbose=0,
    )
    test_inputs, test_labels = load_split(loop["test_files"], spec)
    # Calling the model (not evaluate) runs on this worker alone: no collective.
    predicted = np.concatenate(
        [
            np.argmax(model(test_inputs[i : i + TEST_BATCH], training=False).numpy(), axis=1)
            for i in range(0, len(test_labels), TEST_BATCH)
        ]
    )
    metrics = {
        "epoch_seconds": epoch_seconds,
        "step_seconds_by_epoch": [sum(steps) for steps in step_seconds],
        "steps_by_epoch": [len(steps) for steps in step_seconds],
        "train_accuracy": [float(a) for a in history.history["accuracy"]],
        "test_accuracy": float(np.mean(predicted == test_labels)),
        "test_rows": len(test_labels),
        "train_rows_per_worker": len(labels),
    }
    # Ray Train V2 (the default from 2.51) keeps only metrics reported with a checkpoint: worker
    # 0 reports its model's weights with them; every worker must report.
    with tempfile.TemporaryDirectory(prefix="sf-ray-ckpt-") as folder:
        checkpoint = None
        if rank == 0:
            model.save_weights(str(Path(folder) / "weights.h5"))
            checkpoint = train.Checkpoint.from_directory(folder)
        train.report(metrics, checkpoint=checkpoint)


def _loop_config(config: RayTrainConfig) -> dict[str, Any]:
    """What every worker needs, from the catalog: the files and the layout."""
    from data_catalog import Catalog
    from data_catalog.layout import ProcessedLayout
    from training.input import InputSpec, group_rows, plan_steps

    catalog = Catalog(config.catalog_root)
    manifest = catalog.get(config.dataset, config.version)
    layout = ProcessedLayout.of(manifest)
    steps = config.steps_per_epoch or plan_steps(
        group_rows(layout.train, manifest), config.num_workers, config.batch_size
    )
    return {
        "spec": asdict(InputSpec.of(layout)),
        "train_files": catalog.files(config.dataset, config.version, split="train"),
        "test_files": catalog.files(config.dataset, config.version, split="test"),
        "mean": list(layout.normalization.mean),
        "std": list(layout.normalization.std),
        "num_classes": layout.num_classes,
        "model": config.model,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "steps_per_epoch": steps,
        "learning_rate": config.learning_rate,
        "seed": config.seed,
    }


def run(config: RayTrainConfig) -> dict[str, Any]:
    """Train on a local Ray cluster started here and stopped before returning."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    loop = _loop_config(config)
    # Socket paths under it must stay short (AF_UNIX: 107 bytes).
    with tempfile.TemporaryDirectory(prefix="sf-ray-", dir="/tmp") as folder:
        started = time.perf_counter()
        # A head on 127.0.0.1 with a CPU per worker; no dashboard, no usage reports.
        ray.init(
            num_cpus=config.num_workers,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=folder,
            configure_logging=False,
            log_to_driver=False,
        )
        try:
            trainer = TensorflowTrainer(
                train_loop_per_worker=_train_loop_per_worker,
                train_loop_config=loop,
                scaling_config=ScalingConfig(
                    num_workers=config.num_workers, resources_per_worker={"CPU": 1}
                ),
                run_config=RunConfig(
                    name="horovod-vs-ray", storage_path=str(Path(folder) / "runs")
                ),
            )
            result = trainer.fit()
        finally:
            ray.shutdown()
        seconds = time.perf_counter() - started
    error = getattr(result, "error", None)
    if error is not None:
        raise ShardflowError(f"Ray Train failed: {error}")
    metrics = dict(result.metrics or {})
    return {
        **{k: metrics[k] for k in ("epoch_seconds", "step_seconds_by_epoch", "steps_by_epoch",
                                   "train_accuracy", "test_accuracy", "test_rows",
                                   "train_rows_per_worker")},
        "steps_per_epoch": loop["steps_per_epoch"],
        "seconds_with_cluster": seconds,
        "ray_version": ray.__version__,
        "train_v2": os.environ.get("RAY_TRAIN_V2_ENABLED", "default"),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    """``python -m lab.ray_train CONFIG.json``: the result as the last line on stdout."""
    # No usage reports on a closed network (Ray reads it at ray.init).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        config = RayTrainConfig(**json.loads(Path(argv[0]).read_text()))
        result = run(config)
    except (ShardflowError, ValueError) as error:
        print(f"shardflow: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
