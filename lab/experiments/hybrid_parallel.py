"""Hybrid data + model parallelism (seed: multi-node hybrid DDP + DMP, MobileNetV2 on CIFAR-10).

MobileNetV2 on CIFAR-10, trained with Horovod data parallelism alone and with each rank's
model split into 2 pipelined stages (training.pipeline_parallel), on 1 and 2 ranks: time per
epoch, samples/s, memory per device (modelled from shapes; the rank's allocator peak and RSS
measured) and test accuracy; every configuration trained once per seed (``--seeds``) and
reported as the mean with its min-max over the seeds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.experiments.base import (
    Experiment,
    ExperimentRequest,
    Pipeline,
    TrainedModel,
    run_metrics,
)
from lab.experiments.report import (
    folded,
    grouped_bars,
    markdown_table,
    with_spread,
    write_results,
)
from training.config import TrainConfig

NAME = "hybrid-parallel"
DATASET = "cifar10"
RANKS = (1, 2)
# Quick run: both variants on 2 ranks only (data parallel across them, and within each the
# split), so that make test stays near two minutes.
QUICK_RANKS = (2,)
# Full run: MobileNetV2, 2 epochs (the second one's time is the steady state; the first
# includes tracing the step, which takes far longer for the pipelined step).
MODEL, EPOCHS, BATCH = "mobilenetv2", 2, 32
# Quick run: the cnn (tracing MobileNetV2's pipelined step alone takes about a minute here).
QUICK_MODEL, QUICK_BATCH = "cnn", 16
MICRO_BATCHES = 4
# Unused by this experiment's pipeline for cifar10 (its source is given), kept for the protocol.
SYNTHETIC_ROWS = 0
# Makes TensorFlow's CPU allocator a BFC allocator, which keeps the peak bytes in use
# (tf.config.experimental.get_memory_info); the default CPU allocator keeps none.
BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
MIB = 2**20
# What varies from run to run (seed, load): each folded over the seeds into its mean, min, max
# and sd. The modelled bytes and the split are the same for every seed.
MEASURES = (
    "epoch_seconds_steady",
    "first_epoch_seconds",
    "samples_per_second",
    "train_seconds",
    "train_accuracy",
    "test_accuracy",
    "allocator_peak_bytes_per_rank",
    "peak_rss_bytes_per_rank",
)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """Data parallelism alone, or with each rank's model split into stages."""

    key: str
    label: str
    model_stages: int
    micro_batches: int


VARIANTS = (
    Variant(key="data-parallel", label="data parallel", model_stages=1, micro_batches=1),
    Variant(
        key="hybrid",
        label=f"hybrid (2 stages, {MICRO_BATCHES} micro-batches)",
        model_stages=2,
        micro_batches=MICRO_BATCHES,
    ),
)


def train_configs(request: ExperimentRequest, seed: int = 0) -> list[tuple[Variant, TrainConfig]]:
    """Every variant on every rank count with training seed ``seed``, all else equal."""
    epochs = request.epochs or (1 if request.quick else EPOCHS)
    return [
        (
            variant,
            TrainConfig(
                num_ranks=num_ranks,
                epochs=epochs,
                batch_size=QUICK_BATCH if request.quick else BATCH,
                model=QUICK_MODEL if request.quick else MODEL,
                model_stages=variant.model_stages,
                micro_batches=variant.micro_batches,
                seed=seed,
            ),
        )
        for num_ranks in (QUICK_RANKS if request.quick else RANKS)
        for variant in VARIANTS
    ]


@contextlib.contextmanager
def allocator_stats() -> Iterator[None]:
    """The ranks started inside (horovodrun passes this environment on) keep CPU allocator
    statistics; restored afterwards."""
    before = os.environ.get(BFC_ENV)
    os.environ[BFC_ENV] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BFC_ENV, None)
        else:
            os.environ[BFC_ENV] = before


def row_of(
    variant: Variant, config: TrainConfig, trained: TrainedModel, metrics: dict[str, Any]
) -> dict[str, Any]:
    """One line of the table, with the catalog versions it came from and went to."""
    epoch_seconds = [float(s) for s in metrics["epoch_seconds"]]
    samples_per_epoch = int(metrics["steps_per_epoch"]) * int(metrics["global_batch_size"])
    # The last epoch: the step is traced and warmed up by then (the first epoch pays for it).
    steady = epoch_seconds[-1]
    devices = metrics["memory_by_device_modelled"]
    measured = metrics["memory_by_rank"]
    allocator = [
        max(rank["allocator_peak_bytes"].values())
        for rank in measured
        if rank.get("allocator_peak_bytes")
    ]
    return {
        "variant": variant.key,
        "label": variant.label,
        "seed": config.seed,
        "model": config.model,
        "num_ranks": trained.num_ranks,
        "model_stages": config.model_stages,
        "micro_batches": config.micro_batches,
        "batch_size": config.batch_size,
        "epochs": trained.epochs,
        "epoch_seconds": epoch_seconds,
        "epoch_seconds_steady": steady,
        "first_epoch_seconds": epoch_seconds[0],
        "samples_per_epoch": samples_per_epoch,
        "samples_per_second": samples_per_epoch / steady if steady > 0 else 0.0,
        "train_seconds": trained.train_seconds,
        "test_accuracy": trained.test_accuracy,
        "test_rows": trained.test_rows,
        # The last epoch's, averaged over ranks, with BatchNorm on batch statistics.
        "train_accuracy": float(metrics["history"]["accuracy"][-1]),
        "memory_by_device_modelled": devices,
        "modelled_bytes_by_device": [int(d["total_bytes"]) for d in devices],
        "sent_bytes_per_step_between_stages": sum(int(d["sent_bytes_per_step"]) for d in devices),
        "memory_by_rank_measured": measured,
        "allocator_peak_bytes_per_rank": max(allocator) if allocator else None,
        "peak_rss_bytes_per_rank": max(int(r["peak_rss_bytes"]) for r in measured),
        "dataset_version": trained.dataset_version,
        "model_version": trained.model_version,
    }


def folded_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration (variant, ranks), its runs folded over the seeds
    (report.folded: each of MEASURES the mean, with its min, max, sd and each seed's value);
    the per-epoch times and each rank's measured memory kept per seed."""
    keys = list(dict.fromkeys((r["variant"], r["num_ranks"]) for r in runs))
    rows = []
    for key in keys:
        same = [r for r in runs if (r["variant"], r["num_ranks"]) == key]
        row = folded(same, MEASURES)
        for listed in ("epoch_seconds", "memory_by_rank_measured"):
            row.pop(listed, None)
            row[f"{listed}_by_seed"] = [r[listed] for r in same]
        rows.append(row)
    return rows


def run(request: ExperimentRequest, pipeline: Pipeline) -> dict[str, Any]:
    """Data parallel and hybrid on 1 and 2 ranks, each with every seed, then the report
    into ``request.out``."""
    started, load_before = time.monotonic(), os.getloadavg()
    pipeline.progress(f"{NAME}: ingest and preprocess {DATASET}")
    # No sample: the pipeline's subsets read IDX folders, and a CIFAR-10 source is batches.
    prepared = pipeline.prepare(DATASET, sample=None, synthetic_rows=SYNTHETIC_ROWS)
    source = prepared.source
    synthetic = prepared.synthetic or (Path(source) / "SYNTHETIC.json").is_file()
    runs: list[dict[str, Any]] = []
    with allocator_stats():
        # Seed by seed, every configuration within one: load that comes and goes falls on all
        # configurations alike rather than on one configuration's seeds.
        for seed in request.seed_list:
            for variant, config in train_configs(request, seed):
                pipeline.progress(
                    f"{NAME}: seed {seed}: {variant.label}, {config.num_ranks} rank(s)"
                )
                trained = pipeline.train(DATASET, config)
                runs.append(row_of(variant, config, trained, run_metrics(trained)))
    rows = folded_rows(runs)
    splits = prepared.processed.splits
    result = {
        "experiment": NAME,
        "quick": request.quick,
        "seeds": request.seed_list,
        "rows": rows,
        "runs": runs,
        "data": {
            "source": source,
            "synthetic": synthetic,
            "raw_version": prepared.raw_version,
            "processed_version": prepared.processed_version,
            "rows": {split: int(stats["rows"]) for split, stats in splits.items()},
        },
        "cores": len(os.sched_getaffinity(0)),
        "paper": PAPER,
    }
    result["plots"] = [str(p) for p in _plots(request.out, rows)]
    result["summary"] = summary(rows)
    result["conditions"] = {
        "wall_seconds": time.monotonic() - started,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }
    return write_results(request.out, result, render(result))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """A line per row: means over the seeds with their min-max."""
    return [
        f"{r['label']:<36} {r['num_ranks']} rank(s), seeds {_seeds(r)}: "
        f"{with_spread(r, 'epoch_seconds_steady', '.1f')} s per epoch, memory per device "
        f"{' / '.join(_mib(b) for b in r['modelled_bytes_by_device'])} MiB (modelled), test "
        f"accuracy {with_spread(r, 'test_accuracy')}"
        for r in rows
    ]


def _plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Bars of the means over the seeds, each with an error bar from its min to its max."""
    ranks = sorted({r["num_ranks"] for r in rows})
    groups = [f"{n} rank{'s' * (n > 1)}" for n in ranks]

    def by_ranks(key: str, variant: str, scale: float = 1.0) -> list[float | None]:
        found = {r["num_ranks"]: r.get(key) for r in rows if r["variant"] == variant}
        values = [found.get(n) for n in ranks]
        return [None if v is None else float(v) / scale for v in values]

    def spread_of(key: str, variant: str, scale: float = 1.0) -> list[tuple[float, float] | None]:
        found = {r["num_ranks"]: r for r in rows if r["variant"] == variant}
        return [
            (found[n][f"{key}_min"] / scale, found[n][f"{key}_max"] / scale)
            if n in found and f"{key}_min" in found[n]
            else None
            for n in ranks
        ]

    seeds = len(rows[0]["seeds"]) if rows else 0
    over = f"mean, min-max over {seeds} seed{'s' * (seeds > 1)}"
    time_plot = grouped_bars(
        out / "epoch_seconds.png",
        groups=groups,
        series={v.label: by_ranks("epoch_seconds_steady", v.key) for v in VARIANTS},
        spread={v.label: spread_of("epoch_seconds_steady", v.key) for v in VARIANTS},
        title=f"Time per epoch (last epoch): {over}",
        ylabel="seconds",
    )
    accuracy = grouped_bars(
        out / "test_accuracy.png",
        groups=groups,
        series={v.label: by_ranks("test_accuracy", v.key) for v in VARIANTS},
        spread={v.label: spread_of("test_accuracy", v.key) for v in VARIANTS},
        title=f"Test accuracy: {over}",
        ylabel="test accuracy",
        ylim=(0.0, 1.05),
    )
    series: dict[str, list[float | None]] = {}
    for variant in VARIANTS:
        for device in range(variant.model_stages):
            found = {
                r["num_ranks"]: r["modelled_bytes_by_device"][device] / MIB
                for r in rows
                if r["variant"] == variant.key
            }
            series[f"{variant.key}: device {device}"] = [found.get(n) for n in ranks]
    measured = {
        f"{v.key}: rank's allocator peak (measured)": by_ranks(
            "allocator_peak_bytes_per_rank", v.key, MIB
        )
        for v in VARIANTS
    }
    memory = grouped_bars(
        out / "memory_per_device.png",
        groups=groups,
        series={**series, **measured},
        spread={
            f"{v.key}: rank's allocator peak (measured)": spread_of(
                "allocator_peak_bytes_per_rank", v.key, MIB
            )
            for v in VARIANTS
        },
        title="Memory per device (modelled), per rank (measured: mean, min-max), MiB",
        ylabel="MiB",
    )
    return [time_plot, accuracy, memory]


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _mib_spread(row: dict[str, Any], key: str) -> str:
    """A measured byte count as MiB: its mean with its min-max over the seeds."""
    if row.get(key) is None:
        return "n/a"
    scaled = {
        **row,
        **{k: row[k] / MIB for k in (key, f"{key}_min", f"{key}_max") if k in row},
    }
    return with_spread(scaled, key, ".1f")


def _seeds(row: dict[str, Any]) -> str:
    return ", ".join(str(s) for s in row["seeds"])


# 002 (002_5648216fbe5b68a4.txt): its figures and setup, quoted beside ours.
PAPER = {
    "single_node_seconds": 7250,
    "hybrid_seconds": 1451,
    "single_node_accuracy": 0.82,
    "hybrid_accuracy": 0.83,
    "setup": "PyTorch DDP + manual model partitioning of MobileNet_v2 on 4 AWS t2.micro "
    "instances (1 vCPU each), the real CIFAR-10 (50,000 training images) split between them, "
    "10 epochs for the single node",
}


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Hybrid against data parallel on the same ranks, from the means over the seeds."""
    ratios = []
    for n in sorted({r["num_ranks"] for r in rows}):
        pair = {r["variant"]: r for r in rows if r["num_ranks"] == n}
        if {"data-parallel", "hybrid"} <= pair.keys():
            dp, hy = pair["data-parallel"], pair["hybrid"]
            largest = max(hy["modelled_bytes_by_device"]) / dp["modelled_bytes_by_device"][0]
            slower = hy["epoch_seconds_steady"] / dp["epoch_seconds_steady"]
            peak = _ratio(hy["allocator_peak_bytes_per_rank"], dp["allocator_peak_bytes_per_rank"])
            ratios.append(
                f"- {n} rank{'s' * (n > 1)}: time per epoch {slower:.2f}x, "
                f"largest device's modelled memory {largest:.2f}x, rank's measured allocator "
                f"peak {peak}, "
                f"train accuracy {hy['train_accuracy'] - dp['train_accuracy']:+.4f}, test "
                f"accuracy {hy['test_accuracy'] - dp['test_accuracy']:+.4f} (test accuracy "
                f"over the seeds: data parallel {_range(dp, 'test_accuracy')}, hybrid "
                f"{_range(hy, 'test_accuracy')})"
            )
    return ratios


def _range(row: dict[str, Any], key: str) -> str:
    if len(row["seeds"]) < 2 or f"{key}_min" not in row:
        return "one seed"
    return f"{row[f'{key}_min']:.4f}-{row[f'{key}_max']:.4f}, sd {row[f'{key}_sd']:.4f}"


def render(result: dict[str, Any]) -> str:
    """report.md: the table, what is measured and what is modelled."""
    rows = result["rows"]
    table = markdown_table(
        [
            "variant",
            "ranks",
            "epochs",
            "seeds",
            "time per epoch s (last)",
            "first epoch s",
            "samples/s",
            "memory per device MiB (modelled)",
            "allocator peak per rank MiB (measured)",
            "peak RSS per rank MiB (measured)",
            "train accuracy (last epoch)",
            "test accuracy",
            "paper",
            "model versions (one per seed)",
        ],
        [
            [
                r["label"],
                r["num_ranks"],
                r["epochs"],
                _seeds(r),
                with_spread(r, "epoch_seconds_steady", ".1f"),
                with_spread(r, "first_epoch_seconds", ".1f"),
                with_spread(r, "samples_per_second", ".1f"),
                " / ".join(_mib(b) for b in r["modelled_bytes_by_device"]),
                _mib_spread(r, "allocator_peak_bytes_per_rank"),
                _mib_spread(r, "peak_rss_bytes_per_rank"),
                with_spread(r, "train_accuracy"),
                with_spread(r, "test_accuracy"),
                "not comparable (see below)",
                ", ".join(f"`{v}`" for v in r.get("model_versions", [r["model_version"]])),
            ]
            for r in rows
        ],
    )
    ratios = _ratios(rows)
    stages = next((r for r in rows if r["variant"] == "hybrid"), None)
    split_lines = (
        [
            f"  - stage {d['stage']} on `{d['device']}`: {d['layers']} layers "
            f"(`{d['first_layer']}` … `{d['last_layer']}`), {d['parameters']:,} parameters, "
            f"{d['flops_per_sample']:,} multiply-adds per sample; weights "
            f"{_mib(d['weight_bytes'])}, gradients {_mib(d['gradient_bytes'])}, Adam slots "
            f"{_mib(d['optimizer_bytes'])}, activations {_mib(d['activation_bytes'])} MiB"
            for d in stages["memory_by_device_modelled"]
        ]
        if stages
        else []
    )
    sent = stages["sent_bytes_per_step_between_stages"] if stages else 0
    data = result["data"]
    quick = (
        "\n**Quick run** (`--quick`): the small cnn instead of MobileNetV2, one epoch, 2 ranks "
        "only, on the source given. It checks that every stage runs; its times and accuracies "
        "say nothing.\n"
        if result["quick"]
        else ""
    )
    model = rows[0]["model"] if rows else MODEL
    steps_done = (
        ", ".join(
            sorted(
                {
                    f"{r['samples_per_epoch'] // r['batch_size'] // r['num_ranks'] * r['epochs']}"
                    for r in rows
                },
                key=int,
            )
        )
        or "few"
    )
    return f"""# Hybrid data + model parallelism
{quick}
Seed: multi-node hybrid DDP + DMP, MobileNetV2 on CIFAR-10.

{model} on CIFAR-10 trained with Horovod data parallelism alone (every rank holds the whole
model) and hybrid (every rank's model split into 2 stages on 2 devices of the rank, each
batch pipelined in {MICRO_BATCHES} micro-batches, Horovod allreduce across ranks), on the same
1 and 2 ranks. Every run is a model version whose parameters include `model_stages` and
`micro_batches`.

The paper (002): training took **7,250 s** on a single node and **1,451 s** hybrid across 4
nodes (about 5x faster), reaching test accuracy 0.82 (single node, 10 epochs) and 0.83
(hybrid). Its setup: PyTorch DDP + manual partitioning of MobileNet_v2 on 4 AWS t2.micro
instances (1 vCPU each), the real CIFAR-10 split between them. Ours: {result["cores"]}
shared CPU cores on one machine, at most 2 ranks, synthetic images made from 20 real CIFAR-10
pictures, a few epochs: neither its times nor its accuracies are comparable with ours, and
none of ours is claimed above or below them. What compares is hybrid against data parallel on
the same ranks, below.

{_seeds_text(result)}

{table}

Hybrid ÷ data parallel on the same ranks, computed from the means over the seeds (the figures
to judge by; absolute times on {result["cores"]} shared CPU cores mean little):

{chr(10).join(ratios)}

![time per epoch](epoch_seconds.png)
![test accuracy](test_accuracy.png)
![memory per device](memory_per_device.png)

## What is measured, what is modelled

- **Measured**: epoch times (Keras callback; "last" is the last epoch, after the step was
  traced; the first epoch includes tracing, far longer for the pipelined step), samples/s over
  the last epoch (all ranks), test accuracy on the test split, each rank's peak RSS and the
  peak bytes in use of TensorFlow's CPU allocator (a BFC allocator, `{BFC_ENV}=true`, which
  keeps that statistic).
- **Not measurable here, so modelled**: memory per device. The 2 devices of a rank are
  logical CPU devices of one process: TensorFlow gives them one shared allocator (both report
  the same peak), so a device's own peak cannot be read. Per device the table gives, from the
  tensor shapes (float32): weights + gradients + Adam's 2 slots + every layer output of the
  stage for the rank's whole batch (GPipe keeps each micro-batch's activations until its
  backward pass; an upper bound, since TensorFlow frees outputs no gradient needs). On GPUs
  (one GPU per stage) `tf.config.experimental.get_memory_info` would give each device's peak.
- The measured allocator peak is the rank's, both stages together: splitting moves memory
  between devices, it does not shrink the rank's total, so hybrid and data parallel should
  measure about the same there. Two ranks measure more per rank than one: Horovod's
  allreduce buffers (its fusion buffer alone is 64 MiB by default) go through the same
  allocator when there is a peer to reduce with (not measured apart).
- Split (by forward FLOPs, at a layer boundary only one tensor crosses):
{chr(10).join(split_lines)}
- Between the stages each step moves {_mib(sent)} MiB (activations forward, their gradients
  back), within the process.
- Both logical devices share the rank's cores and TensorFlow's compute pool. Nothing in the
  step orders stage 1 of micro-batch m after stage 0 of micro-batch m+1 and a rank has an
  inter-op thread per stage, so TensorFlow may run them at once (not traced here); but
  overlap cannot add compute the cores do not have, and on 2 cores the hybrid runs pay for
  smaller kernels (micro-batches of {rows[-1]["batch_size"] // MICRO_BATCHES if rows else "?"})
  and the stage hand-offs. What hybrid buys here is the largest device's memory.
- BatchNorm normalises each micro-batch with its own statistics (as in GPipe): with 4
  micro-batches MobileNetV2's BatchNorm sees a quarter of the batch; everything else is the
  batch's maths (tests/training/test_pipeline_parallel.py: one micro-batch gives the unsplit
  model's weights; 4 give 1's for the cnn, which has no BatchNorm).
- Test accuracy is taken with BatchNorm in inference mode, on its moving averages (Keras's
  MobileNetV2: momentum 0.999, {steps_done} steps per run here).
- An earlier run of this report measured test accuracy at chance (0.18-0.19 in every row, the
  cnn too) and blamed that momentum. The cause was the data: the pool handed to
  `synth cifar10` put 10 of the 20 real pictures in its training batches and the other 10 in
  its test batch, so no test picture had been trained on and 3 of the 6 test classes had no
  training image at all (validation, drawn from the training pictures, was at 0.99). The pool
  is now made by `python -m lab.cifar10_pool` with all 20 pictures on both sides.

## Data

- {data["source"]}{" — **synthetic**" if data["synthetic"] else " — real"}: rows
  {", ".join(f"{n:,} {s}" for s, n in data["rows"].items())}; raw `{data["raw_version"]}`,
  processed `{data["processed_version"]}`.
- Real CIFAR-10 cannot be had offline (no registry holds its batches): the source is made by
  `shardflow synth cifar10` from the 20 real CIFAR-10 test images inside foolbox's wheel
  (seeded ±2 px shifts and flips; 8 of the 10 classes are among them), marked synthetic in
  the catalog; the pool from `python -m lab.cifar10_pool`, so that training and test images
  are transforms of the same 20 pictures. Accuracy compares the two variants with each other,
  not MobileNetV2 with anyone's CIFAR-10 figure.
{_conditions_text(result)}"""


def _seeds_text(result: dict[str, Any]) -> str:
    """How many seeds each row is over, and how its spread is shown."""
    seeds = result["seeds"]
    if len(seeds) < 2:
        return (
            f"Each row is one run (seed {_seeds({'seeds': seeds})}): no spread. "
            "`--seeds N` trains every row with seeds 0 .. N-1."
        )
    return (
        f"Each row is the mean over {len(seeds)} seeds ({_seeds({'seeds': seeds})}; the training "
        "seed: initial weights and the order of the training rows, on the same data), with its "
        "min-max over them in brackets; results.json keeps each seed's run under `runs` and each "
        "measure's sd. The runs went seed by seed, every configuration within each seed. The "
        "plots draw the mean as the bar and the min-max as the error bar."
    )


def _conditions_text(result: dict[str, Any]) -> str:
    conditions = result.get("conditions")
    if not conditions:
        return ""
    before, after = conditions["load_average_before"], conditions["load_average_after"]
    return f"""
## Run conditions

{conditions["wall_seconds"]:.0f} s wall (preparing the data included), on
{result["cores"]} CPU cores shared with other work: load average (1, 5, 15 minutes)
{", ".join(f"{x:.2f}" for x in before)} at the start, {", ".join(f"{x:.2f}" for x in after)} at
the end. Times carry the load of the moment; the accuracies do not depend on it.
"""


EXPERIMENT = Experiment(
    name=NAME,
    seed="multi-node hybrid DDP + DMP, MobileNetV2 on CIFAR-10",
    measures="MobileNetV2 + CIFAR-10, data parallel vs hybrid (2 pipelined stages per rank, "
    "4 micro-batches) on 1 and 2 ranks: time per epoch, samples/s, memory per device, test "
    "accuracy",
    full_duration="about 3.5 minutes per seed on 2 cores at load 3, 10.3 with --seeds 3 (4 runs "
    "of 2 epochs per seed on 4,000 synthetic images from `shardflow synth cifar10`, given as "
    "--cifar10-source); --quick (the cnn, 2 ranks, one epoch, on a 320-image source, one seed) "
    "under a minute to 4.5 minutes",
    datasets=(DATASET,),
    run=run,
)
