"""The parts of a results folder every experiment writes: a markdown table, PNG bar plots,
results.json."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    numeric = [all(isinstance(row[i], int | float) for row in rows) for i in range(len(header))]
    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def grouped_bars(
    path: Path,
    *,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
    title: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    spread: dict[str, Sequence[tuple[float, float] | None]] | None = None,
) -> Path:
    """A PNG of bars: one cluster per group, one bar per series (None: no bar); ``spread``
    draws each bar's (low, high) over its runs (seeds) as an error bar where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / max(len(series), 1)
    figure, axes = plt.subplots(figsize=(7, 4))
    for number, (label, values) in enumerate(series.items()):
        xs = [g + (number - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        bars = axes.bar([x for x, _ in shown], [v for _, v in shown], width, label=label)
        axes.bar_label(bars, fmt="%.3g", fontsize=7)
        ranges = (spread or {}).get(label)
        if ranges is not None:
            marked = [
                (x, v, r)
                for x, v, r in zip(xs, values, ranges, strict=True)
                if v is not None and r is not None
            ]
            axes.errorbar(
                [x for x, _v, _r in marked],
                [v for _x, v, _r in marked],
                yerr=[[v - r[0] for _x, v, r in marked], [r[1] - v for _x, v, r in marked]],
                fmt="none",
                ecolor="black",
                capsize=3,
                linewidth=1,
            )
    axes.set_xticks(range(len(groups)), list(groups))
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    if ylim is not None:
        axes.set_ylim(*ylim)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_results(out: Path, result: dict[str, Any], report: str) -> dict[str, Any]:
    """report.md and results.json into ``out``; returns ``result`` with their paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report)
    result = {**result, "report": str(out / "report.md"), "results": str(out / "results.json")}
    (out / "results.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    return result


def folded(runs: Sequence[dict[str, Any]], measures: Sequence[str]) -> dict[str, Any]:
    """One table row of the same configuration trained with several seeds (``runs``, each a
    row with its ``seed``): the first run's row, each of ``measures`` replaced by its mean over
    the runs, with ``<measure>_by_seed``, ``_min``, ``_max`` and ``_sd`` (the sample standard
    deviation; 0 for one run) beside it; ``seeds`` lists the seeds and, where the runs name
    their model versions, ``model_versions`` lists them (``model_version`` stays the first).
    A measure a run lacks (None) is left out of its mean."""
    if not runs:
        raise ValueError("no runs to fold")
    row = dict(runs[0])
    row["seeds"] = [int(r.get("seed", i)) for i, r in enumerate(runs)]
    row.pop("seed", None)
    if all("model_version" in r for r in runs):
        row["model_versions"] = [r["model_version"] for r in runs]
    for key in measures:
        values = [float(r[key]) for r in runs if r.get(key) is not None]
        if not values:
            continue
        row[key] = statistics.fmean(values)
        row[f"{key}_by_seed"] = [r.get(key) for r in runs]
        row[f"{key}_min"] = min(values)
        row[f"{key}_max"] = max(values)
        row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return row


def with_spread(row: dict[str, Any], key: str, fmt: str = ".4f") -> str:
    """``row[key]`` as text: one run's value, or the mean with its min-max over the seeds."""
    value = row[key]
    if f"{key}_min" not in row or len(row.get("seeds", [])) < 2:
        return format(value, fmt)
    low, high = format(row[f"{key}_min"], fmt), format(row[f"{key}_max"], fmt)
    return f"{format(value, fmt)} ({low}-{high})"
