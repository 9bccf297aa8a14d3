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

    # Preprocessing reads raw files by local path for now: refused in one line.
    refused = shardflow("preprocess", "fashion-mnist")
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "is not on a local or mounted filesystem" in refused.stderr
