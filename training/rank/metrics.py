"""What a run reports: every rank's figures gathered after training (:func:`gather`), rank 0's
metrics.json (:func:`run_metrics`) and its test-split evaluation (:func:`evaluate`).

    fit ─► gather (Horovod: every rank's input, memory, wire and pairwise figures) ─► rank 0:
           run_metrics ─► evaluate (test split, model.keras) ─► metrics.json, curves.png
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training import gossip, pipeline_parallel
from training.input import InputSpec, in_batches, load_split
from training.input_metrics import summarize
from training.rank import model as rank_model
from training.rank.callbacks import RankCallbacks
from training.rank.config import WorkerConfig
from training.rank.data import EVALUATION_BATCH
from training.rank.model import RankModel
from training.rank.resume import StartPoint


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What the run measured: rank 0's own figures and every rank's, in rank order."""

    history: dict[str, list[float]]
    train_seconds: float
    epoch_seconds: list[float]
    allreduce_bytes_by_epoch: list[int]
    input_by_rank: list[dict[str, Any]]
    memory_by_rank: list[dict[str, Any]]
    wire_by_rank: list[dict[str, Any]] | None
    """With ``network_interface``: what each rank sent on the interfaces."""
    wire_interfaces: list[str]
    pairwise_by_rank: list[dict[str, Any]] | None
    """``--sync pairwise``: each rank's averaging report."""
    final_average_bytes: int
    """``--sync pairwise``: the payload of the closing average of all ranks."""


def gather(
    built: RankModel,
    parts: RankCallbacks,
    devices: list[str],
    history: dict[str, list[float]],
    train_seconds: float,
) -> Measured:
    """Every rank's figures, on every rank (each rank calls this: the gathers are collective)."""
    from training import collective

    # Horovod: the model version of a pairwise run is the mean of every rank's model (one
    # allreduce over all ranks, after the wire meter's last epoch).
    final_average_bytes = gossip.average_all(built.model) if parts.averaging is not None else 0
    pairwise_by_rank = (
        collective.allgather_object(parts.averaging.report(), name="pairwise")
        if parts.averaging is not None
        else None
    )
    # Horovod: every rank's wire counters, in rank order, to rank 0 (after the last epoch's
    # counters were read: this gather is not counted in them).
    wire = parts.wire
    wire_by_rank = (
        collective.allgather_object(wire.report(), name="wire_meter") if wire is not None else None
    )
    # Horovod: every rank's input metrics, in rank order, to rank 0 (once, after training).
    input_by_rank = collective.allgather_object(parts.steps.report(), name="input_meter")
    # Horovod: every rank's measured memory (peak RSS; allocator peaks where tracked).
    memory_by_rank = collective.allgather_object(
        pipeline_parallel.measured_memory(devices), name="memory"
    )
    return Measured(
        history=history,
        train_seconds=train_seconds,
        epoch_seconds=parts.timer.seconds,
        allreduce_bytes_by_epoch=parts.allreduce.per_epoch,
        input_by_rank=input_by_rank,
        memory_by_rank=memory_by_rank,
        wire_by_rank=wire_by_rank,
        wire_interfaces=wire.interfaces if wire is not None else [],
        pairwise_by_rank=pairwise_by_rank,
        final_average_bytes=final_average_bytes,
    )


def run_metrics(
    config: WorkerConfig,
    num_ranks: int,
    start: StartPoint,
    built: RankModel,
    devices: list[str],
    measured: Measured,
) -> dict[str, Any]:
    """metrics.json of the run, without the test split's figures (:func:`evaluate`)."""
    train, steps = config.train, config.steps_per_epoch
    epochs_run = train.epochs - start.initial_epoch
    samples_per_epoch = steps * train.batch_size * num_ranks
    # What each rank hands to allreduce per epoch: every trainable gradient once per optimizer
    # step (one step per K backward passes), at 2 bytes per value with fp16 compression.
    gradient_values = sum(int(np.prod(v.shape)) for v in built.model.trainable_variables)
    value_bytes = 2 if train.compression == "fp16" else 4
    # One allreduce per K steps, counted across epoch ends (Horovod carries the partial sum).
    allreduces = steps / train.backward_passes_per_step
    per_epoch = measured.allreduce_bytes_by_epoch
    metrics: dict[str, Any] = {
        "num_ranks": num_ranks,
        "epochs": train.epochs,
        "steps_per_epoch": steps,
        "global_batch_size": train.batch_size * num_ranks,
        "backward_passes_per_step": train.backward_passes_per_step,
        "compression": train.compression,
        "resumed_after_epoch": start.initial_epoch,
        # A mid-epoch resume: the epoch (from 1) and step it continued at, and how.
        "resumed_at": start.resumed_at,
        "gradient_values": gradient_values,
        # Measured: bytes rank 0 handed to allreduce in each epoch (after compression).
        "allreduce_bytes_by_epoch": per_epoch,
        "allreduce_bytes_per_epoch": int(np.mean(per_epoch)) if per_epoch else 0,
        # Computed from the model, for comparison: every gradient once per optimizer step.
        "allreduce_bytes_per_epoch_computed": round(gradient_values * value_bytes * allreduces),
        "history": {k: [float(v) for v in vs] for k, vs in measured.history.items()},
        "epoch_seconds": measured.epoch_seconds,
        "train_seconds": measured.train_seconds,
        "samples_per_second": samples_per_epoch * epochs_run / measured.train_seconds,
        "model_stages": train.model_stages,
        "micro_batches": train.micro_batches,
        # Measured per rank: peak RSS, and allocator peaks where TensorFlow tracks them.
        "memory_by_rank": measured.memory_by_rank,
        # Modelled from shapes: what each device of a rank holds for its stage (one device
        # for the whole model when unsplit).
        "memory_by_device_modelled": pipeline_parallel.modelled_memory(
            built.stages or pipeline_parallel.whole(built.unsplit),
            batch_size=train.batch_size,
            devices=devices,
        ),
    }
    pairwise = measured.pairwise_by_rank
    if pairwise is not None:
        # Payload each rank handed to its pairwise averages per epoch (rank 0's as the
        # allreduce payload), and the final average's.
        metrics["sync"] = train.sync
        metrics["average_every"] = train.average_every
        metrics["pairwise_by_rank"] = pairwise
        metrics["allreduce_bytes_by_epoch"] = pairwise[0]["bytes_by_epoch"]
        metrics["allreduce_bytes_per_epoch"] = int(np.mean(pairwise[0]["bytes_by_epoch"]))
        metrics["allreduce_bytes_per_epoch_computed"] = None
        metrics["final_average_bytes"] = measured.final_average_bytes
    if measured.wire_by_rank is not None:
        # Measured on the interfaces: bytes (and packets) each rank sent in each epoch, framing
        # included, and before training (Horovod's control loop alone, for its rate).
        metrics["wire_interfaces"] = measured.wire_interfaces
        metrics["wire_sent_by_rank"] = measured.wire_by_rank
    metrics["input_by_rank"] = measured.input_by_rank
    metrics["input_summary"] = summarize(measured.input_by_rank)
    return metrics


def evaluate(
    config: WorkerConfig, spec: InputSpec, built: RankModel, run_dir: Path
) -> dict[str, Any]:
    """Rank 0: the trained model's accuracy on the test split; saves it as model.keras."""
    started = time.perf_counter()
    # The model that is saved: no augmentation layer, no Horovod optimizer.
    export = rank_model.build(config, spec, augment=False)
    export.set_weights(built.unsplit.get_weights())
    x_test, y_test = load_split(config.source("test"), spec)
    logits = export.predict(in_batches(x_test, EVALUATION_BATCH), verbose=0)
    predictions = np.argmax(logits, axis=1)
    figures = {
        "test_accuracy": float(np.mean(predictions == y_test)),
        "test_rows": len(y_test),
        "test_seconds": time.perf_counter() - started,
    }
    export.save(run_dir / "model.keras")
    print(
        f"test accuracy {figures['test_accuracy']:.4f} on {len(y_test)} held-out rows", flush=True
    )
    return figures


def describe_input(input_by_rank: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """One line per rank: its input-bound share, step time, input time per batch, rows/s,
    the same over its last steps (the rolling window), flags."""

    def window(r: dict[str, Any]) -> str:
        rolling = r.get("rolling")
        if not rolling:
            return ""
        return (
            f"; last {rolling['steps']} steps: input-bound {100 * rolling['input_bound']:.0f}%, "
            f"step {1000 * rolling['mean_step_seconds']:.1f} ms, "
            f"{rolling['rows_per_second']:.0f} rows/s"
        )

    return [
        f"rank {r['rank']}: input-bound {100 * r['input_bound']:.0f}%, "
        f"step {1000 * r['mean_step_seconds']:.1f} ms, "
        f"input {1000 * r['input_seconds_per_batch']:.1f} ms/batch, "
        f"{r['rows_per_second']:.0f} rows/s"
        + window(r)
        + (
            f" [{', '.join(summary['flags'][str(r['rank'])])}]"
            if summary["flags"].get(str(r["rank"]))
            else ""
        )
        for r in input_by_rank
    ]
