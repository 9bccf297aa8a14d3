"""`shardflow ingest sdss|cifar10` and `shardflow synth sdss` as a user runs them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from preprocessing.sources import idx
from tests.conftest import Result
from tests.preprocessing.sources.skyserver_standin import (
    BIG_SPECOBJID,
    StandIn,
    serve,
    synthetic_rows,
)


def test_skyserver_capped_replies_ingest_every_row_once(
    shardflow: Callable[..., Result],
) -> None:
    with serve(StandIn(rows=synthetic_rows(25_000), cap=10_000)) as standin:
        result = shardflow("ingest", "sdss", "--skyserver-url", standin.url, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.json["rows"] == 25_000

    shown = shardflow("catalog", "show", "sdss", "--json").json
    tables = [pq.read_table(f["path"]) for f in shown["files"] if f["path"].endswith(".parquet")]
    table = pa.concat_tables(tables)
    assert table.num_rows == 25_000
    assert pc.count_distinct(table.column("objid")).as_py() == 25_000
    assert table.schema.field("specobjid").type == pa.uint64()
    assert pc.max(table.column("specobjid")).as_py() == BIG_SPECOBJID  # above 2^63, exact


def test_bad_replies_are_refused_in_one_line_without_a_version(
    shardflow: Callable[..., Result],
) -> None:
    for mode in ("empty", "error"):
        with serve(StandIn(rows=synthetic_rows(100), mode=mode)) as standin:
            result = shardflow("ingest", "sdss", "--skyserver-url", standin.url)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shardflow: error:"), result.stderr
    with serve(StandIn(rows=synthetic_rows(300), cap=100, count_extra=7)) as standin:
        short = shardflow("ingest", "sdss", "--skyserver-url", standin.url)
    assert short.returncode == 1
    assert len(short.stderr.strip().splitlines()) == 1
    assert shardflow("catalog", "list", "--json").json["datasets"] == []
    missing = shardflow("ingest", "cifar10")
    assert missing.returncode == 1
    assert "--source is needed for cifar10" in missing.stderr


def test_synthetic_exports_ingest_as_marked_rows(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    out = tmp_path / "exports"
    written = shardflow(
        "synth",
        "sdss",
        "--rows",
        "5000",
        "--files",
        "3",
        "--format",
        "fits",
        "--out",
        str(out),
        "--json",
    )
    assert written.returncode == 0, written.stderr
    assert len(written.json["files"]) == 3
    ingested = shardflow("ingest", "sdss", "--source", str(out), "--json")
    assert ingested.returncode == 0, ingested.stderr[-2000:]
    assert ingested.json["rows"] == 5_000
    assert ingested.json["synthetic_rows"] == 5_000


def test_synthetic_images_from_the_real_pool_ingest_as_synthetic(
    shardflow: Callable[..., Result], fashion_subset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "synthetic-fashion"
    written = shardflow(
        "synth",
        "fashion-mnist",
        "--rows",
        "600",
        "--test-rows",
        "100",
        "--source",
        str(fashion_subset),
        "--out",
        str(out),
        "--json",
    )
    assert written.returncode == 0, written.stderr
    made = idx.read_records(out / "train-images-idx3-ubyte.gz")
    pool = idx.read_records(fashion_subset / "train-images-idx3-ubyte.gz")
    pool_bytes = {image.tobytes() for image in pool}
    assert made.shape == (600, 28, 28)
    assert not any(image.tobytes() in pool_bytes for image in made)  # no copies
    labels = idx.read_records(out / "train-labels-idx1-ubyte.gz")
    assert len(np.unique(labels)) == 10  # every class present

    ingested = shardflow("ingest", "fashion-mnist", "--source", str(out), "--json")
    assert ingested.returncode == 0, ingested.stderr[-2000:]
    assert ingested.json["rows"] == 700
    shown = shardflow("catalog", "show", "fashion-mnist", "--json").json
    assert shown["statistics"]["provenance"] == "synthetic"

    digits = shardflow("synth", "mnist", "--rows", "10", "--out", str(tmp_path / "d"))
    assert digits.returncode == 1
    assert "--source is needed for mnist" in digits.stderr


def test_synth_cifar10_needs_a_real_pool(shardflow: Callable[..., Result], tmp_path: Path) -> None:
    result = shardflow("synth", "cifar10", "--rows", "5", "--out", str(tmp_path / "c"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "shardflow: error: --source is needed for cifar10: real CIFAR-10 batches to draw on"
    )


def test_run_sdss_from_skyserver_as_one_flow(shardflow: Callable[..., Result]) -> None:
    rows = synthetic_rows(8_000)
    with serve(StandIn(rows=rows, cap=5_000)) as standin:
        ran = shardflow(
            "run", "sdss", "--skyserver-url", standin.url, "--limit", "6000",
            "--np", "2", "--epochs", "1", "--json",
        )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.json["model_name"] == "sdss-dnn"  # the default model for tabular data

    raw = shardflow("catalog", "show", f"sdss@{ran.json['raw_version']}", "--json").json
    assert raw["rows"] == 6_000
    processed_version = ran.json["processed_version"]
    processed = shardflow("catalog", "show", f"sdss-processed@{processed_version}", "--json").json
    quarantine = processed["statistics"]["quarantine"]
    assert quarantine["rows"] == len(range(0, 6_000, 97))  # every 97th row has a -9999 radius
    lineage = shardflow("catalog", "lineage", f"sdss-dnn@{ran.json['version']}").stdout
    assert standin.url in lineage
