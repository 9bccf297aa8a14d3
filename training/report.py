"""One model version's view, from ingest to every rank's input, as a static HTML page.

    catalog.lineage(model) ─► model manifest (statistics: metrics.json, input_by_rank)
                            └► processed manifest (shards, rows, quarantine)
                                └► raw manifest (files, rows, bytes)
                                        │
                                        ▼
                              render_html(): tables, flags (summarize() again, with
                              today's thresholds), each epoch's and rolling window's
                              figures, a PNG bar chart per rank (base64, inline)
                                        ─► report.html

Everything comes from the catalog's manifests: the report of any committed version can be
written again, wherever its run folder went.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _facts(rows: Sequence[Sequence[Any]]) -> str:
    """A two-column table of names and values."""
    body = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)
    return f'<table class="facts"><tbody>{body}</tbody></table>'


def _ref(manifest: Manifest) -> str:
    text = f"{manifest.name}@{manifest.version}"
    return f'<code id="{html.escape(text)}">{html.escape(text)}</code>'


def _raw_section(raw: Manifest | None) -> str:
    if raw is None:
        return "<h2>Ingest</h2><p>the raw version is not in the catalog</p>"
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
    rows: list[list[Any]] = [
        ["version", _ref(raw)],
        ["files", len(raw.files)],
        ["rows", f"{raw.rows:,}"],
        ["MB", f"{total_bytes / 1e6:.1f}"],
        ["MB/s", rate],
        ["tasks", _tasks(run)],
        ["created", html.escape(str(raw.created))],
        ["sources", "<br>".join(html.escape(str(s.get("uri", s))) for s in raw.sources)],
    ]
    return "<h2>Ingest</h2>" + _facts(rows)


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


def _processed_section(processed: Manifest | None) -> str:
    if processed is None:
        return "<h2>Preprocess</h2><p>the processed version is not in the catalog</p>"
    layout = ProcessedLayout.of(processed)
    rows: list[list[Any]] = [
        ["version", _ref(processed)],
        ["parent", html.escape(str(processed.parents[0])) if processed.parents else ""],
        ["shards (files)", len(processed.files)],
        ["rows", f"{processed.rows:,}"],
        ["rows in", f"{layout.rows_in:,}"],
        ["quarantined rows", f"{layout.quarantine.rows:,}" if layout.quarantine else "0"],
        ["format", html.escape(layout.format)],
        ["tasks", _tasks(_run_facts(processed))],
    ]
    rows += [
        [
            f"{name} split",
            f"{split.rows:,} rows, {split.num_row_groups} row groups of {split.rows_per_group}",
        ]
        for name, split in layout.splits.items()
    ]
    return "<h2>Preprocess</h2>" + _facts(rows)


def recorded_input_by_rank(model: Manifest) -> list[dict[str, Any]]:
    """Each rank's input and step figures as rank 0 recorded them in the model version's
    metrics (``metrics.json``, its statistics); [] for versions trained before they were."""
    metrics: dict[str, Any] = model.statistics
    return list(metrics.get("input_by_rank") or [])


def _ranks_section(model: Manifest, chart: bytes | None) -> str:
    input_by_rank = recorded_input_by_rank(model)
    if not input_by_rank:
        return "<h2>Ranks</h2><p>no per-rank input metrics were recorded for this version</p>"
    # The flags again from the records: a version trained before a threshold changed shows
    # today's judgement (the records, not the flags, are what was measured).
    summary = summarize(input_by_rank)
    flags = summary["flags"]
    rows = []
    for r in input_by_rank:
        mine = flags.get(str(r["rank"]), [])
        rows.append(
            [
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
                " ".join(f'<span class="flag">{html.escape(f)}</span>' for f in mine) or "ok",
            ]
        )

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "n/a"

    picture = (
        f'<img alt="per-rank input" src="data:image/png;base64,{base64.b64encode(chart).decode()}">'
        if chart
        else ""
    )
    return (
        "<h2>Ranks</h2>"
        f"<p>slowest rank: <b>{summary['slowest_rank']}</b>"
        + ("" if summary["slowest_flagged"] else " (not flagged)")
        + f"; input imbalance "
        f"(slowest/fastest input time per batch) {ratio(summary['input_imbalance'])}; step "
        f"imbalance (slowest/fastest mean step) {ratio(summary['step_imbalance'])}; a rank is "
        f"input-bound above {100 * summary['input_bound_threshold']:.0f}%, slowest when its "
        f"input time per batch is at least {summary['slowest_imbalance']:g} times the fastest "
        f"rank's and it is at least {100 * summary['slowest_min_input_bound']:.0f}% "
        f"input-bound, stalled when {summary['stall_steps']} of its steps took over "
        f"{summary['stall_factor']:g} times the median step "
        f"({1000 * summary['median_step_seconds']:.1f} ms) or one of them "
        f"{summary['stall_seconds']:g} s or more</p>"
        + _table(
            [
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
            ],
            rows,
        )
        + picture
        + _epochs_table(input_by_rank)
    )


def _epochs_table(input_by_rank: Sequence[dict[str, Any]]) -> str:
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
        return ""
    rows.sort(key=lambda row: (row[0], row[1]))
    return (
        "<h2>Epochs</h2>"
        f"<p>each rank's epochs, and its rolling window (its last {window or 'n/a'} steps) as "
        "of each epoch's end</p>"
        + _table(
            [
                "epoch",
                "rank",
                "rows/s",
                "input-bound",
                "mean step ms",
                "window rows/s",
                "window input-bound",
                "window mean step ms",
            ],
            rows,
        )
    )


def _lineage_list(node: dict[str, Any]) -> str:
    label = f"{node['name']}@{node['version']}"
    kind = "missing from the catalog" if node.get("missing") else node.get("kind", "")
    children = "".join(_lineage_list(p) for p in node.get("parents", []))
    return (
        f'<li><a href="#{html.escape(label)}">{html.escape(label)}</a> ({html.escape(kind)})'
        + (f"<ul>{children}</ul>" if children else "")
        + "</li>"
    )


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


def render_html(inputs: ReportInputs) -> str:
    """The page: every rank's input, then the ingest, preprocess and model, and the lineage."""
    model = inputs.model
    metrics = model.statistics
    run_dir = model.extra.get("run_dir")
    input_by_rank = recorded_input_by_rank(model)
    chart = rank_chart_png(input_by_rank) if input_by_rank else None
    facts = [
        ["version", _ref(model)],
        ["ranks", metrics.get("num_ranks", "")],
        ["epochs", metrics.get("epochs", "")],
        ["steps per epoch", metrics.get("steps_per_epoch", "")],
        [
            "test accuracy",
            f"{metrics['test_accuracy']:.4f}" if "test_accuracy" in metrics else "n/a",
        ],
        ["run folder", html.escape(str(run_dir)) if run_dir else "not recorded"],
    ]
    if run_dir:
        facts.append(
            [
                "Horovod timeline, TensorBoard",
                f"<code>{html.escape(str(Path(run_dir) / 'timeline.json'))}</code> (with "
                f"--timeline); <code>tensorboard --logdir "
                f"{html.escape(str(Path(run_dir) / 'tensorboard'))}</code> (rank-K: input)",
            ]
        )
    title = f"{model.name}@{model.version}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        + "<p>"
        + " ← ".join(
            f'<a href="#{html.escape(ref)}">{html.escape(ref)}</a>'
            for ref in (f"{m.name}@{m.version}" for m in (model, inputs.processed, inputs.raw) if m)
        )
        + f" (run folder <code>{html.escape(str(run_dir))}</code>)</p>"
        + _ranks_section(model, chart)
        + '<div class="columns"><div>'
        + _raw_section(inputs.raw)
        + "</div><div>"
        + _processed_section(inputs.processed)
        + "</div><div><h2>Model</h2>"
        + _facts(facts)
        + "</div></div>"
        + f"<h2>Lineage</h2><ul>{_lineage_list(inputs.lineage)}</ul>"
        + "</body></html>\n"
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
