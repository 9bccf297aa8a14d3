"""What ``shardflow catalog gc`` removes outside the catalog: the work folders of jobs that no
run is using, and the download cache's stale entries and partial files.

    $SHARDFLOW_HOME/work/
        .locks/<job>.lock   flock held by a live run of <job> (driver._one_run_at_a_time)
        <job>/              that job's finished tasks until its commit: removed when its lock
                            is free and nothing in it changed for ``min_age``
        downloads/          the download cache (sources/fetch.py): entries unused for
                            ``min_age``, partial files of processes that are gone

A run that finishes removes its own work folder; what is left is an interrupted run's, kept so
that a rerun resumes. gc gives that up for the folders older than ``min_age``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path

from preprocessing.sources.fetch import sweep_cache

# Folders of work/ that are no job's.
LOCKS = ".locks"
DOWNLOADS = "downloads"
"""The download cache under work/ (preprocessing.datasets keeps it there for every ingest)."""
DEFAULT_MIN_AGE = timedelta(hours=1)
# What the driver names a job's folder: "<dataset>[-<what>]-<16 hex digits>" (Job.work_key).
JOB_FOLDER = re.compile(r"[a-z0-9][a-z0-9_-]{0,127}-[0-9a-f]{16}")


def remove_unused_work(work_root: Path, *, min_age: timedelta = DEFAULT_MIN_AGE) -> list[Path]:
    """Remove the job folders of ``work_root`` that no live run holds and in which nothing
    changed for ``min_age``, and the download cache's stale entries; returns what it removed.

    Only what the driver makes is removed: a folder named as a job's (:data:`JOB_FOLDER`)
    whose lock file the driver created before it. Nothing is followed through a symlink
    (``work_root`` itself, ``downloads/``, ``.locks/`` or a job's folder): what a link points
    at is not shardflow's."""
    if work_root.is_symlink() or not work_root.is_dir():
        return []
    locks = work_root / LOCKS
    if locks.is_symlink():
        return []
    removed: list[Path] = []
    for folder in sorted(work_root.iterdir()):
        if JOB_FOLDER.fullmatch(folder.name) is None or folder.is_symlink():
            continue
        lock_path = locks / f"{folder.name}.lock"
        if not folder.is_dir() or lock_path.is_symlink() or not lock_path.is_file():
            continue
        if _remove_if_unused(lock_path, folder, min_age):
            removed.append(folder)
    downloads = work_root / DOWNLOADS
    if downloads.is_dir() and not downloads.is_symlink():
        removed += sweep_cache(downloads, min_age=min_age)
    return removed


def _remove_if_unused(lock_path: Path, folder: Path, min_age: timedelta) -> bool:
    """Remove ``folder`` while holding its job's lock, if no one holds it and the folder is
    older than ``min_age``."""
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live run's
        # Held while removing: a run starting now waits, then finds no folder and starts afresh.
        try:
            if time.time() - _newest_change(folder) < min_age.total_seconds():
                return False
            shutil.rmtree(folder)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _newest_change(folder: Path) -> float:
    """The newest modification time of ``folder`` and everything under it."""
    newest = folder.stat().st_mtime
    for parent, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            try:
                newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest
