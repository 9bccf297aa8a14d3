"""The parts of a results folder every experiment writes: a markdown table, PNG bar plots,
results.json."""

from __future__ import annotations

import json
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
            marked = [(x, v, r) for x, v, r in zip(xs, values, ranges, strict=True) if v and r]
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
