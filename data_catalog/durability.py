"""Crash-safe filesystem steps: fsync, atomic replace, advisory locks, and test failpoints.

POSIX local filesystems only: ``fcntl.flock`` is unreliable on some network filesystems. A
catalog on object storage uses none of this except :func:`failpoint` (see object_store.py).
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CRASH_ENV = "SHARDFLOW_CATALOG_CRASH_AT"
FAILPOINTS = ("after_first_file", "staged", "moved", "manifest_tmp")


def failpoint(point: str) -> None:
    """Test-only: SIGKILL this process at ``point`` if ``$SHARDFLOW_CATALOG_CRASH_AT`` names it.

    SIGKILL, not an exception, because a crash runs no cleanup: the crash tests check that a
    process dying at any step leaves the catalog readable and ``gc`` able to clean up.
    """
    assert point in FAILPOINTS, point
    if os.environ.get(CRASH_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs each parent whose entries it changed."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue  # another process made it first; its entry is its fsync to do
        fsync_dir(directory.parent)


def write_atomically(path: Path, text: str, *, failpoint_name: str | None = None) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if failpoint_name is not None:
        failpoint(failpoint_name)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent), waiting for it if needed.

    The kernel drops the lock when the process dies, so a crash never leaves a stale lock.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def try_lock(path: Path, *, create: bool) -> int | None:
    """An fd holding an exclusive ``flock`` on ``path``, or None if another process holds it
    or (without ``create``) the file is gone.

    Checks after locking that ``path`` still names the locked file: a remover may unlink it
    between our open and our flock, and a lock on an unlinked file protects nothing.
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd
