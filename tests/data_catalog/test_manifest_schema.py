"""The JSON Schema of the manifest published in docs/catalog-storage.md holds for what the
catalog commits, and refuses a manifest a reader could not trust."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from data_catalog import Catalog
from tests.data_catalog.commit_helper import commit

DOC = Path(__file__).parents[2] / "docs" / "catalog-storage.md"


def published_schema() -> dict[str, Any]:
    text = DOC.read_text()
    section = text[text.index("### The manifest, as a JSON Schema") :]
    block = re.search(r"```json\n(.*?)\n```", section, re.S)
    assert block is not None, f"{DOC} has no JSON Schema block"
    schema: dict[str, Any] = json.loads(block.group(1))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def committed_manifest(tmp_path: Path) -> dict[str, Any]:
    catalog = Catalog(tmp_path / "catalog")
    parent = catalog.get("a", commit(tmp_path / "catalog", "a", 1))
    version = commit(tmp_path / "catalog", "b", 2, parents=(parent.ref,))
    text = (catalog.version_dir("b", version) / "_manifest.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def test_a_committed_manifest_matches_the_published_schema(tmp_path: Path) -> None:
    data = committed_manifest(tmp_path)
    assert data["parents"] and data["manifest_digest"]
    jsonschema.validate(data, published_schema())


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("files"),
        lambda m: m.update(kind="dataset"),
        lambda m: m["files"][0].update(sha256="not-a-digest"),
        lambda m: m.update(rows=-1),
        lambda m: m.update(unknown_field=1),
    ],
    ids=["no files", "unknown kind", "bad sha256", "negative rows", "unknown field"],
)
def test_the_schema_refuses_a_manifest_readers_could_not_trust(tmp_path: Path, edit: Any) -> None:
    data = committed_manifest(tmp_path)
    edit(data)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, published_schema())
