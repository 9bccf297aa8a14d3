"""The CLI end to end on real data: real Dask clusters, real horovodrun, real files."""

from __future__ import annotations

import functools
import http.server
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from preprocessing.sources import idx
from tests.conftest import Result, serving

pytestmark = pytest.mark.e2e


@pytest.fixture
def http_source(real_mnist: Path) -> Iterator[str]:
    """The MNIST IDX files served over HTTP on loopback."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(real_mnist))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    with serving(server) as url:
        yield url + "/"


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_run_fashion_subset_as_one_flow(
    shardflow: Callable[..., Result], fashion_subset: Path
) -> None:
    """2,000 real Fashion-MNIST images through `shardflow run` on 2 Horovod ranks."""
    run = ok(
        shardflow(
            "run",
            "fashion-mnist",
            "--source",
            str(fashion_subset),
            "--np",
            "2",
            "--epochs",
            "4",
            "--json",
        )
    ).json
    assert run["num_ranks"] == 2
    assert run["epochs"] == 4
    assert run["rows"] == 3_000
    assert run["test_rows"] == 1_000
    assert run["test_accuracy"] >= 0.70
    assert run["flow_run_id"]

    shown = ok(shardflow("catalog", "show", "fashion-mnist-processed", "--json")).json
    stats = shown["statistics"]
    files = {Path(f["path"]).relative_to(shown["directory"]).as_posix(): f for f in shown["files"]}
    assert sorted(files) == [
        "split=test/part-00000.parquet",
        "split=train/part-00000.parquet",
        "split=validation/part-00000.parquet",
    ]
    # The 2,000 training images are hashed into train and validation; train is cut into 64
    # equal row groups (1, 2, 4, ... 64 ranks all get equal rows), the rest dropped, counted.
    train = pq.ParquetFile(files["split=train/part-00000.parquet"]["path"])
    assert train.metadata.num_row_groups == 64
    group = stats["train"]["rows_per_group"]
    assert [train.metadata.row_group(i).num_rows for i in range(64)] == [group] * 64
    assert stats["validation"]["rows"] + stats["train"]["source_rows"] == 2_000
    assert stats["rows_in"] == 3_000
    assert shown["rows"] == 3_000 - stats["train"]["dropped_rows"]
    assert sum(f["rows"] for f in shown["files"]) == shown["rows"]

    lineage = ok(
        shardflow("catalog", "lineage", f"fashion-mnist-cnn@{run['version']}", "--json")
    ).json
    processed = lineage["parents"][0]
    assert processed["name"] == "fashion-mnist-processed"
    raw = processed["parents"][0]
    assert raw["name"] == "fashion-mnist"
    assert {Path(s["uri"]).name for s in raw["sources"]} >= {"train-images-idx3-ubyte.gz"}

    model = ok(shardflow("catalog", "show", f"fashion-mnist-cnn@{run['version']}", "--json")).json
    assert sorted(Path(f["path"]).name for f in model["files"]) == [
        "curves.png",
        "metrics.json",
        "model.keras",
    ]
    curves = next(Path(f["path"]) for f in model["files"] if f["path"].endswith(".png"))
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert ok(shardflow("catalog", "verify", "--json")).json["ok"] is True
    listed = ok(shardflow("catalog", "list", "--json")).json["datasets"]
    assert {d["name"]: d["kind"] for d in listed} == {
        "fashion-mnist": "raw",
        "fashion-mnist-processed": "processed",
        "fashion-mnist-cnn": "model",
    }


def test_real_mnist_over_http_trains_to_97_percent(
    shardflow: Callable[..., Result], http_source: str, shardflow_home: Path, real_mnist: Path
) -> None:
    """Real MNIST digits served over HTTP: ingest, preprocess, train on 2 ranks."""
    held_out = idx.read_records(real_mnist / "t10k-labels-idx1-ubyte.gz")
    assert np.bincount(held_out, minlength=10).tolist() == [100] * 10  # every digit, balanced
    ingested = ok(shardflow("ingest", "mnist", "--source", http_source, "--json")).json
    assert ingested["rows"] == 5_000
    assert ingested["train_rows"] == 4_000
    assert all(uri.startswith(http_source) for uri in ingested["sources"])

    again = ok(shardflow("ingest", "mnist", "--source", http_source, "--json")).json
    assert again["version"] == ingested["version"]  # same bytes: the same version, no copy

    processed = ok(shardflow("preprocess", "mnist", "--workers", "2", "--json")).json
    splits = processed["splits"]
    assert processed["rows"] + splits["train"]["dropped_rows"] == 5_000
    assert splits["train"]["num_row_groups"] % 64 == 0
    assert splits["test"]["rows"] == 1_000

    files_before = sorted(p for p in (shardflow_home / "catalog").rglob("*") if p.is_file())
    repeated = ok(shardflow("preprocess", "mnist", "--json")).json
    assert repeated["version"] == processed["version"]  # recognised: nothing is rewritten
    files_after = sorted(p for p in (shardflow_home / "catalog").rglob("*") if p.is_file())
    assert files_after == files_before

    trained = ok(
        shardflow("train", "mnist", "--np", "2", "--epochs", "15", "--augment", "--json")
    ).json
    assert trained["num_ranks"] == 2
    assert trained["test_rows"] == 1_000
    assert trained["test_accuracy"] >= 0.97


def test_truncated_idx_is_refused_and_leaves_nothing(
    shardflow: Callable[..., Result], fashion_subset: Path, tmp_path: Path, shardflow_home: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in fashion_subset.iterdir():
        data = path.read_bytes()
        (broken / path.name).write_bytes(
            data[: len(data) // 2] if "t10k-images" in path.name else data
        )
    result = shardflow("ingest", "fashion-mnist", "--source", str(broken), "--json")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "t10k-images-idx3-ubyte.gz" in lines[0]
    assert "truncated" in lines[0]
    assert "Traceback" not in result.stderr
    assert ok(shardflow("catalog", "list", "--json")).json["datasets"] == []
    staging = shardflow_home / "catalog" / "staging"
    assert not staging.exists() or not any(staging.iterdir())

    # The same through the Prefect flow: one line, no traceback, nothing committed.
    flow = shardflow("run", "fashion-mnist", "--source", str(broken), "--json")
    assert flow.returncode != 0
    assert len(flow.stderr.strip().splitlines()) == 1, flow.stderr
    assert "t10k-images-idx3-ubyte.gz" in flow.stderr
    assert "Traceback" not in flow.stderr
    assert ok(shardflow("catalog", "list", "--json")).json["datasets"] == []


def test_errors_are_one_line(
    shardflow: Callable[..., Result], tmp_path: Path, shardflow_home: Path
) -> None:
    missing = shardflow("ingest", "mnist", "--source", str(tmp_path / "nowhere"))
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"shardflow: error: --source {tmp_path / 'nowhere'}: no such directory"
    ]
    # `run` says so before it starts a Prefect server for itself.
    missing_run = shardflow("run", "mnist", "--source", str(tmp_path / "nowhere"))
    assert missing_run.returncode == 1
    assert missing_run.stderr.strip().splitlines() == [
        f"shardflow: error: --source {tmp_path / 'nowhere'}: no such directory or file, and no "
        "glob match"
    ]
    assert not list(shardflow_home.glob("logs/prefect-server*.log"))
    unknown = shardflow("catalog", "show", "nothing-here")
    assert unknown.returncode == 1
    assert len(unknown.stderr.strip().splitlines()) == 1
    assert "nothing-here" in unknown.stderr
    not_processed = shardflow("train", "mnist", "--np", "2")
    assert not_processed.returncode == 1
    assert len(not_processed.stderr.strip().splitlines()) == 1
    for command in ("preprocess", "run"):
        small = shardflow(command, "mnist", "--memory-limit", "100MB")
        assert small.returncode == 1
        assert small.stderr.strip().splitlines() == [
            "shardflow: error: --memory-limit '100MB': give a size of at least 512MiB per "
            "worker, such as 2GiB or 1500MB"
        ]
