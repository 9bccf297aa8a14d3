"""A catalog rooted at a URL, against fsspec's real in-process ``memory://`` filesystem."""

from __future__ import annotations

import re
import secrets
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, CatalogError, Manifest, NotFound, ParentRef
from data_catalog.storage import ObjectStorage as ObjectStore
from tests.data_catalog.test_catalog import FILES, commit


@pytest.fixture
def url() -> Iterator[str]:
    # The memory filesystem is one store per process: give each test its own root.
    root = f"memory://catalog-{secrets.token_hex(6)}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def catalog(url: str, cache: Path) -> Catalog:
    return Catalog(url, cache_dir=cache)


def objects(url: str) -> dict[str, bytes]:
    fs, base = fsspec.url_to_fs(url)
    return {p[len(base) + 1 :]: fs.cat_file(p) for p in fs.find(base)}


def test_a_new_url_catalog_is_empty_and_creates_nothing(url: str, cache: Path) -> None:
    catalog = Catalog(url, cache_dir=cache)
    assert repr(catalog) == f"Catalog({url!r})"
    assert not catalog.is_local and catalog.url == url
    assert catalog.names() == []
    assert catalog.versions("ds") == []
    assert catalog.verify() == []
    assert catalog.gc() == []
    assert catalog.search() == []
    assert objects(url) == {}
    assert not cache.exists()


def test_commit_then_read_back(catalog: Catalog, url: str, cache: Path) -> None:
    manifest = commit(catalog, "ds", FILES, sources=({"uri": "file:///src"},))
    assert catalog.names() == ["ds"]
    assert catalog.exists("ds", manifest.version)
    assert catalog.get("ds") == manifest
    assert catalog.get("ds", manifest.version[:6]) == manifest
    assert catalog.versions("ds") == [manifest]
    key = f"datasets/ds/{manifest.version}"
    # A version is its manifest; its files are objects named by their sha256.
    stored = sorted(f"objects/{f.sha256[:2]}/{f.sha256}" for f in manifest.files)
    assert sorted(objects(url)) == sorted([*stored, f"{key}/_manifest.json"])
    entry = manifest.files[1]
    assert entry.path == "sub/b.bin"
    assert catalog.file_url(manifest, entry) == f"{url}/objects/{entry.sha256[:2]}/{entry.sha256}"
    assert catalog.version_url("ds", manifest.version) == f"{url}/{key}"
    with fsspec.open(catalog.file_url(manifest, entry), "rb") as f:
        assert f.read() == FILES["sub/b.bin"]
    # Staging happened on local disk, and nothing of it is left; the index is local too.
    assert list((cache / "staging").iterdir()) == []
    with sqlite3.connect(cache / "index.sqlite") as db:
        rows = set(db.execute("SELECT name, version, manifest_path FROM versions"))
    assert rows == {("ds", manifest.version, f"{url}/{key}/_manifest.json")}


def test_local_only_accessors_name_their_url_replacements(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", FILES)
    with pytest.raises(CatalogError, match="is not on a local filesystem; use file_url"):
        catalog.file_path(manifest, manifest.files[0])
    with pytest.raises(CatalogError, match="is not on a local filesystem; use version_url"):
        catalog.version_dir("ds", manifest.version)
    with pytest.raises(CatalogError, match=r"is not on a local filesystem; use \.url"):
        _ = catalog.root


def test_local_roots_keep_paths_and_file_urls_are_local_paths(tmp_path: Path) -> None:
    catalog = Catalog(f"file://{tmp_path}/catalog")
    assert catalog.is_local and catalog.root == tmp_path / "catalog"
    manifest = commit(catalog, "ds", FILES)
    entry = manifest.files[0]
    assert catalog.file_url(manifest, entry) == str(catalog.file_path(manifest, entry))
    assert catalog.version_url("ds", manifest.version) == str(
        catalog.version_dir("ds", manifest.version)
    )
    assert catalog.gc() == []
    with pytest.raises(CatalogError, match="apply only to a URL root"):
        Catalog(tmp_path, storage_options={"key": "x"})


def test_an_unknown_protocol_is_a_catalog_error() -> None:
    with pytest.raises(CatalogError, match="catalog URL 'nosuchfs://x' is not usable"):
        Catalog("nosuchfs://x")


def test_same_identity_gives_the_same_version_and_writes_nothing(
    catalog: Catalog, url: str, cache: Path
) -> None:
    first = commit(catalog, "ds", FILES, parameters={"k": 1})
    before = objects(url)
    store = ObjectStore(url, {})
    manifest_key = f"datasets/ds/{first.version}/_manifest.json"
    written = store.fs.modified(store.path(manifest_key))
    second = commit(catalog, "ds", FILES, parameters={"k": 1})
    assert second == first
    assert objects(url) == before
    assert store.fs.modified(store.path(manifest_key)) == written
    assert list((cache / "staging").iterdir()) == []
    assert len(catalog.versions("ds")) == 1


def test_other_parameters_give_a_new_version_and_latest_is_newest(catalog: Catalog) -> None:
    old = commit(catalog, "ds", FILES, parameters={"k": 1})
    new = commit(catalog, "ds", FILES, parameters={"k": 2})
    assert new.version != old.version
    assert catalog.versions("ds") == [old, new]
    assert catalog.get("ds") == new
    missing = f"no version 'ffffffffffffffff' of dataset 'ds' in catalog {catalog.url};"
    with pytest.raises(NotFound, match=re.escape(missing)):
        catalog.get("ds", "ffffffffffffffff")


def test_verify_names_the_url_of_each_damaged_object(catalog: Catalog, url: str) -> None:
    manifest = commit(catalog, "ds", {"flip.bin": b"abcdef", "cut.bin": b"123456", "gone": b"x"})
    commit(catalog, "other", FILES)
    assert catalog.verify() == []
    fs = fsspec.filesystem("memory")
    at = {f.path: catalog.file_url(manifest, f) for f in manifest.files}
    fs.pipe_file(at["flip.bin"], b"abcdeF")
    fs.pipe_file(at["cut.bin"], b"1234")
    fs.rm_file(at["gone"])
    stray = f"{catalog.version_url('ds', manifest.version)}/stray.txt"
    fs.pipe_file(stray, b"not mine")
    problems = {(p.path, p.reason) for p in catalog.verify()}
    assert problems == {
        (at["flip.bin"], "sha256 mismatch"),
        (at["cut.bin"], "size 4 != manifest 6"),
        (at["gone"], "missing"),
        (stray, "not in manifest"),
    }
    assert {(p.path, p.reason) for p in catalog.verify("ds", manifest.version)} == problems
    assert catalog.verify("other") == []


def test_verify_and_get_report_a_garbled_manifest(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", FILES)
    manifest_url = f"{catalog.version_url('ds', manifest.version)}/_manifest.json"
    fsspec.filesystem("memory").pipe_file(manifest_url, b'{"format_version": 1, "name"')
    [problem] = catalog.verify()
    assert problem.path == manifest_url
    assert problem.reason.startswith("unreadable manifest: garbled manifest")
    with pytest.raises(CatalogError, match="run `shardflow catalog verify ds`"):
        catalog.get("ds")


def test_parquet_counts_and_reading_back_through_fsspec(catalog: Catalog) -> None:
    table = pa.table({"x": list(range(25))})
    with catalog.stage("pq", kind="processed") as stage:
        pq.write_table(table, stage.path / "part-00000.parquet", row_group_size=10)
        manifest = stage.commit(rows=25, code_version="test-code")
    [entry] = manifest.files
    assert (entry.rows, entry.row_groups) == (25, 3)
    with fsspec.open(catalog.file_url(manifest, entry), "rb") as f:
        assert pq.read_table(f).equals(table)


def test_lineage_and_search(catalog: Catalog, cache: Path) -> None:
    raw = commit(catalog, "raw", FILES, sources=({"uri": "https://example.org/a.gz"},))
    processed = commit(catalog, "raw-processed", FILES, kind="processed", parents=(raw.ref,))
    ghost = ParentRef(name="ghost", version="0123456789abcdef")
    model = commit(catalog, "raw-cnn", FILES, kind="model", parents=(processed.ref, ghost))
    tree = catalog.lineage("raw-cnn")
    assert tree["version"] == model.version
    [parent, missing] = tree["parents"]
    assert missing == {"name": "ghost", "version": "0123456789abcdef", "missing": True}
    assert parent["name"] == "raw-processed"
    assert parent["parents"][0]["sources"] == [{"uri": "https://example.org/a.gz"}]
    assert catalog.search(parent=raw.ref) == [processed]
    assert catalog.search(kind="model") == [model]
    # The index is a local cache: delete it, and search and reindex rebuild it.
    (cache / "index.sqlite").unlink()
    assert catalog.search(kind="raw") == [raw]
    assert catalog.reindex() == 3


def test_a_failed_upload_publishes_nothing_and_gc_removes_it_once_old(
    catalog: Catalog, url: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = commit(catalog, "kept", FILES)
    before = set(objects(url))
    real_upload = ObjectStore.upload
    calls = []

    def flaky_upload(self: ObjectStore, local: Path, relative: str) -> None:
        calls.append(relative)
        if len(calls) == 2:
            raise OSError("connection reset")
        real_upload(self, local, relative)

    other = {"c.txt": b"gamma\n", "sub/d.bin": bytes(range(200)), "sub/e.bin": b"\x00" * 99}
    monkeypatch.setattr(ObjectStore, "upload", flaky_upload)
    with pytest.raises(OSError, match="connection reset"):
        commit(catalog, "ds", other)
    monkeypatch.undo()

    # One object uploaded, no manifest: no version, and nothing under datasets/ds/.
    [uploaded] = set(objects(url)) - before
    assert uploaded.startswith("objects/")
    assert catalog.names() == ["kept"]
    assert catalog.versions("ds") == []
    assert catalog.verify() == []
    assert list((cache / "staging").iterdir()) == []

    # Fresh objects may be a live writer's upload: the default min_age keeps them.
    assert catalog.gc() == []
    assert catalog.gc(min_age=timedelta(0)) == [f"{url}/{uploaded}"]
    assert set(objects(url)) == before  # kept's objects stay: its manifest names them
    assert catalog.gc(min_age=timedelta(0)) == []

    # A rerun after a failed upload needs no gc either: it uploads what is missing.
    monkeypatch.setattr(ObjectStore, "upload", flaky_upload)
    calls.clear()
    with pytest.raises(OSError):
        commit(catalog, "ds", other)
    monkeypatch.undo()
    manifest = commit(catalog, "ds", other)
    assert catalog.verify() == []
    assert catalog.versions("kept") == [kept]
    assert catalog.versions("ds") == [manifest]


def test_gc_removes_dead_local_staging_but_not_live(catalog: Catalog, cache: Path) -> None:
    with catalog.stage("ds", kind="raw") as stage:
        (stage.path / "a").write_text("in progress")
        dead = cache / "staging" / "ds-00000000deadbeef"
        dead.mkdir()
        (dead / "a").write_text("left by a crashed writer")
        mine = cache / "staging" / "my-notes"
        mine.mkdir()  # not a name the catalog gives its staging: never removed
        assert catalog.gc(min_age=timedelta(0)) == [str(dead)]
        assert mine.is_dir()
        assert (stage.path / "a").exists()


def test_a_writer_that_loses_the_manifest_put_returns_the_winners_version(
    catalog: Catalog, url: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer publishes the same version after our existence check, during our upload:
    # our conditional manifest PUT then fails, and we return their manifest, not ours.
    real_upload = ObjectStore.upload
    winner: list[Manifest | None] = []

    def upload_racing_another_writer(self: ObjectStore, local: Path, relative: str) -> None:
        real_upload(self, local, relative)
        if not winner:
            winner.append(None)  # the other writer's own uploads do not race again
            other = Catalog(url, cache_dir=cache.parent / "other-cache")
            winner.append(commit(other, "ds", FILES))

    monkeypatch.setattr(ObjectStore, "upload", upload_racing_another_writer)
    mine = commit(catalog, "ds", FILES)
    monkeypatch.undo()
    assert mine == winner[1]
    assert catalog.versions("ds") == [mine]
    assert catalog.verify() == []
    assert list((cache / "staging").iterdir()) == []


def test_create_is_a_conditional_put(url: str) -> None:
    store = ObjectStore(url, {})
    assert store.create("x/manifest.json", b"first")
    assert not store.create("x/manifest.json", b"second")
    assert store.read_text("x/manifest.json") == "first"


def test_gc_never_removes_prefixes_the_catalog_did_not_write(catalog: Catalog, url: str) -> None:
    fs = fsspec.filesystem("memory")
    stray = [f"{url}/datasets/ds/not-a-version/x", f"{url}/datasets/Not_A_Name/0123456789abcdef/x"]
    for path in stray:
        fs.pipe_file(path, b"someone else's")
    assert catalog.gc(min_age=timedelta(0)) == []
    assert catalog.names() == []
    assert all(fs.exists(path) for path in stray)
