"""The CLI on a catalog in S3 (a real S3 API: moto's server on loopback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result
from tests.data_catalog.test_s3 import CREDENTIALS, bucket, endpoint  # noqa: F401 (fixtures)


def test_ingest_show_verify_on_s3(
    shardflow: Callable[..., Result],
    fashion_subset: Path,
    endpoint: str,  # noqa: F811
    bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SHARDFLOW_CATALOG", f"s3://{bucket}/catalog")

    ingested = shardflow("ingest", "fashion-mnist", "--source", str(fashion_subset), "--json")
    assert ingested.returncode == 0, ingested.stderr[-2000:]
    assert ingested.json["rows"] == 3_000
    again = shardflow("ingest", "fashion-mnist", "--source", str(fashion_subset), "--json")
    assert again.json["version"] == ingested.json["version"]

    shown = shardflow("catalog", "show", "fashion-mnist", "--json").json
    assert shown["version"] == ingested.json["version"]
    assert all(f["path"].startswith(f"s3://{bucket}/catalog/") for f in shown["files"])
    assert shardflow("catalog", "verify", "--json").json["ok"] is True
    assert [d["name"] for d in shardflow("catalog", "list", "--json").json["datasets"]] == [
        "fashion-mnist"
    ]

    # Preprocessing reads the raw version from the store (its tasks copy the IDX files they
    # read by seeking) and commits to it: the same files as from a local catalog.
    on_s3 = shardflow("preprocess", "fashion-mnist", "--rank-multiple", "8", "--json")
    assert on_s3.returncode == 0, on_s3.stderr[-2000:]
    monkeypatch.delenv("SHARDFLOW_CATALOG")
    assert shardflow("ingest", "fashion-mnist", "--source", str(fashion_subset)).returncode == 0
    local = shardflow("preprocess", "fashion-mnist", "--rank-multiple", "8", "--json")
    assert local.returncode == 0, local.stderr[-2000:]
    assert on_s3.json["version"] == local.json["version"]
    monkeypatch.setenv("SHARDFLOW_CATALOG", f"s3://{bucket}/catalog")
    shown = shardflow("catalog", "show", "fashion-mnist-processed", "--json").json
    assert all(f["path"].startswith(f"s3://{bucket}/catalog/") for f in shown["files"])
    assert shardflow("catalog", "verify", "--json").json["ok"] is True
    monkeypatch.delenv("SHARDFLOW_CATALOG")
    local_shown = shardflow("catalog", "show", "fashion-mnist-processed", "--json").json
    assert [(f["sha256"], f["rows"]) for f in shown["files"]] == [
        (f["sha256"], f["rows"]) for f in local_shown["files"]
    ]

    # Training reads the processed version from the store (each rank its own row groups) and
    # commits the model to it.
    monkeypatch.setenv("SHARDFLOW_CATALOG", f"s3://{bucket}/catalog")
    trained = shardflow(
        "train", "fashion-mnist", "--np", "2", "--epochs", "1", "--batch-size", "64", "--json"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.json["test_accuracy"] > 0.5
    assert trained.json["dataset_version"] == f"fashion-mnist-processed@{on_s3.json['version']}"
    model = shardflow("catalog", "show", trained.json["model_name"], "--json").json
    assert all(f["path"].startswith(f"s3://{bucket}/catalog/") for f in model["files"])
    assert shardflow("catalog", "verify", "--json").json["ok"] is True


def test_a_grown_source_on_s3_stores_only_what_is_new(
    shardflow: Callable[..., Result],
    endpoint: str,  # noqa: F811
    bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Ingest and preprocess SDSS exports into s3://, then once more after one more export: the
    second run uploads the new export's objects only, no second copy of anything."""
    from tests.data_catalog.test_s3 import keys

    exports, more = tmp_path / "exports", tmp_path / "more"
    for out, rows, seed in ((exports, "6000", "1"), (more, "3000", "5")):
        files = "2" if out == exports else "1"
        made = shardflow("synth", "sdss", "--rows", rows, "--files", files, "--seed", seed,
                         "--out", str(out))  # fmt: skip
        assert made.returncode == 0, made.stderr
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SHARDFLOW_CATALOG", f"s3://{bucket}/catalog")

    def run() -> tuple[set[str], set[str]]:
        """Ingest and preprocess; (the raw version's file digests, the processed one's)."""
        # Row groups of 50 rows, however many rows: else R shrinks with a small split
        # (docs/preprocessing.md) and every piece is written again when it grows.
        for stage in (
            ("ingest", "sdss", "--source", str(exports)),
            ("preprocess", "sdss", "--rows-per-group", "50"),
        ):
            done = shardflow(*stage, "--json")
            assert done.returncode == 0, done.stderr[-2000:]
        return tuple(  # type: ignore[return-value]
            {f["sha256"] for f in shardflow("catalog", "show", name, "--json").json["files"]}
            for name in ("sdss", "sdss-processed")
        )

    def objects() -> set[str]:
        return {k.rsplit("/", 1)[-1] for k in keys(endpoint, bucket) if "/objects/" in k}

    raw, processed = run()
    before = objects()
    next(more.glob("*.csv")).rename(exports / "sdss-synthetic-0002.csv")
    grown_raw, grown_processed = run()
    uploaded = objects() - before
    # The new export's Parquet file, and its piece's splits, quarantine, keys, and the record of
    # the pieces: nothing else, nothing twice.
    assert uploaded == (grown_raw - raw) | (grown_processed - processed)
    assert len(grown_raw - raw) == 1
    assert 3 <= len(grown_processed - processed) <= 6
    assert len(processed - grown_processed) == 1  # the earlier record of the pieces
    assert shardflow("catalog", "verify", "--json").json["ok"] is True
