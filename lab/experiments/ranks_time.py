"""Ranks x time (seed: Horovod on cloud GPUs, MNIST on 1, 2 and 4 GPUs: 4 s -> 1 s an epoch).

The MNIST CNN on 1, 2 and 4 ranks, each rank a host of its own (namespaced hosts, one
TensorFlow thread per rank, horovodrun in a head host reaching them by ssh, Gloo over their
links): time per epoch, samples/s, test accuracy and efficiency against linear scaling. Every
row is trained once per seed of the request and reported as the mean with its min-max over them.

This machine's cores bound what more ranks can gain: with C cores, N ranks of one thread can be
at most min(N, C) times as fast as one. The report shows efficiency against linear (the
paper's measure) and against that bound (what this machine can show).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from lab.experiments.base import Experiment, ExperimentRequest, Pipeline, Sample, TrainedModel
from lab.experiments.report import folded, markdown_table, with_spread, write_results
from lab.netns import rank_hosts
from training.config import TrainConfig

NAME = "ranks-time"
RANKS = (1, 2, 4)
MODEL = "cnn"
EPOCHS = 6
# Horovod's Keras MNIST example's batch: a step of 32 takes ~30 ms on one core, as short as an
# allreduce of the CNN's 0.9 MB over a veth link on the same cores.
BATCH_SIZE = 128
QUICK_BATCH_SIZE = 32
# 64 equal row groups (the planner's default) serve 1, 2 and 4 ranks.
QUICK_SAMPLE = Sample(train_rows=512, test_rows=128)
# The seed: "Horovod on cloud GPUs", MNIST, seconds per epoch on 1, 2 and 4 GPUs.
PAPER_EPOCH_SECONDS = {1: 4.0, 4: 1.0}
# What varies from run to run, folded over the seeds into a mean with its spread.
MEASURES = ("seconds_per_epoch", "first_epoch_seconds", "samples_per_second", "test_accuracy")


def train_config(num_ranks: int, epochs: int, batch_size: int, seed: int = 0) -> TrainConfig:
    """One run of ``num_ranks`` ranks with ``seed``, all else equal."""
    return TrainConfig(
        num_ranks=num_ranks, epochs=epochs, batch_size=batch_size, model=MODEL, seed=seed
    )


def row_of(trained: TrainedModel, seed: int = 0) -> dict[str, Any]:
    """One line of the table, from the train stage's result and its metrics."""
    # The worker times every epoch, and the launcher records the batch size in the version.
    assert trained.epoch_seconds is not None and trained.batch_size is not None
    epoch_seconds = [float(s) for s in trained.epoch_seconds]
    # Epoch 1 also traces the graph, fills the input pipeline and broadcasts the weights.
    steady = epoch_seconds[1:] or epoch_seconds
    seconds = sum(steady) / len(steady)
    num_ranks = trained.num_ranks
    rows_per_epoch = trained.steps_per_epoch * trained.batch_size * num_ranks
    return {
        "num_ranks": num_ranks,
        "seed": seed,
        "epochs": trained.epochs,
        "epoch_seconds": epoch_seconds,
        "first_epoch_seconds": epoch_seconds[0],
        "seconds_per_epoch": seconds,
        "samples_per_second": rows_per_epoch / seconds,
        "test_accuracy": trained.test_accuracy,
        "test_rows": trained.test_rows,
        "dataset_version": trained.dataset_version,
        "model_version": trained.model_version,
    }


def folded_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per number of ranks: its runs (one per seed) folded into the mean, min, max
    and sd of every measure; ranks in ascending order."""
    return [
        folded([r for r in runs if r["num_ranks"] == n], MEASURES)
        for n in sorted({r["num_ranks"] for r in runs})
    ]


def with_efficiency(rows: list[dict[str, Any]], cores: int) -> list[dict[str, Any]]:
    """Speed-up over 1 rank, efficiency against linear (speed-up / N) and against this
    machine's bound (speed-up / min(N, cores)); of the rows' samples/s, so of the means over
    the seeds where the rows are folded."""
    one = next(r for r in rows if r["num_ranks"] == 1)
    done = []
    for row in rows:
        speedup = row["samples_per_second"] / one["samples_per_second"]
        done.append(
            {
                **row,
                "speedup": speedup,
                "efficiency": speedup / row["num_ranks"],
                "efficiency_of_cores": speedup / min(row["num_ranks"], cores),
            }
        )
    return done


def run(request: ExperimentRequest, pipeline: Pipeline) -> dict[str, Any]:
    """The CNN on 1, 2 and 4 namespaced hosts, then the report into ``request.out``."""
    epochs = request.epochs or (2 if request.quick else EPOCHS)
    pipeline.progress(f"{NAME}: ingest and preprocess mnist")
    prepared = pipeline.prepare(
        "mnist", sample=QUICK_SAMPLE if request.quick else None, synthetic_rows=0
    )
    batch_size = QUICK_BATCH_SIZE if request.quick else BATCH_SIZE
    runs = []
    with tempfile.TemporaryDirectory(prefix="shardflow-ranks-time-") as folder:
        pipeline.progress(f"{NAME}: {max(RANKS)} namespaced hosts with sshd, and a head")
        # Nothing here counts bytes on the links: they keep veth's large segments.
        with rank_hosts(max(RANKS), Path(folder) / "ssh", frame_every_segment=False) as hosts:
            for number, seed in enumerate(request.seed_list):
                # Alternate rounds: the order of the ranks flips from seed to seed, so that a
                # drift in the shared machine's load does not always fall on the same rows.
                for num_ranks in RANKS if number % 2 == 0 else RANKS[::-1]:
                    pipeline.progress(f"{NAME}: seed {seed}: {num_ranks} rank(s), one host each")
                    config = train_config(num_ranks, epochs, batch_size, seed)
                    # On their hosts, one thread each (a rank pinned to one core).
                    launch = hosts.launch_config(num_ranks, threads_per_rank=1)
                    trained = pipeline.train("mnist", config, launch, on=hosts)
                    runs.append(row_of(trained, seed))
    cores = len(os.sched_getaffinity(0))
    rows = with_efficiency(folded_rows(runs), cores)
    plots = _plots(request.out, rows)
    result = {
        "experiment": NAME,
        "quick": request.quick,
        "seeds": request.seed_list,
        "runs": runs,
        "rows": rows,
        "cores": cores,
        "batch_size": batch_size,
        "load_average": list(os.getloadavg()),
        "source": prepared.source,
        "raw_version": prepared.raw_version,
        "summary": summary(rows),
        "plots": [str(p) for p in plots],
    }
    return write_results(request.out, result, render(result))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row: each measure's mean with its min-max over the seeds, the ratios of
    the means."""
    return [
        f"{r['num_ranks']} rank(s), seed(s) {_seeds(r)}: "
        f"{with_spread(r, 'seconds_per_epoch', '.2f')} s/epoch, "
        f"{with_spread(r, 'samples_per_second', '.0f')} samples/s, efficiency "
        f"{r['efficiency']:.2f} ({r['efficiency_of_cores']:.2f} of this machine's cores; of the "
        f"means), test accuracy {with_spread(r, 'test_accuracy')}, "
        + ", ".join(r.get("model_versions", [r["model_version"]]))
        for r in rows
    ]


def _seeds(row: dict[str, Any]) -> str:
    return ", ".join(str(s) for s in row["seeds"])


def _by_seed(row: dict[str, Any], key: str) -> list[float]:
    return [float(v) for v in row.get(f"{key}_by_seed", [row[key]]) if v is not None]


def seed_efficiencies(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Per number of ranks: each seed's efficiency against linear, of its samples/s over the
    same seed's 1-rank run (what the plot's dots show beside the mean's)."""
    one = _by_seed(next(r for r in rows if r["num_ranks"] == 1), "samples_per_second")
    return {
        r["num_ranks"]: [
            s / base / r["num_ranks"]
            for s, base in zip(_by_seed(r, "samples_per_second"), one, strict=False)
        ]
        for r in rows
    }


def _with_spread_plot(axes: Any, ranks: list[int], rows: list[dict[str, Any]], key: str) -> None:
    """The mean of ``key`` over the seeds as a line, its min-max as error bars, each seed a
    dot."""
    means = [r[key] for r in rows]
    low = [m - r.get(f"{key}_min", m) for m, r in zip(means, rows, strict=True)]
    high = [r.get(f"{key}_max", m) - m for m, r in zip(means, rows, strict=True)]
    axes.errorbar(ranks, means, yerr=[low, high], fmt="o-", capsize=4,
                  label="shardflow (CPU), mean, min-max")  # fmt: skip
    for n, row in zip(ranks, rows, strict=True):
        values = _by_seed(row, key)
        axes.scatter([n] * len(values), values, s=12, color="C3", zorder=3,
                     label="each seed" if n == ranks[0] else None)  # fmt: skip


def _plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["num_ranks"] for r in rows]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4))
    _with_spread_plot(left, ranks, rows, "seconds_per_epoch")
    one = rows[0]["seconds_per_epoch"]
    left.plot(ranks, [one / n for n in ranks], "k:", label="linear (of the 1-rank mean)")
    paper = sorted(PAPER_EPOCH_SECONDS.items())
    left.plot([n for n, _ in paper], [s for _, s in paper], "s--", label="paper (GPUs)")
    left.set_ylabel("seconds per epoch")
    left.set_title("Time per epoch")
    middle.plot(ranks, [r["efficiency"] for r in rows], "o-", label="against linear (means)")
    middle.plot(ranks, [r["efficiency_of_cores"] for r in rows], "o--",
                label="against min(ranks, cores) (means)")  # fmt: skip
    for n, values in seed_efficiencies(rows).items():
        middle.scatter([n] * len(values), values, s=12, color="C2", zorder=3,
                       label="against linear, each seed" if n == ranks[0] else None)  # fmt: skip
    middle.axhline(1.0, color="k", linestyle=":")
    middle.set_ylabel("efficiency")
    middle.set_ylim(0, 1.2)
    middle.set_title("Scaling efficiency")
    _with_spread_plot(right, ranks, rows, "test_accuracy")
    right.set_ylabel("test accuracy")
    right.set_title("Test accuracy")
    for axes in (left, middle, right):
        axes.set_xlabel("ranks")
        axes.set_xticks(ranks)
        axes.legend(fontsize=7)
    figure.suptitle(f"MNIST CNN over seeds {_seeds(rows[0])}", fontsize=10)
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ranks_time.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [path]


def _table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        [
            "ranks (hosts)",
            "seeds",
            "s/epoch",
            "paper s/epoch (GPUs)",
            "first epoch s",
            "samples/s",
            "speed-up",
            "efficiency vs linear",
            "vs min(ranks, cores)",
            "test accuracy",
            "model versions (by seed)",
        ],
        [
            [
                r["num_ranks"],
                _seeds(r),
                with_spread(r, "seconds_per_epoch", ".2f"),
                PAPER_EPOCH_SECONDS.get(r["num_ranks"], "—"),
                with_spread(r, "first_epoch_seconds", ".2f"),
                with_spread(r, "samples_per_second", ".0f"),
                round(r["speedup"], 2),
                round(r["efficiency"], 2),
                round(r["efficiency_of_cores"], 2),
                with_spread(r, "test_accuracy"),
                ", ".join(f"`{v}`" for v in r.get("model_versions", [r["model_version"]])),
            ]
            for r in rows
        ],
    )


def _spread_text(rows: list[dict[str, Any]]) -> str:
    """How many seeds, and how far apart they came."""
    seeds = rows[0]["seeds"] if rows else [0]
    if len(seeds) < 2:
        return (
            f"Each row is one run, seed {_seeds(rows[0]) if rows else 0}: no spread "
            "(`--seeds 3` trains every row with seeds 0, 1 and 2 and reports their mean with "
            "its min-max)."
        )
    width = max(
        (r["seconds_per_epoch_max"] - r["seconds_per_epoch_min"]) / r["seconds_per_epoch"]
        for r in rows
    )
    points = max(r["test_accuracy_max"] - r["test_accuracy_min"] for r in rows) * 100
    return (
        f"Every row is trained with each of {len(seeds)} seeds ({_seeds(rows[0])}; the seed "
        "sets the initial weights and the shuffle); each figure is their mean with its min-max "
        "over the seeds in brackets (the sd of each is in results.json, each seed's row under "
        f"`runs`). From seed to seed, seconds per epoch spread by up to {width:.0%} of their "
        f"mean, test accuracy by up to {points:.1f} points. Speed-up and efficiencies are ratios "
        "of the means (the plot's dots: each seed's own ratio to its 1-rank run)."
    )


def render(result: dict[str, Any]) -> str:
    """report.md: the table beside the paper's seconds per epoch, each figure a mean over the
    seeds with its spread."""
    rows = result["rows"]
    paper_speedup = PAPER_EPOCH_SECONDS[1] / PAPER_EPOCH_SECONDS[4]
    quick = (
        "\n**Quick run** (`--quick`): 512 training images, two epochs. It checks that every "
        "stage runs; its figures say nothing about the paper's.\n"
        if result["quick"]
        else ""
    )
    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    return f"""# Ranks x time (seed: Horovod on cloud GPUs, MNIST on 1/2/4 GPUs)
{quick}
The MNIST CNN (`--model {MODEL}`, batch {result["batch_size"]} per rank, learning rate scaled
by the ranks) on 1, 2 and 4 ranks, each rank a namespaced host of its own with one TensorFlow thread
(`--threads-per-rank 1`), horovodrun in a head host reaching them by ssh, Gloo allreduce over
their veth links. Seconds per epoch are the mean of the epochs after the first (the first also
traces the graph and broadcasts the initial weights). Data: {result["source"]}
(`{result["raw_version"]}`).

{_spread_text(rows)}

{_table(rows)}

![time per epoch, efficiency and accuracy over seeds](ranks_time.png)

## Reading it

- The paper went from 4 s to 1 s an epoch on 1 to 4 GPUs: a speed-up of {paper_speedup:.0f},
  efficiency 1.0 against linear.
- The paper's figures and setup (000_4d72d1677b3ebcee.txt): 4 s 9 ms, 2 s 11 ms and 1 s 13 ms
  an epoch, test accuracy 0.9965, 0.9956 and 0.9953 on 1, 2 and 4 GPUs; all of MNIST (60,000
  training and 10,000 test images) split between the GPUs, 24 epochs. Ours: the data named
  above on CPU ranks, {rows[0]["epochs"] if rows else "a few"} epochs: neither its times nor its
  accuracies are comparable with the paper's, and none is claimed above or below them; the
  speed-up and efficiency are what compare.
- This machine has {result["cores"]} CPU cores for every rank: N ranks of one thread can be
  at most min(N, {result["cores"]}) times as fast as one. Efficiency against linear at 4 ranks
  is therefore at most {min(4, result["cores"]) / 4:.2f} here; the last efficiency column
  divides by that bound instead, which is what this machine can show about Horovod's overhead
  (allreduce over the links, the ranks waiting for each other).
- Load average when it ended: {load} (the machine is shared: absolute times mean little; the
  order of the ranks alternated from seed to seed).
- Accuracy: the same epochs on more ranks take fewer, larger steps (global batch
  {result["batch_size"]} x ranks) with the learning rate scaled and warmed up, as Horovod
  recommends.
"""


EXPERIMENT = Experiment(
    name=NAME,
    seed="Horovod on cloud GPUs: MNIST on 1/2/4 GPUs, 4 s -> 1 s an epoch",
    measures="the MNIST CNN on 1, 2 and 4 ranks, one namespaced host and one thread each: "
    "time per epoch, samples/s, test accuracy, efficiency against linear",
    full_duration="about 10 minutes a seed on 2 cores (needs root: namespaced hosts); --quick 3-4",
    datasets=("mnist",),
    run=run,
)
