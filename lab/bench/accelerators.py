"""Emulated accelerators: how long one accelerator computes a training step of a model, per
sample, at a batch size (MLPerf Storage's method: a step is "computed" by waiting that long).

Each row names its source. The H200 rows are issue #30's measurements (training steps:
forward, backward, SGD; bf16, eager PyTorch 2.11, no data loading, on one NVIDIA H200; "graph":
the step captured as one CUDA graph). The A100 and H100 rows of ResNet-50 on ImageNet-size
samples are MLPerf Storage's own emulated accelerators (DLIO workload configurations,
``computation_time`` per batch of 400). No published figure exists for the small models on an
A100: their rows are the H200's scaled by MLPerf Storage's A100 ÷ H100 ResNet-50 compute time
(0.435 s ÷ 0.224 s = 1.94; the H200 computes as an H100, with more memory), an estimate named
as such.
"""

from __future__ import annotations

from dataclasses import dataclass

from data_catalog.errors import ShardflowError

H200 = "issue #30: measured on one NVIDIA H200 (bf16, eager PyTorch 2.11)"
H200_GRAPH = "issue #30: measured on one NVIDIA H200, the step captured as one CUDA graph"
MLPERF_A100 = (
    "MLPerf Storage v1.0 emulated A100 (DLIO workload resnet50_a100.yaml: batch 400, "
    "computation_time 0.435 s)"
)
MLPERF_H100 = (
    "MLPerf Storage v1.0 emulated H100 (storage-conf/workload/resnet50_h100.yaml: batch 400, "
    "computation_time 0.224 s)"
)
A100_PER_H100 = 0.435 / 0.224
A100_DERIVED = (
    "estimate: the H200 measurement x 1.94, MLPerf Storage's A100 / H100 ResNet-50 compute time "
    "(no published A100 figure for this model)"
)

FASHION = (28, 28, 1)
"""Fashion-MNIST and MNIST as stored (ResNet-50 and MobileNetV2 pad them to 32x32)."""
CIFAR = (32, 32, 3)
IMAGENET = (224, 224, 3)
TABULAR = ()
"""Any tabular rows (SDSS's features)."""


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One row of the table: ``accelerator`` computing ``model`` on samples of ``sample_shape``
    at ``batch_size`` takes ``us_per_sample`` microseconds a sample."""

    accelerator: str
    model: str
    sample_shape: tuple[int, ...]
    batch_size: int
    us_per_sample: float
    source: str

    @property
    def samples_per_second(self) -> float:
        return 1e6 / self.us_per_sample

    @property
    def step_seconds(self) -> float:
        return self.us_per_sample * self.batch_size / 1e6


def _rows() -> list[Accelerator]:
    measured = [
        # (model, shape, batch, µs per sample) on the H200, eager
        ("cnn", FASHION, 32, 57.2),
        ("cnn", FASHION, 256, 7.43),
        ("cnn", FASHION, 4096, 0.96),
        ("dnn", TABULAR, 32, 54.3),
        ("dnn", TABULAR, 4096, 0.50),
        ("resnet50", FASHION, 32, 654.0),
        ("resnet50", FASHION, 256, 85.7),
        ("mobilenetv2", FASHION, 32, 547.0),
        ("mobilenetv2", FASHION, 256, 91.1),
        ("mobilenetv2", CIFAR, 32, 679.0),
        ("mobilenetv2", CIFAR, 256, 88.6),
        ("resnet50", IMAGENET, 256, 211.0),
        ("mobilenetv2", IMAGENET, 256, 137.0),
    ]
    graph = [("cnn", FASHION, 32, 6.8), ("cnn", FASHION, 256, 1.9), ("dnn", TABULAR, 32, 3.3)]
    rows = [
        Accelerator(
            accelerator="h200", model=m, sample_shape=s, batch_size=b, us_per_sample=us, source=H200
        )
        for m, s, b, us in measured
    ]
    rows += [
        Accelerator(
            accelerator="h200-graph",
            model=m,
            sample_shape=s,
            batch_size=b,
            us_per_sample=us,
            source=H200_GRAPH,
        )
        for m, s, b, us in graph
    ]
    rows += [
        Accelerator(
            accelerator="a100",
            model="resnet50",
            sample_shape=IMAGENET,
            batch_size=400,
            us_per_sample=0.435 / 400 * 1e6,
            source=MLPERF_A100,
        ),
        Accelerator(
            accelerator="h100",
            model="resnet50",
            sample_shape=IMAGENET,
            batch_size=400,
            us_per_sample=0.224 / 400 * 1e6,
            source=MLPERF_H100,
        ),
    ]
    rows += [
        Accelerator(
            accelerator="a100",
            model=m,
            sample_shape=s,
            batch_size=b,
            us_per_sample=round(us * A100_PER_H100, 2),
            source=A100_DERIVED,
        )
        for m, s, b, us in measured
        if (m, s) in (("cnn", FASHION), ("dnn", TABULAR))
    ]
    return rows


ACCELERATORS: tuple[Accelerator, ...] = tuple(_rows())
NAMES = tuple(sorted({row.accelerator for row in ACCELERATORS}))


def lookup(
    accelerator: str, model: str, sample_shape: tuple[int, ...], batch_size: int | None
) -> Accelerator:
    """The row of ``accelerator`` computing ``model`` on samples of ``sample_shape`` (tabular
    rows: ``()``) at ``batch_size``; None: at 32 (shardflow's default batch) where the table
    has it, else its smallest batch. A one-line error names the batches it has."""
    rows = [
        r
        for r in ACCELERATORS
        if r.accelerator == accelerator and r.model == model and r.sample_shape == sample_shape
    ]
    if not rows:
        known = sorted(
            {(r.model, r.sample_shape) for r in ACCELERATORS if r.accelerator == accelerator}
        )
        shape = "x".join(map(str, sample_shape)) or "tabular rows"
        has = ", ".join(f"{m} on {'x'.join(map(str, s)) or 'tabular rows'}" for m, s in known)
        raise ShardflowError(
            f"no emulated {accelerator} for {model} on {shape}; it has: {has or 'nothing'}"
        )
    batches = sorted(r.batch_size for r in rows)
    wanted = batch_size or (32 if 32 in batches else batches[0])
    for row in rows:
        if row.batch_size == wanted:
            return row
    raise ShardflowError(
        f"the emulated {accelerator} has {model} at batch sizes {', '.join(map(str, batches))}, "
        f"not {wanted}: give one of them with --batch-size"
    )
