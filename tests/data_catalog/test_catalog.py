"""The catalog in one process: commit, read, verify, lineage, gc, index."""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, CatalogError, InvalidName, Manifest, NotFound, ParentRef

CODE = "test-code"


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def commit(
    catalog: Catalog,
    name: str,
    files: Mapping[str, bytes],
    *,
    kind: str = "raw",
    parameters: Mapping[str, Any] | None = None,
    parents: tuple[ParentRef, ...] = (),
    sources: tuple[Mapping[str, Any], ...] = (),
) -> Manifest:
    with catalog.stage(name, kind=kind) as stage:
        for relpath, data in files.items():
            path = stage.path / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return stage.commit(
            parents=parents,
            sources=sources,
            parameters=parameters or {},
            rows=len(files),
            code_version=CODE,
        )


FILES = {"a.txt": b"alpha\n", "sub/b.bin": b"\x00\x01" * 1000}


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return Catalog(tmp_path / "catalog")


def test_a_new_catalog_is_empty_and_creates_nothing(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    assert catalog.names() == []
    assert catalog.versions("ds") == []
    assert catalog.verify() == []
    assert catalog.gc() == []
    assert not (tmp_path / "catalog").exists()


def test_commit_then_read_back(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", FILES, sources=({"uri": "file:///src"},))
    assert catalog.names() == ["ds"]
    assert catalog.exists("ds", manifest.version)
    assert catalog.get("ds") == manifest
    assert catalog.get("ds", manifest.version) == manifest
    assert catalog.get("ds", manifest.version[:6]) == manifest  # a unique prefix
    assert catalog.versions("ds") == [manifest]
    assert [f.path for f in manifest.files] == ["a.txt", "sub/b.bin"]
    assert [f.bytes for f in manifest.files] == [6, 2000]
    entry = manifest.files[1]
    assert catalog.file_path(manifest, entry).read_bytes() == FILES["sub/b.bin"]
    assert catalog.file_path(manifest, entry).is_absolute()
    assert manifest.rows == 2 and manifest.kind == "raw" and manifest.code_version == CODE
    assert list((catalog.root / "staging").iterdir()) == []


def test_same_identity_gives_the_same_version_and_writes_nothing(catalog: Catalog) -> None:
    first = commit(catalog, "ds", FILES, parameters={"k": 1})
    before = files_under(catalog.root)
    mtime = (catalog.version_dir("ds", first.version) / "_manifest.json").stat().st_mtime_ns
    second = commit(catalog, "ds", FILES, parameters={"k": 1})
    assert second == first
    assert files_under(catalog.root) == before
    manifest_path = catalog.version_dir("ds", first.version) / "_manifest.json"
    assert manifest_path.stat().st_mtime_ns == mtime
    assert list((catalog.root / "staging").iterdir()) == []
    assert len(catalog.versions("ds")) == 1


def test_run_notes_are_kept_beside_the_data_and_do_not_change_the_version(
    catalog: Catalog,
) -> None:
    with catalog.stage("noted", kind="raw") as stage:
        (stage.path / "a.txt").write_bytes(b"alpha\n")
        stage.note_run(seconds=1.5, passes={"convert": {"tasks": 1}})
        noted = stage.commit(rows=1, code_version=CODE)
    run = noted.extra["run"]
    assert run["seconds"] == 1.5 and run["passes"] == {"convert": {"tasks": 1}}
    assert run["checkout"]  # the checkout that committed it: provenance, not identity
    assert catalog.get("noted", noted.version).extra == noted.extra
    plain = commit(catalog, "noted", {"a.txt": b"alpha\n"}, parameters={})
    assert plain.version == noted.version  # the same data, already committed
    # Two runs that made the same data: the same content, however long each took.
    assert replace(noted, extra={}).content_digest() == noted.content_digest()
    assert replace(noted, rows=2).content_digest() != noted.content_digest()


def test_other_parameters_give_a_new_version_and_latest_is_newest(catalog: Catalog) -> None:
    old = commit(catalog, "ds", FILES, parameters={"k": 1})
    new = commit(catalog, "ds", FILES, parameters={"k": 2})
    assert new.version != old.version
    assert catalog.versions("ds") == [old, new]
    assert catalog.get("ds") == new


def test_leaving_the_block_without_commit_or_with_an_error_removes_staging(
    catalog: Catalog,
) -> None:
    with catalog.stage("ds", kind="raw") as stage:
        (stage.path / "a").write_text("x")
    assert not stage.path.exists()
    with pytest.raises(RuntimeError, match="boom"), catalog.stage("ds", kind="raw") as stage:
        (stage.path / "a").write_text("x")
        raise RuntimeError("boom")
    assert list((catalog.root / "staging").iterdir()) == []
    assert catalog.names() == []


def test_stage_checks_name_and_kind(catalog: Catalog) -> None:
    with pytest.raises(InvalidName, match=re.escape("invalid dataset name '../x'")):
        catalog.stage("../x", kind="raw")
    with pytest.raises(CatalogError, match="invalid kind 'table': use one of raw, processed"):
        catalog.stage("ds", kind="table")


def test_a_staged_manifest_json_is_refused(catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match=re.escape("'manifest.json' is reserved")):
        commit(catalog, "ds", {"manifest.json": b"{}"})
    assert catalog.names() == []


def test_unknown_names_and_versions_raise_not_found(catalog: Catalog) -> None:
    with pytest.raises(NotFound, match=r"no dataset 'nope' in catalog .*; run `shardflow catalog"):
        catalog.get("nope")
    commit(catalog, "ds", FILES)
    with pytest.raises(NotFound, match="no version 'ffffffffffffffff' of dataset 'ds'"):
        catalog.get("ds", "ffffffffffffffff")
    with pytest.raises(InvalidName, match=re.escape("invalid version '../x'")):
        catalog.get("ds", "../x")


def test_verify_names_each_damaged_file(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", {"flip.bin": b"abcdef", "cut.bin": b"123456", "gone": b"x"})
    commit(catalog, "other", FILES)
    assert catalog.verify() == []
    path = {f.path: catalog.file_path(manifest, f) for f in manifest.files}
    path["flip.bin"].write_bytes(b"abcdeF")
    path["cut.bin"].write_bytes(b"1234")
    path["gone"].unlink()
    problems = {(p.path, p.reason) for p in catalog.verify()}
    assert problems == {
        (str(path["flip.bin"]), "sha256 mismatch"),
        (str(path["cut.bin"]), "size 4 != manifest 6"),
        (str(path["gone"]), "missing"),
    }
    assert {(p.path, p.reason) for p in catalog.verify("ds", manifest.version)} == problems
    assert catalog.verify("other") == []


def test_verify_reports_unreadable_manifests_and_extra_files(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", FILES)
    directory = catalog.version_dir("ds", manifest.version)
    (directory / "stray.txt").write_text("not mine")
    assert [(p.path, p.reason) for p in catalog.verify()] == [
        (str(directory / "stray.txt"), "not in manifest")
    ]
    (directory / "_manifest.json").write_text('{"format_version": 1, "name"')
    [problem] = catalog.verify()
    assert problem.path == str(directory / "_manifest.json")
    assert problem.reason.startswith("unreadable manifest: garbled manifest")
    with pytest.raises(CatalogError, match="run `shardflow catalog verify ds`"):
        catalog.get("ds")


def test_parquet_rows_and_row_groups_are_recorded(catalog: Catalog) -> None:
    table = pa.table({"x": list(range(25))})
    with catalog.stage("pq", kind="processed") as stage:
        (stage.path / "train").mkdir()
        pq.write_table(table, stage.path / "train" / "part-00000.parquet", row_group_size=10)
        (stage.path / "labels.txt").write_text("a\nb\n")
        manifest = stage.commit(rows=25, file_rows={"labels.txt": 2}, code_version=CODE)
    files = {f.path: f for f in manifest.files}
    assert (
        files["train/part-00000.parquet"].rows,
        files["train/part-00000.parquet"].row_groups,
    ) == (
        25,
        3,
    )
    assert (files["labels.txt"].rows, files["labels.txt"].row_groups) == (2, None)


def test_lineage_reaches_the_raw_sources(catalog: Catalog) -> None:
    raw = commit(catalog, "raw", FILES, sources=({"uri": "https://example.org/a.gz"},))
    processed = commit(catalog, "raw-processed", FILES, kind="processed", parents=(raw.ref,))
    ghost = ParentRef(name="ghost", version="0123456789abcdef")
    model = commit(catalog, "raw-cnn", FILES, kind="model", parents=(processed.ref, ghost))
    assert catalog.lineage("raw-cnn") == {
        "name": "raw-cnn",
        "version": model.version,
        "kind": "model",
        "sources": [],
        "parents": [
            {
                "name": "raw-processed",
                "version": processed.version,
                "kind": "processed",
                "sources": [],
                "parents": [
                    {
                        "name": "raw",
                        "version": raw.version,
                        "kind": "raw",
                        "sources": [{"uri": "https://example.org/a.gz"}],
                        "parents": [],
                    }
                ],
            },
            {"name": "ghost", "version": "0123456789abcdef", "missing": True},
        ],
    }
    assert catalog.search(parent=raw.ref) == [processed]
    assert catalog.search(kind="model") == [model]


def index_rows(catalog: Catalog) -> set[tuple[str, str]]:
    with sqlite3.connect(catalog.root / "index.sqlite") as db:
        return set(db.execute("SELECT name, version FROM versions"))


def on_disk(catalog: Catalog) -> set[tuple[str, str]]:
    return {(m.name, m.version) for n in catalog.names() for m in catalog.versions(n)}


def test_reindex_after_deleting_the_index_gives_the_same_listing(catalog: Catalog) -> None:
    raw = commit(catalog, "raw", FILES)
    commit(catalog, "raw", FILES, parameters={"k": 2})
    commit(catalog, "raw-processed", FILES, kind="processed", parents=(raw.ref,))
    listing = {n: catalog.versions(n) for n in catalog.names()}
    assert index_rows(catalog) == on_disk(catalog)
    os.remove(catalog.root / "index.sqlite")
    assert {n: catalog.versions(n) for n in catalog.names()} == listing
    assert catalog.reindex() == 3
    assert index_rows(catalog) == on_disk(catalog)
    assert {n: catalog.versions(n) for n in catalog.names()} == listing


def test_search_repairs_a_deleted_or_stale_index(catalog: Catalog) -> None:
    raw = commit(catalog, "raw", FILES)
    os.remove(catalog.root / "index.sqlite")
    assert catalog.search(kind="raw") == [raw]
    with sqlite3.connect(catalog.root / "index.sqlite") as db:
        db.execute("DELETE FROM versions")
    assert catalog.search() == [raw]
    # A commit into a catalog whose index was deleted rebuilds it whole.
    os.remove(catalog.root / "index.sqlite")
    other = commit(catalog, "other", FILES)
    assert index_rows(catalog) == {("raw", raw.version), ("other", other.version)}


def test_gc_keeps_live_staging_and_committed_versions(catalog: Catalog) -> None:
    manifest = commit(catalog, "ds", FILES)
    with catalog.stage("ds", kind="raw") as stage:
        (stage.path / "a").write_text("in progress")
        assert catalog.gc() == []
        assert (stage.path / "a").exists()
    assert catalog.verify() == []
    assert catalog.versions("ds") == [manifest]


def test_files_described_by_their_writers_are_not_read_again(tmp_path: Path) -> None:
    import hashlib

    from data_catalog import FileEntry

    catalog = Catalog(tmp_path / "catalog")
    data = b"written elsewhere, hashed while written"
    entry = FileEntry(
        path="part.bin",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        rows=7,
        row_groups=None,
    )
    with catalog.stage("described", kind="raw") as stage:
        (stage.path / "part.bin").write_bytes(data)
        manifest = stage.commit(rows=7, described={"part.bin": entry}, code_version=CODE)
    assert manifest.files == (entry,)
    assert catalog.verify("described") == []

    with catalog.stage("described", kind="raw") as stage:
        (stage.path / "part.bin").write_bytes(data + b"!")  # not what its writer said
        with pytest.raises(CatalogError, match="its writer described"):
            stage.commit(rows=7, described={"part.bin": entry}, code_version="other")
