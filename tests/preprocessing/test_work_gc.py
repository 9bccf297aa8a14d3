"""`catalog gc`'s sweep of $SHARDFLOW_HOME/work (issue #29 item 3): only the folders the driver
names and locks, never through a link, never outside."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

from preprocessing.work_gc import remove_unused_work

JOB = "fashion-mnist-processed-0123456789abcdef"


def _aged(path: Path) -> Path:
    then = time.time() - 7200
    for p in [path, *path.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)
    return path


def _job_folder(work: Path, name: str = JOB, *, locked: bool = True) -> Path:
    folder = work / name
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "part-00000.parquet").write_bytes(b"x")
    if locked:
        (work / ".locks").mkdir(exist_ok=True)
        (work / ".locks" / f"{name}.lock").touch()
    return _aged(folder)


def test_an_interrupted_jobs_folder_is_removed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    folder = _job_folder(work)
    assert remove_unused_work(work, min_age=timedelta(hours=1)) == [folder]
    assert not folder.exists()


def test_folders_it_did_not_make_are_kept(tmp_path: Path) -> None:
    work = tmp_path / "work"
    notes = _job_folder(work, "my-notes", locked=False)
    unlocked = _job_folder(work, "sdss-0123456789abcdef", locked=False)
    outside = _job_folder(tmp_path / "outside", JOB)
    (work / "sdss-processed-fedcba9876543210").symlink_to(outside)
    assert remove_unused_work(work, min_age=timedelta(hours=1)) == []
    assert notes.exists() and unlocked.exists() and (outside / "out").exists()


def test_a_symlinked_work_folder_or_cache_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    folder = _job_folder(outside)
    cached = outside / "downloads" / "0123456789abcdef-0123456789abcdef"
    cached.parent.mkdir()
    cached.write_bytes(b"cached")
    _aged(cached.parent)
    home = tmp_path / "home"
    home.mkdir()
    (home / "work").symlink_to(outside)
    assert remove_unused_work(home / "work", min_age=timedelta(hours=1)) == []
    assert folder.exists() and cached.exists()

    real = home / "real-work"
    real.mkdir()
    (real / "downloads").symlink_to(outside / "downloads")
    assert remove_unused_work(real, min_age=timedelta(hours=1)) == []
    assert cached.exists()
