"""A rank slowed on purpose shows in the metrics and in the report as input-bound and slowest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result
from tests.flows.test_prefect_server import chromium_command

pytestmark = pytest.mark.e2e

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "input-view.png"
PNG = b"\x89PNG\r\n\x1a\n"


def test_a_slowed_rank_is_flagged_in_the_metrics_and_the_report(
    shardflow: Callable[..., Result],
    fashion_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fashion_home: the subset ingested and preprocessed, where `shardflow` runs.
    # 0.1 s before each of rank 1's batches: many times a CNN step on 28x28 images, so that
    # rank 1 is paced by its input however busy the machine is.
    monkeypatch.setenv("SHARDFLOW_TEST_INPUT_DELAY", "1:0.1")
    trained = shardflow("train", "fashion-mnist", "--np", "2", "--epochs", "1", "--json")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = trained.json
    by_rank = result["input_by_rank"]
    assert [r["rank"] for r in by_rank] == [0, 1]
    for r in by_rank:
        assert r["steps"] == result["steps_per_epoch"]
        assert r["rows_per_second"] > 0
        assert r["bytes_read"] > 0
        assert r["row_groups_read"] > 0
    summary = result["input_summary"]
    assert summary["slowest_rank"] == 1
    assert "input-bound" in summary["flags"]["1"]
    assert "slowest" in summary["flags"]["1"]
    assert summary["flags"]["0"] == []
    for r in by_rank:
        # The rolling window: the last steps of the epoch (the first, tracing, left out).
        assert 0 < r["rolling"]["steps"] <= r["rolling"]["window"]
        assert r["rolling"]["rows_per_second"] > 0
    # Written by rank 0 at the epoch's end, while training ran.
    epochs = json.loads((Path(result["run_dir"]) / "input-epochs.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [0]
    assert "slowest" in epochs[0]["input_summary"]["flags"]["1"]

    report = shardflow("report", "fashion-mnist-cnn", "--json")
    assert report.returncode == 0, report.stderr[-2000:]
    page = Path(report.json["path"])
    assert page == Path(result["run_dir"]) / "report.html"
    text = page.read_text()
    assert f"fashion-mnist-cnn@{result['version']}" in text
    assert result["dataset_version"] in text  # linked back to the processed version
    assert text.count('<span class="flag">input-bound</span>') == 1
    assert "slowest rank: <b>1</b>;" in text  # and flagged
    assert text.count('<span class="flag">slowest</span>') == 1
    assert "<h2>Epochs</h2>" in text and "window rows/s" in text
    # The ingest's and the preprocess's runs, as their drivers noted them.
    ingest_rate = re.search(r"<th>MB/s</th><td>([0-9.]+) \((read|stored)", text)
    assert ingest_rate and float(ingest_rate.group(1)) > 0, text
    # The preprocess's passes: its raw input verified, then its shards written.
    assert re.search(r"<th>tasks</th><td>verify: [0-9]+ in [^<]*; write: [0-9]+ in", text)
    assert "data:image/png;base64," in text
    # Trained again: the committed version is found, its report kept as it was written.
    written = page.stat().st_mtime_ns
    again = shardflow("train", "fashion-mnist", "--np", "2", "--epochs", "1", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.json["version"], again.json["report"]) == (result["version"], str(page))
    assert page.stat().st_mtime_ns == written

    shot = tmp_path / "input-view.png"
    subprocess.run(
        [*chromium_command(tmp_path), f"--screenshot={shot}", page.as_uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes().startswith(PNG)
    if os.environ.get("SHARDFLOW_UPDATE_DOCS"):
        shutil.copy(shot, DOCS_SCREENSHOT)
