"""Content-addressed storage: versions that hold the same bytes share one object, gc removes
only what no committed version holds, and never anything outside the catalog."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import fsspec
import pytest

from data_catalog import Catalog, Manifest
from data_catalog.storage import ObjectStorage
from tests.data_catalog.test_catalog import commit

BIG = bytes(range(256)) * 4096  # 1 MiB
FILES = {"train/part-00000.bin": BIG, "notes.txt": b"first\n"}


def _inode(catalog: Catalog, manifest: Manifest, path: str) -> int:
    entry = next(f for f in manifest.files if f.path == path)
    return catalog.file_path(manifest, entry).stat().st_ino


def _disk_bytes(root: Path) -> int:
    """Bytes of every file under ``root``, each inode once (what `du` counts)."""
    seen: set[int] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = Path(dirpath, name).lstat()
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def test_versions_with_the_same_file_share_its_bytes(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    first = commit(catalog, "ds", FILES)
    size = _disk_bytes(tmp_path / "catalog" / "objects")
    second = commit(catalog, "ds", {**FILES, "notes.txt": b"second\n"}, parameters={"n": 2})
    assert first.version != second.version
    assert _inode(catalog, first, "train/part-00000.bin") == _inode(
        catalog, second, "train/part-00000.bin"
    )
    # The second version stored only its new file.
    assert _disk_bytes(tmp_path / "catalog" / "objects") == size + len(b"second\n")
    assert catalog.verify() == []
    # Each version is still a folder of its files that any reader can open.
    second_dir = catalog.version_dir("ds", second.version)
    assert (second_dir / "train" / "part-00000.bin").read_bytes() == BIG


def test_reuse_puts_a_committed_file_into_a_new_version_without_a_copy(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    parent = commit(catalog, "ds", FILES)
    entry = next(f for f in parent.files if f.path == "train/part-00000.bin")
    with catalog.stage("ds", kind="processed") as stage:
        reused = stage.reuse(parent, entry, "train/part-00001.bin")
        (stage.path / "notes.txt").write_bytes(b"child\n")
        child = stage.commit(rows=1, parameters={"child": True}, code_version="c")
    assert reused.sha256 == entry.sha256 and reused.path == "train/part-00001.bin"
    assert [f.path for f in child.files] == ["notes.txt", "train/part-00001.bin"]
    assert _inode(catalog, child, "train/part-00001.bin") == _inode(
        catalog, parent, "train/part-00000.bin"
    )
    assert catalog.verify() == []


def test_gc_removes_only_objects_no_version_holds(tmp_path: Path) -> None:
    root = tmp_path / "catalog"
    catalog = Catalog(root)
    kept = commit(catalog, "ds", FILES)
    orphan = root / "objects" / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"left by a crashed commit")
    assert catalog.gc() == [str(orphan)]
    assert catalog.verify() == [] and catalog.get("ds") == kept
    assert catalog.gc() == []


def test_gc_never_leaves_the_catalog_nor_follows_a_link(tmp_path: Path) -> None:
    root = tmp_path / "catalog"
    catalog = Catalog(root)
    commit(catalog, "ds", FILES)
    outside = tmp_path / "outside"
    (outside / "0123456789abcdef").mkdir(parents=True)
    (outside / "0123456789abcdef" / "precious.txt").write_text("mine")
    (root / "datasets" / "linked").symlink_to(outside)  # a symlinked dataset folder
    version_link = root / "datasets" / "ds" / "fedcba9876543210"
    version_link.symlink_to(outside / "0123456789abcdef")  # a symlinked version folder
    notes = root / "datasets" / "ds" / "my-notes"
    notes.mkdir()  # not a version id: not the catalog's
    (notes / "todo.txt").write_text("keep me")
    assert catalog.gc() == []
    assert (outside / "0123456789abcdef" / "precious.txt").read_text() == "mine"
    assert (notes / "todo.txt").exists() and version_link.is_symlink()


def _commit_many(root: str, start: int, count: int) -> None:
    import hashlib

    catalog = Catalog(root)
    for n in range(start, start + count):
        # An object of this version's own file is already there, held by nothing (as a crashed
        # commit leaves it): gc may remove it at any moment while the commit uses it.
        own = f"{n}\n".encode() * 1000
        sha = hashlib.sha256(own).hexdigest()
        orphan = Path(root) / "objects" / sha[:2] / sha
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(own)
        # Each version shares BIG with every other and has a file of its own.
        commit(catalog, "ds", {"big.bin": BIG, f"own-{n}.txt": own}, parameters={"n": n})


def _gc_until(root: str, stop_at: float) -> None:
    catalog = Catalog(root)
    while time.time() < stop_at:
        catalog.gc()


def test_gc_racing_commits_loses_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "catalog")
    context = multiprocessing.get_context("spawn")
    gc = context.Process(target=_gc_until, args=(root, time.time() + 30))
    writers = [context.Process(target=_commit_many, args=(root, i * 20, 20)) for i in (0, 1)]
    gc.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
    gc.terminate()
    gc.join(10)
    assert [w.exitcode for w in writers] == [0, 0]
    catalog = Catalog(root)
    assert len(catalog.versions("ds")) == 40
    assert catalog.verify() == []
    catalog.gc()
    assert catalog.verify() == []


# --- a URL root ------------------------------------------------------------------------------


@pytest.fixture
def url() -> Iterator[str]:
    root = f"memory://objects-{secrets.token_hex(6)}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_a_url_root_stores_a_shared_file_once_and_reuse_uploads_nothing(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = Catalog(url, cache_dir=tmp_path / "cache")
    parent = commit(catalog, "ds", FILES)
    uploads: list[str] = []
    real = ObjectStorage.upload

    def counted(self: ObjectStorage, local: Path, relative: str) -> None:
        uploads.append(relative)
        real(self, local, relative)

    monkeypatch.setattr(ObjectStorage, "upload", counted)
    entry = next(f for f in parent.files if f.path == "train/part-00000.bin")
    with catalog.stage("ds", kind="processed") as stage:
        stage.reuse(parent, entry)
        (stage.path / "notes.txt").write_bytes(b"child\n")
        child = stage.commit(rows=1, parameters={"child": True}, code_version="c")
    sha = next(f.sha256 for f in child.files if f.path == "notes.txt")
    assert uploads == [f"objects/{sha[:2]}/{sha}"]  # the new file only
    assert catalog.verify() == []
    with fsspec.open(catalog.file_url(child, entry)) as f:
        assert f.read() == BIG
    # Nothing is unreferenced: gc keeps every object, however old.
    assert catalog.gc(min_age=timedelta(0)) == []


def test_gc_leaves_a_symlinked_staging_and_what_it_did_not_name(tmp_path: Path) -> None:
    """Issue #29 item 3, the cases beside the one above: a symlinked `staging/` (to a folder
    outside holding what looks like a dead writer's staging), a staging entry that is a link,
    and files under `objects/` whose names are no object's: all left alone."""
    root = tmp_path / "catalog"
    catalog = Catalog(root)
    commit(catalog, "ds", FILES)
    outside = tmp_path / "outside"
    dead = outside / "ds-0123456789abcdef"
    dead.mkdir(parents=True)
    (dead / "precious.txt").write_text("mine")
    (root / "staging").rename(tmp_path / "old-staging")
    (root / "staging").symlink_to(outside)
    assert catalog.gc() == []
    assert (dead / "precious.txt").read_text() == "mine"

    (root / "staging").unlink()
    (tmp_path / "old-staging").rename(root / "staging")
    (root / "staging" / "ds-fedcba9876543210").symlink_to(dead)
    (root / "staging" / "ds-fedcba9876543210.work").symlink_to(dead)
    strays = [
        root / "objects" / "ab" / "my-notes.txt",  # not a sha256
        root / "objects" / "ab" / ("cd" + "0" * 62),  # a sha256 under another prefix
        root / "objects" / "notes" / ("ab" + "0" * 62),  # not a prefix folder
    ]
    for stray in strays:
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_text("keep me")
    assert catalog.gc() == []
    assert (dead / "precious.txt").read_text() == "mine"
    assert all(stray.read_text() == "keep me" for stray in strays)
    assert catalog.verify() == []
