"""Real processes killed mid-commit, and real processes committing at once."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_catalog import Catalog
from tests.data_catalog.commit_helper import commit

HELPER = Path(__file__).with_name("commit_helper.py")
REPO = Path(__file__).resolve().parents[2]
FAILPOINTS = ["after_first_file", "staged", "moved", "manifest_tmp"]


def run_helper(
    root: Path, name: str, *seeds: int, crash_at: str | None = None, start_at: float = 0.0
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SHARDFLOW_CATALOG_CRASH_AT", None)
    if crash_at is not None:
        env["SHARDFLOW_CATALOG_CRASH_AT"] = crash_at
    args = [str(root), name, *map(str, seeds), "--start-at", str(start_at)]
    return subprocess.Popen(
        [sys.executable, str(HELPER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[str]]:
    stdout, stderr = proc.communicate(timeout=60)
    if proc.returncode != 0:
        print(stderr)  # shown by pytest if the test fails
        return proc.returncode, []
    return proc.returncode, json.loads(stdout.strip().splitlines()[-1])["versions"]


def clean_version(root: Path, name: str, seed: int) -> str:
    code, versions = finish(run_helper(root, name, seed))
    assert code == 0
    return versions[0]


def index_rows(root: Path) -> set[tuple[str, str]]:
    with sqlite3.connect(root / "index.sqlite") as db:
        return set(db.execute("SELECT name, version FROM versions"))


@pytest.fixture(scope="module")
def expected_version(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The version a clean run makes, in a catalog of its own."""
    return clean_version(tmp_path_factory.mktemp("clean") / "catalog", "crashy", 7)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_a_commit_killed_at_any_step_leaves_no_version(
    tmp_path: Path, failpoint: str, expected_version: str
) -> None:
    root = tmp_path / "catalog"
    kept = commit(root, "kept", 1)  # in this process: only the crashing commit needs its own
    code, _ = finish(run_helper(root, "crashy", 7, crash_at=failpoint))
    assert code == -signal.SIGKILL

    catalog = Catalog(root)
    assert catalog.names() == ["kept"]
    assert catalog.versions("crashy") == []
    assert [m.version for m in catalog.versions("kept")] == [kept]
    assert catalog.verify() == []
    leftovers = sorted(p for p in (root / "staging").iterdir())
    leftovers += sorted(p for p in (root / "datasets" / "crashy").glob("*") if p.is_dir())
    assert leftovers, "the crash should leave something for gc"

    removed = [Path(p) for p in catalog.gc()]
    # The crashed commit's folders, and the objects it had stored for files no version holds.
    objects = [p for p in removed if p.parent.parent == root / "objects"]
    assert sorted(set(removed) - set(objects)) == sorted(leftovers)
    assert all(p.stat().st_nlink >= 2 for p in (root / "objects").glob("*/*"))
    assert list((root / "staging").iterdir()) == []
    assert [p for p in (root / "datasets" / "crashy").glob("*") if p.is_dir()] == []
    assert catalog.gc() == []

    assert clean_version(root, "crashy", 7) == expected_version
    assert catalog.names() == ["crashy", "kept"]
    assert catalog.verify() == []
    assert index_rows(root) == {("kept", kept), ("crashy", expected_version)}


@pytest.mark.parametrize("failpoint", ["moved", "manifest_tmp"])
def test_a_rerun_replaces_a_crashed_version_directory_without_gc(
    tmp_path: Path, failpoint: str, expected_version: str
) -> None:
    root = tmp_path / "catalog"
    code, _ = finish(run_helper(root, "crashy", 7, crash_at=failpoint))
    assert code == -signal.SIGKILL
    assert (root / "datasets" / "crashy" / expected_version).is_dir()
    assert clean_version(root, "crashy", 7) == expected_version
    catalog = Catalog(root)
    assert [m.version for m in catalog.versions("crashy")] == [expected_version]
    assert catalog.verify() == []


def test_concurrent_commits_of_one_dataset_all_succeed(tmp_path: Path) -> None:
    root = tmp_path / "catalog"
    start_at = time.time() + 1.0
    # Two pairs of processes: the first pair commits the same identities, the second distinct
    # ones, all into one dataset of a fresh catalog (so they also race to create the index).
    procs = [
        run_helper(root, "shared", 1, 2, 3, start_at=start_at),
        run_helper(root, "shared", 1, 2, 3, start_at=start_at),
        run_helper(root, "shared", 10, 11, start_at=start_at),
        run_helper(root, "shared", 20, 21, start_at=start_at),
    ]
    results = [finish(p) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0, 0]
    assert results[0][1] == results[1][1]
    everything = {v for _, versions in results for v in versions}
    assert len(everything) == 7

    catalog = Catalog(root)
    assert {m.version for m in catalog.versions("shared")} == everything
    assert catalog.verify() == []
    assert index_rows(root) == {("shared", v) for v in everything}
    assert list((root / "staging").iterdir()) == []
    assert catalog.gc() == []
