"""One model version's view, from ingest to every rank's input, as a static HTML page.

    catalog.lineage(model) ─► model manifest (statistics: metrics.json, input_by_rank)
                            └► processed manifest (shards, rows, quarantine)
                                └► raw manifest (files, rows, bytes)
                                        │
                                        ▼
                              render_html(): the figures as plain values (flags from
                              summarize() again, with today's thresholds; each epoch's and
                              rolling window's figures; a PNG bar chart per rank, base64)
                                        │
                                        ▼
                              templates/report.html (jinja2, every value autoescaped)
                                        ─► report.html

Everything comes from the catalog's manifests: the report of any committed version can be
written again, wherever its run folder went.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import markupsafe

from data_catalog import Catalog, Manifest, ShardflowError
from data_catalog.layout import ProcessedLayout
from training.input_metrics import INPUT_BOUND_THRESHOLD, summarize

REPORT_NAME = "report.html"


@dataclass(frozen=True, kw_only=True)
class ReportInputs:
    """The manifests one report shows: the model version and its ancestors."""

    model: Manifest
    processed: Manifest | None
    raw: Manifest | None
    lineage: dict[str, Any]


def gather(catalog: Catalog, name: str, version: str | None = None) -> ReportInputs:
    """The model version ``name@version`` (the latest when None) and its ancestors, found
    through the catalog's lineage."""
    lineage = catalog.lineage(name, version)
    model = catalog.get(lineage["name"], lineage["version"])

    def first_of(node: dict[str, Any], kind: str) -> Manifest | None:
        for parent in node.get("parents", []):
            if parent.get("missing"):
                continue
            if parent.get("kind") == kind:
                return catalog.get(parent["name"], parent["version"])
            found = first_of(parent, kind)
            if found is not None:
                return found
        return None

    return ReportInputs(
        model=model,
        processed=first_of(lineage, "processed"),
        raw=first_of(lineage, "raw"),
        lineage=lineage,
    )


def rank_chart_png(input_by_rank: Sequence[dict[str, Any]]) -> bytes | None:
    """A bar chart per rank (input-bound %, mean step ms, input ms per batch) as PNG bytes;
    None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [str(r["rank"]) for r in input_by_rank]
    panels = (
        ("input-bound %", [100 * r["input_bound"] for r in input_by_rank]),
        ("mean step (ms)", [1000 * r["mean_step_seconds"] for r in input_by_rank]),
        ("input per batch (ms)", [1000 * r["input_seconds_per_batch"] for r in input_by_rank]),
    )
    figure, axes = plt.subplots(1, len(panels), figsize=(10, 3))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(ranks, values, color="tab:blue")
        ax.set(title=title, xlabel="rank")
    # The input-bound threshold (summarize's default).
    axes[0].axhline(100 * INPUT_BOUND_THRESHOLD, color="tab:red", linestyle="--")
    axes[0].set_ylim(0, 100)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def _raw_view(raw: Manifest | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    total_bytes = sum(f.bytes for f in raw.files)
    run = _run_facts(raw)
    read = max((int(p.get("input_bytes", 0)) for p in run.get("passes", {}).values()), default=0)
    seconds = float(run.get("seconds") or 0)
    # Sources whose sizes are known only once fetched (downloads): the bytes it stored.
    read, what = (read, "read") if read else (total_bytes, "stored")
    rate = (
        f"{read / 1e6 / seconds:.1f} ({what} {read / 1e6:,.1f} MB in {seconds:.1f} s)"
        if seconds
        else "not recorded (ingested before runs were recorded)"
    )
    return {
        "ref": _ref(raw),
        "facts": [
            ("files", len(raw.files)),
            ("rows", f"{raw.rows:,}"),
            ("MB", f"{total_bytes / 1e6:.1f}"),
            ("MB/s", rate),
            ("tasks", _tasks(run)),
            ("created", str(raw.created)),
        ],
        "sources": [str(s.get("uri", s)) for s in raw.sources],
    }


def _run_facts(manifest: Manifest) -> dict[str, Any]:
    """What the driver noted about the run that committed ``manifest`` (wall seconds, tasks
    per pass), or {} for versions committed before it did."""
    run = manifest.extra.get("run")
    return run if isinstance(run, dict) else {}


def _tasks(run: dict[str, Any]) -> str:
    passes = run.get("passes", {})
    if not passes:
        return "not recorded"
    return "; ".join(
        f"{name}: {int(p['tasks'])} in {float(p['seconds']):.1f} s"
        + (f" ({int(p['reused'])} reused from an interrupted run)" if p.get("reused") else "")
        for name, p in passes.items()
    )


def _ref(manifest: Manifest) -> str:
    return f"{manifest.name}@{manifest.version}"


def _processed_view(processed: Manifest | None) -> dict[str, Any] | None:
    if processed is None:
        return None
    layout = ProcessedLayout.of(processed)
    facts: list[tuple[str, Any]] = [
        ("parent", str(processed.parents[0]) if processed.parents else ""),
        ("shards (files)", len(processed.files)),
        ("rows", f"{processed.rows:,}"),
        ("rows in", f"{layout.rows_in:,}"),
        ("quarantined rows", f"{layout.quarantine.rows:,}" if layout.quarantine else "0"),
        ("format", layout.format),
        ("tasks", _tasks(_run_facts(processed))),
    ]
    facts += [
        (
            f"{name} split",
            f"{split.rows:,} rows, {split.num_row_groups} row groups of {split.rows_per_group}",
        )
        for name, split in layout.splits.items()
    ]
    return {"ref": _ref(processed), "facts": facts}


def recorded_input_by_rank(model: Manifest) -> list[dict[str, Any]]:
    """Each rank's input and step figures as rank 0 recorded them in the model version's
    metrics (``metrics.json``, its statistics); [] for versions trained before they were."""
    metrics: dict[str, Any] = model.statistics
    return list(metrics.get("input_by_rank") or [])


RANK_HEADER = (
    "rank",
    "input rows/s",
    "rows/s",
    "batches/s",
    "input-bound",
    "mean step ms",
    "max step ms",
    "input ms/batch",
    "MB read",
    "row groups read",
    "flags",
)


def _ranks_view(model: Manifest, chart: bytes | None) -> dict[str, Any] | None:
    input_by_rank = recorded_input_by_rank(model)
    if not input_by_rank:
        return None
    # The flags again from the records: a version trained before a threshold changed shows
    # today's judgement (the records, not the flags, are what was measured).
    summary = summarize(input_by_rank)
    flags = summary["flags"]
    rows = [
        {
            "cells": [
                r["rank"],
                f"{r['input_rows_per_second']:,.0f}",
                f"{r['rows_per_second']:,.0f}",
                f"{r['batches_per_second']:.1f}",
                f"{100 * r['input_bound']:.0f}%",
                f"{1000 * r['mean_step_seconds']:.1f}",
                f"{1000 * r['max_step_seconds']:.1f}",
                f"{1000 * r['input_seconds_per_batch']:.1f}",
                f"{r['bytes_read'] / 1e6:.1f}",
                r["row_groups_read"],
            ],
            "flags": flags.get(str(r["rank"]), []),
        }
        for r in input_by_rank
    ]

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "n/a"

    return {
        "summary": {
            "slowest_rank": summary["slowest_rank"],
            "slowest_flagged": summary["slowest_flagged"],
            "input_imbalance": ratio(summary["input_imbalance"]),
            "step_imbalance": ratio(summary["step_imbalance"]),
            "input_bound_percent": f"{100 * summary['input_bound_threshold']:.0f}",
            "slowest_imbalance": f"{summary['slowest_imbalance']:g}",
            "slowest_min_input_bound_percent": f"{100 * summary['slowest_min_input_bound']:.0f}",
            "stall_steps": summary["stall_steps"],
            "stall_factor": f"{summary['stall_factor']:g}",
            "median_step_ms": f"{1000 * summary['median_step_seconds']:.1f}",
            "stall_seconds": f"{summary['stall_seconds']:g}",
        },
        "header": RANK_HEADER,
        "rows": rows,
        "chart": base64.b64encode(chart).decode() if chart else None,
        "epochs": _epochs_view(input_by_rank),
    }


def _epochs_view(input_by_rank: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Each epoch of each rank, with its rolling window as of the epoch's end."""
    rows = []
    window = None
    for r in input_by_rank:
        for e in r.get("epochs", []):
            rolling = e.get("rolling")
            window = window or (rolling or {}).get("window")
            step_seconds = e["step_seconds"]
            rows.append(
                [
                    e["epoch"] + 1,
                    r["rank"],
                    f"{e['rows'] / step_seconds:,.0f}" if step_seconds > 0 else "n/a",
                    f"{100 * e['input_bound']:.0f}%",
                    f"{1000 * step_seconds / e['timed_steps']:.1f}" if e["timed_steps"] else "n/a",
                    f"{rolling['rows_per_second']:,.0f}" if rolling else "n/a",
                    f"{100 * rolling['input_bound']:.0f}%" if rolling else "n/a",
                    f"{1000 * rolling['mean_step_seconds']:.1f}" if rolling else "n/a",
                ]
            )
    if not rows:
        return None
    rows.sort(key=lambda row: (row[0], row[1]))
    return {
        "window": window or "n/a",
        "header": (
            "epoch",
            "rank",
            "rows/s",
            "input-bound",
            "mean step ms",
            "window rows/s",
            "window input-bound",
            "window mean step ms",
        ),
        "rows": rows,
    }


def _lineage_tree(node: dict[str, Any]) -> dict[str, Any]:
    return {
        "label": f"{node['name']}@{node['version']}",
        "kind": "missing from the catalog" if node.get("missing") else node.get("kind", ""),
        "parents": [_lineage_tree(p) for p in node.get("parents", [])],
    }


STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1200px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
td:first-child { text-align: left; }
table.facts th { text-align: left; font-weight: normal; color: #555; }
table.facts td { text-align: left; }
.columns { display: flex; gap: 2em; flex-wrap: wrap; }
.flag { background: #c0392b; color: white; border-radius: 3px; padding: 0 0.4em; margin: 0 2px; }
code { background: #f4f4f4; }
"""


def _template() -> jinja2.Template:
    """templates/report.html, every value autoescaped (names, notes and paths come from the
    catalog and may hold anything); a name the template uses but the context lacks fails."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("training", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    return environment.get_template("report.html")


def render_html(inputs: ReportInputs) -> str:
    """The page: every rank's input, then the ingest, preprocess and model, and the lineage."""
    model = inputs.model
    metrics = model.statistics
    run_dir = model.extra.get("run_dir")
    input_by_rank = recorded_input_by_rank(model)
    chart = rank_chart_png(input_by_rank) if input_by_rank else None
    accuracy = metrics.get("test_accuracy")
    return _template().render(
        title=_ref(model),
        style=markupsafe.Markup(STYLE),  # this module's constant, not data
        chain=[_ref(m) for m in (model, inputs.processed, inputs.raw) if m],
        run_dir=str(run_dir),
        ranks=_ranks_view(model, chart),
        raw=_raw_view(inputs.raw),
        processed=_processed_view(inputs.processed),
        model={
            "ref": _ref(model),
            "facts": [
                ("ranks", metrics.get("num_ranks", "")),
                ("epochs", metrics.get("epochs", "")),
                ("steps per epoch", metrics.get("steps_per_epoch", "")),
                ("test accuracy", f"{accuracy:.4f}" if accuracy is not None else "n/a"),
                ("run folder", str(run_dir) if run_dir else "not recorded"),
            ],
            "timeline": str(Path(run_dir) / "timeline.json") if run_dir else None,
            "tensorboard": str(Path(run_dir) / "tensorboard") if run_dir else None,
        },
        lineage_tree=_lineage_tree(inputs.lineage),
    )


def write_report(catalog: Catalog, name: str, version: str | None, out: Path | None) -> Path:
    """Write the report of ``name@version`` to ``out`` (a file), or to report.html in the
    version's run folder when ``out`` is None; returns the path written."""
    inputs = gather(catalog, name, version)
    if out is None:
        run_dir = inputs.model.extra.get("run_dir")
        if not run_dir or not Path(run_dir).is_dir():
            raise ShardflowError(
                f"the run folder of {inputs.model.name}@{inputs.model.version} "
                f"({run_dir or 'not recorded'}) is gone; name a file to write with --out"
            )
        out = Path(run_dir) / REPORT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(inputs))
    return out
