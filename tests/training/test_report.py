"""The HTML report (training/report.py, templates/report.html): what the page says of a model
version and its ancestors, and every value from the catalog written as text, never as markup."""

from __future__ import annotations

from typing import Any

from data_catalog import Manifest
from data_catalog.layout import Normalization, ProcessedLayout, Quarantine
from data_catalog.manifest import ParentRef
from tests.flows.test_results import manifest, split
from tests.training.test_input_metrics import rank
from training.report import ReportInputs, render_html

SCRIPT = "<script>alert(1)</script>"


def processed_layout(class_name: str) -> dict[str, Any]:
    return ProcessedLayout(
        kind="tabular",
        format="parquet",
        arrow_schema="x: float, label: int64",
        columns=("x", "label"),
        feature_columns=("x",),
        label_column="label",
        num_classes=2,
        class_names=("STAR", class_name),
        split_by="hash",
        split_fractions={"train": 0.9, "test": 0.1},
        splits={"train": split(60_000, 60), "test": split(9_000, 9)},
        normalization=Normalization(mean=(0.5,), std=(1.0,), over="train"),
        quarantine=Quarantine(rows=1_000, reasons={"nan:u": 1_000}, files=1, contents="q"),
        rows_in=70_000,
    ).to_manifest()


def report_inputs(name: str, note: str) -> ReportInputs:
    """A model of 2 ranks (rank 1's input slowed) trained on ``name``'s processed version of
    its raw version, which came from a source whose URI ends in ``note``."""
    raw = manifest(
        name,
        "raw",
        sources=({"uri": f"https://example.org/{note}"},),
        extra={"run": {"seconds": 2.0, "passes": {"convert": {"tasks": 3, "seconds": 1.5}}}},
    )
    processed = manifest(
        f"{name}-processed",
        "processed",
        parents=(ParentRef(name=name, version=raw.version),),
        **processed_layout(note),
    )
    ranks = [
        rank(0, input_per_batch=0.002, step=0.1, longest=0.1),
        rank(1, input_per_batch=0.2, step=0.1, longest=0.1),
    ]
    model: Manifest = manifest(
        f"{name}-dnn",
        "model",
        statistics={"num_ranks": 2, "epochs": 1, "steps_per_epoch": 20, "test_accuracy": 0.875}
        | {"input_by_rank": ranks},
        extra={"run_dir": f"/runs/{note}"},
    )
    lineage = {
        "name": model.name,
        "version": model.version,
        "kind": "model",
        "parents": [
            {
                "name": processed.name,
                "version": processed.version,
                "kind": "processed",
                "parents": [{"name": name, "version": raw.version, "kind": "raw"}],
            }
        ],
    }
    return ReportInputs(model=model, processed=processed, raw=raw, lineage=lineage)


def test_the_page_shows_the_model_its_ranks_and_its_ancestors() -> None:
    page = render_html(report_inputs("sdss", "notes.txt"))
    assert "<title>sdss-dnn@0123456789abcdef</title>" in page
    assert '<code id="sdss@0123456789abcdef">sdss@0123456789abcdef</code>' in page
    assert "slowest rank: <b>1</b>;" in page
    assert page.count('<span class="flag">input-bound</span>') == 1
    assert page.count('<span class="flag">slowest</span>') == 1
    assert "<td>ok</td>" in page  # rank 0
    assert "<h2>Epochs</h2>" in page and "window rows/s" in page
    assert "<th>tasks</th><td>convert: 3 in 1.5 s</td>" in page
    assert "<th>test accuracy</th><td>0.8750</td>" in page
    assert "<th>sources</th><td>https://example.org/notes.txt</td>" in page
    assert "<code>/runs/notes.txt/timeline.json</code> (with --timeline)" in page
    assert '<a href="#sdss-processed@0123456789abcdef">' in page


def test_a_name_or_note_holding_markup_is_shown_as_text() -> None:
    page = render_html(report_inputs(f"sdss{SCRIPT}", f"run{SCRIPT}"))
    assert "<script>" not in page
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    # The title, the version and lineage links, the source, the run folder: text, escaped.
    assert f"<title>sdss{escaped}-dnn@0123456789abcdef</title>" in page
    assert f'<a href="#sdss{escaped}@0123456789abcdef">' in page
    assert f"<td>https://example.org/run{escaped}</td>" in page
    assert f"<code>tensorboard --logdir /runs/run{escaped}/tensorboard</code>" in page
    assert page.count(escaped) >= 8
