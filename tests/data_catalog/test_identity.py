"""Pure parts: names, version ids, code version, manifest JSON."""

from __future__ import annotations

import json
import re

import pytest

from data_catalog import (
    FORMAT_VERSION,
    CatalogError,
    FileEntry,
    InvalidName,
    Manifest,
    ParentRef,
    ShardflowError,
    code_version,
    validate_name,
    version_id,
)


@pytest.mark.parametrize("name", ["a", "fashion-mnist", "mnist_5k", "0abc", "a" * 64])
def test_good_names_pass(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["../x", "Foo", "a/b", "", "a" * 65, "-a", "_a", "a b", "é"])
def test_bad_names_raise_invalid_name(name: str) -> None:
    with pytest.raises(InvalidName, match=re.escape(f"invalid dataset name {name!r}: use lower")):
        validate_name(name)


def test_invalid_name_is_a_user_facing_error() -> None:
    assert issubclass(InvalidName, ShardflowError)
    assert issubclass(InvalidName, CatalogError)


IDENTITY = {
    "name": "ds",
    "kind": "processed",
    "parents": [ParentRef(name="raw", version="0123456789abcdef")],
    "sources": [{"uri": "file:///x", "sha256": "ab"}],
    "parameters": {"b": 1, "a": [1, 2]},
    "code_version": "abc",
}


def test_version_id_is_a_pure_function_of_the_identity() -> None:
    first = version_id(**IDENTITY)  # type: ignore[arg-type]
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    # Key order and tuple-vs-list do not change the identity.
    same = {**IDENTITY, "parameters": {"a": (1, 2), "b": 1}, "parents": tuple(IDENTITY["parents"])}
    assert version_id(**same) == first  # type: ignore[arg-type]
    for field, value in [
        ("name", "other"),
        ("kind", "model"),
        ("parents", []),
        ("sources", []),
        ("parameters", {"b": 2, "a": [1, 2]}),
        ("code_version", "abd"),
    ]:
        assert version_id(**{**IDENTITY, field: value}) != first, field  # type: ignore[arg-type]


def test_version_id_is_the_documented_digest() -> None:
    import hashlib

    canonical = json.dumps(
        {
            "code_version": "c",
            "kind": "raw",
            "name": "n",
            "parameters": {},
            "parents": [],
            "sources": [],
        },
        separators=(",", ":"),
    )
    expected = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    got = version_id(name="n", kind="raw", parents=[], sources=[], parameters={}, code_version="c")
    assert got == expected


def test_code_version_is_a_commit_a_distribution_or_unknown() -> None:
    value = code_version()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|shardflow==\S+|unknown", value), value
    assert code_version() is value  # cached


def make_manifest() -> Manifest:
    return Manifest(
        format_version=FORMAT_VERSION,
        name="ds",
        version="0123456789abcdef",
        kind="raw",
        created="2024-01-01T00:00:00.000000+00:00",
        code_version="abc",
        parameters={"p": [1, 2]},
        parents=(ParentRef(name="up", version="fedcba9876543210"),),
        sources=({"uri": "file:///a"},),
        schema={"format": "idx"},
        statistics={"train_rows": 3},
        rows=3,
        files=(FileEntry(path="a/b.bin", bytes=4, sha256="00" * 32, rows=None, row_groups=None),),
        extra={},
    )


def test_manifest_round_trips_through_json() -> None:
    manifest = make_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert str(manifest.ref) == "ds@0123456789abcdef"
    assert json.loads(manifest.to_json())["files"][0]["path"] == "a/b.bin"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format_version=3), "format_version 3 is not supported"),
        (lambda d: d.pop("format_version"), "no format_version"),
        (lambda d: d.pop("rows"), "missing field 'rows'"),
        (lambda d: d.update(rows="3"), "field 'rows' is str, expected int"),
        (lambda d: d.update(files=[{"path": "x"}]), "missing field 'bytes'"),
    ],
)
def test_manifest_from_json_rejects_other_formats_and_garbage(mutate, message) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(make_manifest().to_json())
    mutate(data)
    with pytest.raises(CatalogError, match=re.escape(message)):
        Manifest.from_json(json.dumps(data))


def test_manifest_from_json_rejects_non_json() -> None:
    with pytest.raises(CatalogError, match="garbled manifest: not JSON"):
        Manifest.from_json('{"format_version": 1,')
