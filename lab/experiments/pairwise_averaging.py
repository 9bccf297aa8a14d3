"""Backward passes x network bytes x accuracy (seed: iterative pair-wise averaging).

For N workers (namespaced hosts, one rank each, Gloo over their veth links): full allreduce
of gradients every step (K = 1), local aggregation (``--backward-passes-per-step`` K = 2, 4),
and pairwise (gossip) weight averaging (``--sync pairwise``: each rank steps on its own
gradients and averages its weights with one rotating partner every step, or every 2 steps),
each pairwise cadence again with more epochs until it comes within one point of allreduce's
test accuracy. Bytes are measured on
each rank's link (its eth0 counters at epoch boundaries, Horovod's control loop subtracted),
beside the ring model's prediction; accuracy is on the full test split. Every configuration
is trained once per seed of ``--seeds`` and reported as the mean with its min-max over them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.experiments.base import (
    Experiment,
    ExperimentRequest,
    Pipeline,
    Sample,
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
from lab.netns import RankHosts, rank_hosts
from training.config import LaunchConfig, TrainConfig

NAME = "pairwise-averaging"
DATASET = "fashion-mnist"
MODEL = "cnn"
BATCH_SIZE = 32
# Full run: 3,000 training images evenly spread over Fashion-MNIST's 60,000 (a few seconds an
# epoch on 2 cores whatever N), and all of its 10,000 test images.
FULL_SAMPLE = Sample(train_rows=3_000, test_rows=10_000)
FULL_RANKS = (2, 3, 4, 6)
FULL_EPOCHS = 3
# Pairwise runs with this many times allreduce's epochs, in turn, until one comes within
# ACCURACY_GAP of allreduce's accuracy.
FULL_EPOCH_FACTORS = (1, 2)
# Quick: three ranks (the smallest N where pairwise should send less), two short epochs (the
# first carries rank 0's initial broadcast; bytes per step are measured on the second).
QUICK_SAMPLE = Sample(train_rows=960, test_rows=200)
QUICK_RANKS = (3,)
QUICK_EPOCHS = 2
QUICK_EPOCH_FACTORS = (1,)
# Allreduce with local aggregation of K backward passes per step.
FULL_PASSES = (1, 2, 4)
QUICK_PASSES = (1, 2)
# Pairwise averaging every this many steps (the bytes of allreduce K = 2 at every 2).
AVERAGE_EVERY = (1, 2)
# 12 equal row groups serve 2, 3, 4 and 6 ranks.
RANK_MULTIPLE = 12
ACCURACY_GAP = 0.01
# Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12 per frame (docs/cluster.md).
HEADER_BYTES = 66
# What varies from one seed's run to the next: each row reports their mean over the seeds with
# min, max and sd (report.folded). The ring model's bytes are metered payloads, the same every
# seed, folded all the same (an sd of 0 shows it).
MEASURES = (
    "bytes_per_step_per_rank",
    "bytes_per_step_without_headers",
    "predicted_bytes_per_step_per_rank",
    "total_bytes_all_ranks",
    "final_average_bytes_per_rank",
    "test_accuracy",
    "train_seconds",
)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One way of combining the ranks' work."""

    sync: str
    passes: int = 1
    average_every: int = 1
    epoch_factor: int = 1

    @property
    def label(self) -> str:
        if self.sync == "allreduce":
            return f"allreduce K={self.passes}"
        more = f", {self.epoch_factor}x epochs" if self.epoch_factor > 1 else ""
        return f"pairwise every {self.average_every}{more}"


def train_config(variant: Variant, num_ranks: int, epochs: int, seed: int = 0) -> TrainConfig:
    """One run of ``num_ranks`` ranks with ``seed``, all else equal."""
    return TrainConfig(
        seed=seed,
        num_ranks=num_ranks,
        epochs=epochs * variant.epoch_factor,
        batch_size=BATCH_SIZE,
        model=MODEL,
        backward_passes_per_step=variant.passes,
        sync=variant.sync,
        average_every=variant.average_every,
    )


def _wire(trained: TrainedModel) -> dict[str, Any]:
    """Bytes each rank sent on its link, from its epoch-boundary counters: per measured epoch
    (epoch 1, which carries the initial broadcast, is left out when there are more), the
    control loop's idle rate times the epoch's seconds subtracted."""
    wires = trained.wire_sent_by_rank
    assert wires, "every run of this experiment names its hosts' --network-interface"
    epochs = len(wires[0]["bytes_by_epoch"])
    measured = slice(1, None) if epochs > 1 else slice(0, None)
    per_epoch, without_headers, total = [], [], 0.0
    for wire in wires:
        idle = wire["idle_bytes"] / wire["idle_seconds"] if wire["idle_seconds"] else 0.0
        corrected = [
            b - idle * s
            for b, s in zip(wire["bytes_by_epoch"], wire["seconds_by_epoch"], strict=True)
        ]
        total += sum(corrected)
        chosen = corrected[measured]
        per_epoch.append(sum(chosen) / len(chosen))
        bare = [
            c - HEADER_BYTES * p
            for c, p in zip(chosen, wire["packets_by_epoch"][measured], strict=True)
        ]
        without_headers.append(sum(bare) / len(bare))
    return {
        "measured_epochs": list(range(measured.start + 1, epochs + 1)),
        "per_epoch_by_rank": per_epoch,
        "without_headers_by_rank": without_headers,
        "total_all_ranks": total,
    }


def row_of(variant: Variant, trained: TrainedModel, seed: int = 0) -> dict[str, Any]:
    """One seed's run: measured and predicted bytes, iterations, accuracy."""
    metrics = run_metrics(trained)
    num_ranks = trained.num_ranks
    steps = trained.steps_per_epoch
    epochs = trained.epochs
    model_bytes = int(metrics["gradient_values"]) * 4
    wire = _wire(trained)
    measured_epochs = [e - 1 for e in wire["measured_epochs"]]
    if variant.sync == "allreduce":
        # Ring allreduce: 2(N-1)/N of what each rank hands to Horovod (rank 0's, per epoch).
        assert trained.allreduce_bytes_by_epoch is not None  # every allreduce run meters it
        payload = [trained.allreduce_bytes_by_epoch[e] for e in measured_epochs]
        predicted = 2 * (num_ranks - 1) / num_ranks * sum(payload) / len(payload)
        final_average = 0.0
    else:
        # Two ranks: each sends its half, then the other half of the result: S per average.
        by_rank = [
            sum(r["bytes_by_epoch"][e] for e in measured_epochs) / len(measured_epochs)
            for r in metrics["pairwise_by_rank"]
        ]
        predicted = sum(by_rank) / len(by_rank)
        # The closing average of all ranks (outside the measured epochs): ring model.
        final_average = 2 * (num_ranks - 1) / num_ranks * metrics["final_average_bytes"]
    per_rank = sum(wire["per_epoch_by_rank"]) / num_ranks
    return {
        "variant": variant.label,
        "seed": seed,
        "sync": variant.sync,
        "num_ranks": num_ranks,
        "passes": variant.passes,
        "average_every": variant.average_every,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "iterations": steps * epochs,
        "model_bytes": model_bytes,
        "bytes_per_step_per_rank": per_rank / steps,
        "bytes_per_step_by_rank": [b / steps for b in wire["per_epoch_by_rank"]],
        "bytes_per_step_without_headers": sum(wire["without_headers_by_rank"]) / num_ranks / steps,
        "predicted_bytes_per_step_per_rank": predicted / steps,
        "measured_over_predicted": per_rank / predicted if predicted else None,
        "measured_epochs": wire["measured_epochs"],
        "total_bytes_all_ranks": wire["total_all_ranks"] + num_ranks * final_average,
        "final_average_bytes_per_rank": final_average,
        "test_accuracy": trained.test_accuracy,
        "test_rows": trained.test_rows,
        "train_seconds": trained.train_seconds,
        "dataset_version": trained.dataset_version,
        "model_version": trained.model_version,
    }


def folded_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One line of the table: one configuration's runs (one per seed) folded, each of
    :data:`MEASURES` their mean with its spread; the ratio measured / model is the ratio of the
    means, and the bytes of each rank the mean over the seeds."""
    row = folded(runs, MEASURES)
    predicted = row["predicted_bytes_per_step_per_rank"]
    row["measured_over_predicted"] = (
        row["bytes_per_step_per_rank"] / predicted if predicted else None
    )
    row["bytes_per_step_by_rank"] = [
        sum(values) / len(values)
        for values in zip(*(r["bytes_per_step_by_rank"] for r in runs), strict=True)
    ]
    return row


def within_gap(row: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether ``row``'s accuracy is within :data:`ACCURACY_GAP` of ``reference``'s (or above)."""
    return bool(row["test_accuracy"] >= reference["test_accuracy"] - ACCURACY_GAP)


def recovery(rows: list[dict[str, Any]], num_ranks: int, every: int = 1) -> dict[str, Any]:
    """For ``num_ranks``: the iterations pairwise averaging every ``every`` steps needed to
    come within one point of allreduce (K = 1), or that it did not within the runs made (the
    means over the seeds compared, their min-max beside them)."""
    reference = next(
        r for r in rows if r["num_ranks"] == num_ranks and r["sync"] == "allreduce" and
        r["passes"] == 1
    )  # fmt: skip
    pairwise = sorted(
        (
            r
            for r in rows
            if r["num_ranks"] == num_ranks
            and r["sync"] == "pairwise"
            and r["average_every"] == every
        ),
        key=lambda r: r["iterations"],
    )
    reached = next((r for r in pairwise if within_gap(r, reference)), None)
    return {
        "num_ranks": num_ranks,
        "average_every": every,
        "allreduce_accuracy": reference["test_accuracy"],
        "allreduce_accuracy_range": _range(reference, "test_accuracy"),
        "allreduce_iterations": reference["iterations"],
        "pairwise_iterations_tried": [r["iterations"] for r in pairwise],
        "pairwise_accuracies": [r["test_accuracy"] for r in pairwise],
        "pairwise_accuracy_ranges": [_range(r, "test_accuracy") for r in pairwise],
        "iterations_needed": reached["iterations"] if reached else None,
        "bytes_needed_all_ranks": reached["total_bytes_all_ranks"] if reached else None,
        "allreduce_bytes_all_ranks": reference["total_bytes_all_ranks"],
    }


def run(request: ExperimentRequest, pipeline: Pipeline) -> dict[str, Any]:
    """Every variant on every N, then the report into ``request.out``."""
    quick = request.quick
    ranks = QUICK_RANKS if quick else FULL_RANKS
    epochs = request.epochs or (QUICK_EPOCHS if quick else FULL_EPOCHS)
    factors = QUICK_EPOCH_FACTORS if quick else FULL_EPOCH_FACTORS
    passes = QUICK_PASSES if quick else FULL_PASSES
    pipeline.progress(f"{NAME}: ingest and preprocess {DATASET}")
    prepared = pipeline.prepare(
        DATASET,
        sample=QUICK_SAMPLE if quick else FULL_SAMPLE,
        synthetic_rows=0,
        rank_multiple=RANK_MULTIPLE,
    )
    seeds = request.seed_list
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []

    def configuration(
        variant: Variant, num_ranks: int, launch: LaunchConfig, hosts: RankHosts
    ) -> None:
        """``variant`` on ``num_ranks`` once per seed: its runs, and their row."""
        mine = []
        for seed in seeds:
            pipeline.progress(f"{NAME}: N={num_ranks}, {variant.label}, seed {seed}")
            config = train_config(variant, num_ranks, epochs, seed)
            mine.append(row_of(variant, pipeline.train(DATASET, config, launch, on=hosts), seed))
        runs.extend(mine)
        rows.append(folded_row(mine))

    with tempfile.TemporaryDirectory(prefix="shardflow-pairwise-") as folder:
        pipeline.progress(f"{NAME}: {max(ranks)} namespaced hosts with sshd, and a head")
        with rank_hosts(max(ranks), Path(folder) / "ssh") as hosts:
            # The most ranks first: the longest start-up and the most process sets fail early.
            for num_ranks in sorted(ranks, reverse=True):
                launch = hosts.launch_config(num_ranks)
                for k in passes:
                    configuration(Variant(sync="allreduce", passes=k), num_ranks, launch, hosts)
                reference = rows[-len(passes)]
                for every in AVERAGE_EVERY:
                    for factor in factors:
                        variant = Variant(sync="pairwise", average_every=every, epoch_factor=factor)
                        configuration(variant, num_ranks, launch, hosts)
                        # More epochs only while the mean over the seeds is short of allreduce's.
                        if within_gap(rows[-1], reference):
                            break
    rows.sort(key=lambda r: r["num_ranks"])  # stable: the run order within each N
    runs.sort(key=lambda r: r["num_ranks"])
    recoveries = [recovery(rows, n, every) for n in ranks for every in AVERAGE_EVERY]
    plots = _plots(request.out, rows)
    result = {
        "experiment": NAME,
        "quick": quick,
        "seeds": seeds,
        "rows": rows,
        "runs": runs,
        "recovery": recoveries,
        "epochs": epochs,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
        "source": prepared.source,
        "raw_version": prepared.raw_version,
        "processed_version": prepared.processed_version,
        "summary": [
            f"N={r['num_ranks']} {r['variant']}: {r['iterations']} iterations, "
            f"{_mb(r, 'bytes_per_step_per_rank', '.3f')} MB/step/rank (predicted "
            f"{r['predicted_bytes_per_step_per_rank'] / 1e6:.3f}), test accuracy "
            f"{with_spread(r, 'test_accuracy')}, seeds {_seeds(r)}, {r['model_version']}"
            for r in rows
        ],
        "plots": [str(p) for p in plots],
    }
    return write_results(request.out, result, render(result))


def _mb(row: dict[str, Any], key: str, fmt: str, scale: float = 1e6) -> str:
    """``row[key]`` over ``scale`` (bytes to MB), as :func:`with_spread` gives it."""
    scaled = {"seeds": row["seeds"]}
    for suffix in ("", "_min", "_max"):
        if key + suffix in row:
            scaled[key + suffix] = row[key + suffix] / scale
    return with_spread(scaled, key, fmt)


def _seeds(row: dict[str, Any]) -> str:
    return ", ".join(str(s) for s in row["seeds"])


def _range(row: dict[str, Any], key: str, scale: float = 1.0) -> tuple[float, float] | None:
    """The min-max of ``row[key]`` over its seeds (None for one seed)."""
    if len(row["seeds"]) < 2:
        return None
    return row[f"{key}_min"] / scale, row[f"{key}_max"] / scale


def _plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = sorted({r["passes"] for r in rows if r["sync"] == "allreduce"})
    markers = dict(zip((f"allreduce K={k}" for k in passes), "osD", strict=False))
    # Pairwise: a marker per cadence, hollow when the run had more epochs.
    cadence = dict(zip(AVERAGE_EVERY, "^v", strict=False))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ranks = sorted({r["num_ranks"] for r in rows})
    for row in rows:
        colour = colours[ranks.index(row["num_ranks"]) % len(colours)]
        more = row["sync"] == "pairwise" and row["epochs"] > rows[0]["epochs"]
        marker = markers.get(row["variant"], cadence.get(row["average_every"], "^"))
        x, y = row["total_bytes_all_ranks"] / 1e6, 100 * row["test_accuracy"]
        axes.scatter(x, y, color=colour, marker=marker, s=50,
                     facecolors="none" if more else colour)  # fmt: skip
        across, up = _range(row, "total_bytes_all_ranks", 1e6), _range(row, "test_accuracy", 0.01)
        if across and up:
            # The mean's min-max over the seeds, and each seed a dot.
            axes.errorbar(x, y, xerr=[[x - across[0]], [across[1] - x]],
                          yerr=[[y - up[0]], [up[1] - y]], color=colour, linewidth=0.8,
                          capsize=2)  # fmt: skip
            axes.scatter([b / 1e6 for b in row["total_bytes_all_ranks_by_seed"]],
                         [100 * a for a in row["test_accuracy_by_seed"]], color=colour,
                         s=6, alpha=0.6)  # fmt: skip
    for n in ranks:
        axes.scatter([], [], color=colours[ranks.index(n) % len(colours)], label=f"N={n}")
    for label, marker in [
        *markers.items(),
        *((f"pairwise every {e}", m) for e, m in cadence.items()),
    ]:
        axes.scatter([], [], color="grey", marker=marker, label=label)
    axes.scatter([], [], color="grey", marker="o", facecolors="none", label="more epochs")
    axes.set_xscale("log")
    axes.set_xlabel("network bytes, all ranks, whole run (MB, measured on veth)")
    axes.set_ylabel("test accuracy (%)")
    seeds = len(rows[0]["seeds"])
    axes.set_title(
        f"Network bytes vs accuracy: mean, min-max and each of {seeds} seeds"
        if seeds > 1
        else "Network bytes vs accuracy (one seed)"
    )
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    scatter = out / "bytes_vs_accuracy.png"
    figure.savefig(scatter, dpi=100)
    plt.close(figure)

    labels = list(markers) + [f"pairwise every {e}" for e in AVERAGE_EVERY]

    def series(key: str) -> dict[str, list[float | None]]:
        found = {(r["num_ranks"], r["variant"]): r[key] / 1e6 for r in rows}
        return {label: [found.get((n, label)) for n in ranks] for label in labels}

    measured = series("bytes_per_step_per_rank")
    predicted = series("predicted_bytes_per_step_per_rank")
    by_row = {(r["num_ranks"], r["variant"]): r for r in rows}
    spread: dict[str, Sequence[tuple[float, float] | None]] = {
        f"{label} measured": [
            _range(by_row[n, label], "bytes_per_step_per_rank", 1e6)
            if (n, label) in by_row
            else None
            for n in ranks
        ]
        for label in labels
    }
    bars = grouped_bars(
        out / "bytes_per_step.png",
        groups=[f"N={n}" for n in ranks],
        series={
            **{f"{k} measured": v for k, v in measured.items()},
            **{f"{k} ring model": v for k, v in predicted.items()},
        },
        title="MB per step per rank: measured (min-max over seeds) vs ring model",
        ylabel="MB per step per rank",
        spread=spread,
    )
    return [scatter, bars]


# 003's Table 2 (003_d8d632e3560979e7.txt): workers, backward passes, iterations, overall
# network activity (TB, docker stats summed over workers, driver and master every second) and
# accuracy, as printed (the bold rows are the paper's minimum-overhead ones).
PAPER_TABLE_2: tuple[tuple[int, int, int, str, str], ...] = (
    (2, 2, 12, "105.60", "95.81 %"),
    (2, 1, 15, "105.53", "**96.83 %**"),
    (3, 3, 12, "105.37", "91.43 %"),
    (3, 2, 15, "105.30", "91.85 %"),
    (3, 1, 18, "105.03", "95.41 %"),
    (4, 4, 12, "104.33", "78.49 %"),
    (4, 3, 15, "104.26", "87.27 %"),
    (4, 2, 18, "104.02", "89.02 %"),
    (4, 1, 21, "103.30", "**90.38 %**"),
    (5, 5, 12, "125.59", "80.334 %"),
    (5, 4, 15, "101.99", "90.70 %"),
    (5, 3, 18, "101.59", "89.10 %"),
    (5, 2, 21, "101.18", "89.72 %"),
    (5, 1, 24, "100.21", "89.23 %"),
    (6, 6, 12, "107.14", "66.87 %"),
    (6, 5, 15, "98.37", "90.09 %"),
    (6, 4, 18, "98.01", "90.40 %"),
    (6, 3, 21, "97.18", "91.97 %"),
    (6, 2, 24, "96.23", "86.45 %"),
    (6, 1, 27, "94.75", "94.43 %"),
)


def _paper_table() -> str:
    return markdown_table(
        ["workers", "passes", "iterations", "network activity TB (all hosts)", "accuracy"],
        [list(row) for row in PAPER_TABLE_2],
    )


def _total_bytes_lines(result: dict[str, Any]) -> list[str]:
    """Where pairwise, brought within 1 point of allreduce, sent more in all than allreduce."""
    lines = []
    for rec in result["recovery"]:
        needed, allreduce = rec.get("bytes_needed_all_ranks"), rec["allreduce_bytes_all_ranks"]
        if needed is None:
            continue
        ratio = needed / allreduce
        lines.append(
            f"- N={rec['num_ranks']}, every {rec.get('average_every', 1)}: "
            f"{needed / 1e6:.1f} MB against allreduce's {allreduce / 1e6:.1f} MB "
            f"({ratio:.2f} x: {'**more** in all' if ratio > 1 else 'less in all'})"
        )
    return lines


def _every_step_cut(rows: list[dict[str, Any]]) -> str:
    """Pairwise every step ÷ allreduce K=1, bytes per step per rank, over N > 2 (at N = 2 a
    pair is the whole ring)."""
    ratios = []
    for n in sorted({r["num_ranks"] for r in rows if r["num_ranks"] > 2}):
        ar = [r for r in rows if r["num_ranks"] == n and r["variant"] == "allreduce K=1"]
        pw = [
            r
            for r in rows
            if r["num_ranks"] == n and r["sync"] == "pairwise" and r["average_every"] == 1
        ]
        if ar and pw:
            ratios.append(pw[0]["bytes_per_step_per_rank"] / ar[0]["bytes_per_step_per_rank"])
    if not ratios:
        return "no run of more than 2 ranks averaging every step"
    return (
        f"per step per rank, averaging every step at N > 2: {min(ratios):.2f}-{max(ratios):.2f} x "
        "allreduce's; at N = 2 a pair is the whole ring"
    )


def _percent(accuracy: float, spread: Sequence[float] | None) -> str:
    """An accuracy in per cent, with its min-max over the seeds where there are several."""
    if not spread:
        return f"{100 * accuracy:.2f} %"
    return f"{100 * accuracy:.2f} % ({100 * spread[0]:.2f}-{100 * spread[1]:.2f})"


def _seed_note(rows: list[dict[str, Any]]) -> str:
    """How many seeds each row is over, and how far its accuracy spread."""
    seeds = rows[0]["seeds"]
    if len(seeds) < 2:
        return (
            "One seed per configuration (seed 0; `--seeds N` trains each with seeds 0..N-1): "
            "no spread, so differences of a few tenths of a point are within run-to-run noise "
            "(10,000 test images: a standard error of about 0.35 points at 85 %)."
        )
    widths = [100 * (r["test_accuracy_max"] - r["test_accuracy_min"]) for r in rows]
    sds = [100 * r["test_accuracy_sd"] for r in rows]
    wire = [
        (r["bytes_per_step_per_rank_max"] - r["bytes_per_step_per_rank_min"])
        / r["bytes_per_step_per_rank"]
        for r in rows
    ]
    return (
        f"Every row is the mean over {len(seeds)} seeds ({_seeds(rows[0])}: the training seed "
        "of every rank, `TrainConfig.seed`), its min-max in brackets, each seed's value and "
        "the sd in results.json (`rows`; each seed's own row under `runs`). The test accuracy "
        f"spread (max - min) over the seeds is {min(widths):.2f}-{max(widths):.2f} points "
        f"across the rows (sd {min(sds):.2f}-{max(sds):.2f}); the bytes per step measured, by "
        f"at most {100 * max(wire):.1f} % of their mean. Ratios (measured / model, "
        "pairwise / allreduce, whole-run bytes) and the 1-point test compare the means."
    )


def render(result: dict[str, Any]) -> str:
    """report.md: the table in the paper's shape, the ring model beside it, the recovery."""
    rows = result["rows"]
    table = markdown_table(
        [
            "workers",
            "sync / passes",
            "epochs",
            "iterations",
            "seeds",
            "MB/step/rank measured",
            "MB/step/rank ring model",
            "measured / model",
            "MB all ranks, whole run",
            "test accuracy",
            "train s",
            "model versions (by seed)",
        ],
        [
            [
                r["num_ranks"],
                "allreduce K=" + str(r["passes"])
                if r["sync"] == "allreduce"
                else f"pairwise every {r['average_every']}",
                r["epochs"],
                r["iterations"],
                _seeds(r),
                _mb(r, "bytes_per_step_per_rank", ".3f"),
                round(r["predicted_bytes_per_step_per_rank"] / 1e6, 3),
                round(r["measured_over_predicted"], 3) if r["measured_over_predicted"] else "-",
                _mb(r, "total_bytes_all_ranks", ".1f"),
                with_spread(r, "test_accuracy"),
                with_spread(r, "train_seconds", ".1f"),
                ", ".join(f"`{v}`" for v in r.get("model_versions", [r["model_version"]])),
            ]
            for r in rows
        ],
    )
    recovery_lines = []
    for rec in result["recovery"]:
        tried = ", ".join(
            f"{i} iterations: {_percent(a, spread)}"
            for i, a, spread in zip(
                rec["pairwise_iterations_tried"],
                rec["pairwise_accuracies"],
                rec.get("pairwise_accuracy_ranges") or [None] * len(rec["pairwise_accuracies"]),
                strict=True,
            )
        )
        if rec["iterations_needed"] is not None:
            verdict = (
                f"within 1 point after **{rec['iterations_needed']} iterations** "
                f"({rec['iterations_needed'] / rec['allreduce_iterations']:.1f} x allreduce's), "
                f"{rec['bytes_needed_all_ranks'] / 1e6:.1f} MB against allreduce's "
                f"{rec['allreduce_bytes_all_ranks'] / 1e6:.1f} MB"
            )
        else:
            verdict = "**not within 1 point** in the iterations tried"
        every = rec.get("average_every", 1)
        allreduce = _percent(rec["allreduce_accuracy"], rec.get("allreduce_accuracy_range"))
        recovery_lines.append(
            f"- N={rec['num_ranks']}, pairwise every {every}: allreduce "
            f"{allreduce} after {rec['allreduce_iterations']} "
            f"iterations; pairwise {tried}: {verdict}"
        )
    fewer = []
    for n in sorted({r["num_ranks"] for r in rows}):
        ar = next(r for r in rows if r["num_ranks"] == n and r["variant"] == "allreduce K=1")
        # Each cadence's run with allreduce's epochs (the first made).
        first: dict[int, dict[str, Any]] = {}
        for r in rows:
            if r["num_ranks"] == n and r["sync"] == "pairwise":
                first.setdefault(r["average_every"], r)
        ratios = ", ".join(
            f"every {every}: {pw['bytes_per_step_per_rank'] / ar['bytes_per_step_per_rank']:.3f}"
            for every, pw in sorted(first.items())
        )
        fewer.append(f"- N={n}: pairwise/allreduce K=1 bytes per step per rank, {ratios}")
    quick = (
        "\n**Quick run** (`--quick`): 960 training images, three ranks, two short epochs, no "
        "K=4. It checks every stage and the bytes; its accuracies say nothing.\n"
        if result["quick"]
        else ""
    )
    return f"""# Backward passes x network bytes x accuracy (seed: iterative pair-wise averaging)
{quick}
The `cnn` on {result["source"]} (processed `{result["processed_version"]}`), N workers,
each a namespaced host of its own (one Horovod rank, Gloo over its veth link, horovodrun in a
head host over ssh), batch {BATCH_SIZE} per rank, {result["epochs"]} epochs unless more are
said; every row trained with seeds {_seeds(rows[0])} (the mean, min-max in brackets).
Accuracy: the committed model version on the whole test split ({rows[0]["test_rows"]:,} images).

- **allreduce K=1**: gradients averaged over all ranks every step (Horovod's
  DistributedOptimizer); **K=2, K=4**: local aggregation (`--backward-passes-per-step`), one
  allreduce per K backward passes, each pass a batch of {BATCH_SIZE}.
- **pairwise every E** (E = {", ".join(str(e) for e in AVERAGE_EVERY)}): no gradient
  allreduce; each rank steps on its own gradients, and every E steps averages its weights
  (BN statistics included; Adam's moments stay local) with one partner on a Horovod process
  set of the two (`--sync pairwise`, `training.gossip`); partners rotate
  (circle-method 1-factorisation: N-1 rounds, N odd: N rounds with one rank sitting out).
  The model version is the mean of all ranks' weights at the end (one allreduce, counted in
  the whole-run bytes from the ring model: it falls outside the measured epochs).
- Each pairwise cadence runs again with {", ".join(f"{f}x" for f in FULL_EPOCH_FACTORS[1:])}
  the epochs when it is more than one point below allreduce K=1 (more iterations, as the
  paper does).

{table}

Bytes: each rank's eth0 counters at epoch boundaries (`wire_sent_by_rank`), Horovod's control
loop subtracted (its idle rate times the epoch's time), mean over ranks and over epochs
{", ".join(str(e) for e in rows[0]["measured_epochs"])} (epoch 1 also carries rank 0's initial
broadcast), divided by the batches of an epoch. Framing counted: every TCP segment a frame of
its own (66 bytes of headers per ≤ 1448 bytes, +4.6 %, plus ACKs). Ring model: allreduce
2(N-1)/N x S per allreduce (S = {rows[0]["model_bytes"]:,} bytes of fp32 gradients), K
times fewer allreduces with K passes; pairwise: a 2-rank allreduce of the S weight bytes sends
S per rank per average, E times fewer averages every E steps, and with N odd each rank sits
out one round in N. "Whole run": all
ranks, every epoch (broadcast included), plus the closing average for pairwise.

Pairwise against allreduce, bytes per step per rank (measured; ratios of the means over the
seeds):

{chr(10).join(fewer)}

Iterations pairwise averaging needed to come within 1 point of allreduce K=1's accuracy (the
means over the seeds compared; min-max in brackets):

{chr(10).join(recovery_lines)}

So pairwise exchange cut the bytes of each exchange ({_every_step_cut(rows)}), but
the accuracy it lost had to be bought back with more iterations, and in all it sent (whole run,
all ranks, to within 1 point of allreduce K=1; means over the seeds):

{chr(10).join(_total_bytes_lines(result))}

![bytes vs accuracy](bytes_vs_accuracy.png)
![bytes per step](bytes_per_step.png)

## What differs from the paper

- The seed's own figures, its Table 2 (003_d8d632e3560979e7.txt), as printed:

{_paper_table()}

  Its setup: a Spark cluster in docker (driver, master, 2-6 workers), Horovod with PyTorch, a
  3-convolution network on a subset of MNIST; network activity is docker's counters of every
  container summed each second (terabytes: the paper says only relative sizes mean anything).
  Ours: Fashion-MNIST (3,000 training images), Keras, namespaced hosts on one machine, bytes
  from each rank's eth0. Its "passes" are Horovod's backward passes per step; its rows raise
  the iterations as the passes fall. The two tables share their shape, not their units or
  data: no figure of ours is claimed above or below one of its. Where both see the same thing:
  fewer exchanges cost accuracy at equal iterations, and more iterations buy it back.
- {result["cores"]} CPU cores shared by all ranks (no GPU); a veth bridge instead of a
  network. Times are not compared, bytes and accuracy are.
- {_seed_note(rows)}
- The learning rate is scaled by N and warmed up over the first epoch in every variant (Adam,
  0.001 per rank); pairwise ranks take steps of one rank's batch at that rate.
- A subset of the training images (evenly spread over the 60,000) keeps the 2-6 rank runs
  within minutes on this machine; the test split is whole.
"""


EXPERIMENT = Experiment(
    name=NAME,
    seed="iterative pair-wise averaging",
    measures="2-6 namespaced hosts: allreduce (K=1, 2, 4 backward passes per step) vs "
    "pairwise (gossip) weight averaging every 1 and 2 steps on Horovod process sets: bytes "
    "per step on the veth links (beside the ring model), iterations, test accuracy; "
    "iterations pairwise needs to come within 1 point",
    full_duration="about 8 minutes a seed on 2 otherwise idle cores (31 with --seeds 3), 40 "
    "a seed at load 12 (3,000 Fashion-MNIST images, N = 2, 3, 4, 6, 3 epochs, each pairwise "
    "cadence again at 6 when short); --quick 1-3 minutes a seed (N = 3: K = 1, 2, pairwise "
    "every 1, 2)",
    datasets=(DATASET,),
    run=run,
)
