"""The program every Horovod rank runs: ``horovodrun ... python -m training.worker CONFIG``.

Each rank streams its own row groups, trains data-parallel, and rank 0 alone writes
checkpoints, the final model and metrics into the run directory. The parts, in order
(training/rank/):

    setup        pinned to a core (threads_per_rank 1), Horovod, devices, thread pools
    model        the model, split into stages when asked, Horovod's optimizer
    resume       where training starts (--resume: rank 0's newest checkpoint)
    data         this rank's training batches, the validation split
    callbacks    the Keras callbacks in order: broadcast, metric average, learning-rate
                 schedules, divergence guard, rank 0's checkpoints, meters
    (fit)        here: a resumed run's shortened epoch, then whole epochs
    metrics      every rank's figures gathered; rank 0: metrics.json, the test split
    curves       curves.png
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.pause_points import pause_point
from training.rank.config import WorkerConfig
from training.rank.run_dir import DIVERGED_NAME

if TYPE_CHECKING:  # they import TensorFlow, which run imports after pinning the rank
    from training.rank.callbacks import RankCallbacks
    from training.rank.data import TrainInput
    from training.rank.resume import StartPoint

History = dict[str, list[float]]


def run(config: WorkerConfig) -> None:
    train, launch = config.train, config.launch
    from training.rank import setup

    if launch.threads_per_rank == 1:
        # Before TensorFlow or Horovod start a thread: every thread inherits the core.
        setup.pin_to_one_core()
    import tensorflow as tf

    from training.input import InputSpec
    from training.rank import callbacks, curves, data, metrics, model, resume
    from training.rank.meters import WireMeter

    # Horovod: initialise, and learn where this rank is among the others.
    world = setup.init_horovod(train)
    # What each rank sends on the interface(s) the ranks talk over, when the run names them.
    wire = WireMeter.started(launch.network_interface)
    devices = setup.configure_devices(train.model_stages, world.local_rank)
    setup.configure_threads(
        world.local_size, launch.threads_per_rank, model_stages=train.model_stages
    )
    tf.keras.utils.set_random_seed(train.seed)
    spec = InputSpec(**config.spec)
    built = model.compiled(config, spec, world, devices.stages)
    start = resume.StartPoint()
    if launch.resume:
        start = resume.resume(built.model, built.optimizer, config, world)
    train_input = data.TrainInput(config, spec, world, os.environ)
    validation = data.validation_data(config, spec)
    parts = callbacks.assemble(config, world, built, train_input.meter, wire)
    # Horovod: Keras's progress lines from rank 0 only.
    verbose = world.rank == 0
    history, train_seconds = fit(
        built.model, parts, train_input, validation, config, start, verbose=verbose
    )
    if world.rank == 0:
        pause_point("trained")
    # Horovod: every rank's figures to every rank (collective: every rank gathers).
    measured = metrics.gather(built, parts, devices.model, history, train_seconds)
    # Horovod: the model, metrics and curves from rank 0 alone.
    if world.rank != 0:
        return
    run_dir = Path(config.run_dir)
    if parts.guard.diverged is not None:
        # No model, no metrics: the launcher reports this and commits nothing.
        (run_dir / DIVERGED_NAME).write_text(json.dumps(parts.guard.diverged))
        print(f"training diverged: {parts.guard.diverged}", flush=True)
        return
    results = metrics.run_metrics(config, world.num_ranks, start, built, devices.model, measured)
    for line in metrics.describe_input(results["input_by_rank"], results["input_summary"]):
        print(line, flush=True)
    if config.evaluate:
        pause_point("evaluate")
        results |= metrics.evaluate(config, spec, built, run_dir)
    (run_dir / "metrics.json").write_text(json.dumps(results, indent=2))
    curves.plot_curves(results, run_dir / "curves.png")


def fit(
    model: Any,
    parts: RankCallbacks,
    train_input: TrainInput,
    validation: Any,
    config: WorkerConfig,
    start: StartPoint,
    *,
    verbose: bool,
) -> tuple[History, float]:
    """Train from ``start`` to the last epoch; returns (Keras's history, seconds)."""
    epochs, steps_per_epoch = config.train.epochs, config.steps_per_epoch
    started = time.perf_counter()
    history: History = {}
    first_full = start.initial_epoch
    checkpointer = parts.checkpointer
    if start.partial is not None:
        # The rest of the interrupted epoch, as one shortened epoch whose schedule starts at
        # the step it stopped at; then the whole epochs.
        first_full = start.initial_epoch + 1
        if checkpointer is not None:
            checkpointer.offset = start.step_offset
            # Another rank count's partial epoch is no step of this run's plan: epoch ends only.
            checkpointer.mid_epoch = start.partial.sources is None
        fitted = model.fit(
            train_input.epochs(start.initial_epoch, first_full, start.partial),
            steps_per_epoch=start.partial_steps,
            epochs=first_full,
            initial_epoch=start.initial_epoch,
            callbacks=parts.shifted(start.step_offset),
            validation_data=validation,
            verbose=2 if verbose else 0,
        )
        history = {k: list(v) for k, v in fitted.history.items()}
        if checkpointer is not None:
            checkpointer.mid_epoch = True
    if first_full < epochs and parts.guard.diverged is None:
        fitted = model.fit(
            train_input.epochs(first_full, epochs),
            steps_per_epoch=steps_per_epoch,
            epochs=epochs,
            initial_epoch=first_full,
            callbacks=parts.in_order,
            validation_data=validation,
            verbose=2 if verbose else 0,
        )
        for k, v in fitted.history.items():
            history.setdefault(k, []).extend(v)
    return history, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m training.worker CONFIG.json (started by horovodrun)")
    from training import credentials

    # First: a rank on another host has the object store's secrets only from this file.
    credentials.load()
    run(WorkerConfig.load(args[0]))


if __name__ == "__main__":
    main()
