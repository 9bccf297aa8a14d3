"""A catalog on a real S3 API: moto's server on loopback, reached through s3fs and boto3.

Real HTTP, real S3 semantics (conditional PUT of the manifest, listings by prefix), real
processes killed mid-commit and committing at once.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

# The dev extra (make setup) installs these; a missing one is a broken setup, not a skip.
import boto3
import fsspec
import moto.server  # noqa: F401  (the server the fixture runs)
import pyarrow.parquet as pq
import pytest
import s3fs  # noqa: F401  (the filesystem the catalog opens for s3://)

from data_catalog import Catalog
from data_catalog.storage import ObjectStorage as ObjectStore
from tests.conftest import free_port
from tests.data_catalog.commit_helper import CODE_VERSION, commit, write_files
from tests.data_catalog.test_crash_safety import finish

HELPER = Path(__file__).with_name("commit_helper.py")
REPO = Path(__file__).resolve().parents[2]
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1, for this module's tests."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    env = {**os.environ, **CREDENTIALS}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto server did not start; see {log.name}")
            time.sleep(0.1)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"shardflow-{secrets.token_hex(4)}"
    s3 = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    s3.create_bucket(Bucket=name)
    return name


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def storage_options(endpoint: str) -> dict[str, Any]:
    """How a program passes the endpoint: Catalog(url, storage_options=...)."""
    return {
        "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def run_helper(
    endpoint: str,
    root: str,
    name: str,
    *seeds: int,
    cache_dir: Path,
    crash_at: str | None = None,
    start_at: float = 0.0,
) -> subprocess.Popen[str]:
    """The commit helper in its own process; it finds the server through AWS_ENDPOINT_URL."""
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO)}
    env.pop("SHARDFLOW_CATALOG_CRASH_AT", None)
    if crash_at is not None:
        env["SHARDFLOW_CATALOG_CRASH_AT"] = crash_at
    args = [root, name, *map(str, seeds), "--start-at", str(start_at)]
    return subprocess.Popen(
        [sys.executable, str(HELPER), *args, "--cache-dir", str(cache_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def keys(endpoint: str, bucket: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def commit_seed(catalog: Catalog, name: str, seed: int) -> str:
    """What commit_helper does, in this process, into a catalog built with storage_options."""
    with catalog.stage(name, kind="processed") as stage:
        write_files(stage.path, seed)
        manifest = stage.commit(
            parameters={"seed": seed},
            rows=10,
            file_rows={"notes.txt": 1},
            code_version=CODE_VERSION,
        )
    return manifest.version


def test_commit_read_and_verify_a_parquet_version(
    endpoint: str, bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/catalog"
    options = storage_options(endpoint)
    catalog = Catalog(url, storage_options=options, cache_dir=tmp_path / "cache")
    version = commit_seed(catalog, "fmnist", 3)
    # The id depends on the identity only, not on where the catalog lives.
    assert version == commit(tmp_path / "local", "fmnist", 3)
    manifest = catalog.get("fmnist")
    assert manifest.version == version
    assert [f.path for f in manifest.files] == ["blobs/data.bin", "notes.txt", "part.parquet"]
    prefix = f"catalog/datasets/fmnist/{version}"
    stored = {f.path: f"catalog/objects/{f.sha256[:2]}/{f.sha256}" for f in manifest.files}
    assert keys(endpoint, bucket) == sorted([*stored.values(), f"{prefix}/_manifest.json"])
    assert catalog.verify() == []
    part = next(f for f in manifest.files if f.path == "part.parquet")
    assert (part.rows, part.row_groups) == (10, 2)
    with fsspec.open(catalog.file_url(manifest, part), "rb", **options) as f:
        assert pq.read_table(f).num_rows == 10

    # A rerun writes nothing; a flipped byte in the bucket is found and named by its URL.
    assert commit_seed(catalog, "fmnist", 3) == version
    s3 = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    body = s3.get_object(Bucket=bucket, Key=stored["notes.txt"])["Body"].read()
    s3.put_object(Bucket=bucket, Key=stored["notes.txt"], Body=body[:-2] + b"?\n")
    [problem] = catalog.verify()
    assert problem.path == f"s3://{bucket}/{stored['notes.txt']}"
    assert problem.reason == "sha256 mismatch"


@pytest.mark.parametrize("failpoint", ["after_first_file", "staged", "manifest_tmp"])
def test_a_commit_killed_before_the_manifest_put_leaves_no_version(
    endpoint: str, bucket: str, tmp_path: Path, failpoint: str
) -> None:
    url = f"s3://{bucket}/catalog"
    cache = tmp_path / "cache"
    catalog = Catalog(url, storage_options=storage_options(endpoint), cache_dir=cache)
    kept = commit_seed(catalog, "kept", 1)
    expected = commit(tmp_path / "local", "crashy", 7)

    before = set(keys(endpoint, bucket))
    code, _ = finish(run_helper(endpoint, url, "crashy", 7, cache_dir=cache, crash_at=failpoint))
    assert code == -signal.SIGKILL
    uploaded = sorted(set(keys(endpoint, bucket)) - before)
    assert uploaded, "the crash should leave uploaded objects behind"
    assert all(k.startswith("catalog/objects/") for k in uploaded)  # no manifest, no version
    if failpoint != "after_first_file":
        assert len(uploaded) == 2  # every file but the one it shares with kept
    assert catalog.names() == ["kept"]
    assert catalog.versions("crashy") == []
    assert not catalog.exists("crashy", expected)
    assert catalog.verify() == []

    # The dead writer's local staging goes at once (its lock is free); its uploads are fresh,
    # so gc leaves them to a possible live writer until they are min_age old.
    [staged] = [p for p in (cache / "staging").iterdir() if p.is_dir()]
    assert catalog.gc() == sorted([str(staged), str(staged) + ".lock"])
    assert catalog.gc() == []
    assert sorted(catalog.gc(min_age=timedelta(0))) == [f"s3://{bucket}/{k}" for k in uploaded]
    assert set(keys(endpoint, bucket)) == before

    code, versions = finish(run_helper(endpoint, url, "crashy", 7, cache_dir=cache))
    assert (code, versions) == (0, [expected])
    assert [m.version for m in catalog.versions("crashy")] == [expected]
    assert [m.version for m in catalog.versions("kept")] == [kept]
    assert catalog.verify() == []


def test_a_rerun_after_a_crash_needs_no_gc(endpoint: str, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/catalog"
    cache = tmp_path / "cache"
    code, _ = finish(run_helper(endpoint, url, "crashy", 7, cache_dir=cache, crash_at="staged"))
    assert code == -signal.SIGKILL
    code, versions = finish(run_helper(endpoint, url, "crashy", 7, cache_dir=cache))
    assert code == 0
    assert versions == [commit(tmp_path / "local", "crashy", 7)]
    catalog = Catalog(url, storage_options=storage_options(endpoint), cache_dir=cache)
    assert [m.version for m in catalog.versions("crashy")] == versions
    assert catalog.verify() == []


def test_concurrent_commits_of_the_same_versions_all_succeed(
    endpoint: str, bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/catalog"
    start_at = time.time() + 1.5
    # Two writers (each with its own local cache, as on two machines) commit the same
    # identities at the same instant; a third commits others into the same dataset.
    procs = [
        run_helper(endpoint, url, "shared", 1, 2, cache_dir=tmp_path / "a", start_at=start_at),
        run_helper(endpoint, url, "shared", 1, 2, cache_dir=tmp_path / "b", start_at=start_at),
        run_helper(endpoint, url, "shared", 10, cache_dir=tmp_path / "c", start_at=start_at),
    ]
    results = [finish(p) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0]
    assert results[0][1] == results[1][1]
    everything = {v for _, versions in results for v in versions}
    assert len(everything) == 3

    catalog = Catalog(url, storage_options=storage_options(endpoint), cache_dir=tmp_path / "d")
    assert {m.version for m in catalog.versions("shared")} == everything
    assert catalog.verify() == []
    assert catalog.gc(min_age=timedelta(0)) == []
    assert len(catalog.search()) == 3


def test_the_manifest_put_is_conditional_on_s3(endpoint: str, bucket: str) -> None:
    store = ObjectStore(f"s3://{bucket}/catalog", storage_options(endpoint))
    assert store.create("datasets/x/manifest.json", b"first")
    assert not store.create("datasets/x/manifest.json", b"second")
    assert store.read_text("datasets/x/manifest.json") == "first"
