"""The manifest: the one file that makes a version exist, and says what it holds.

``_manifest.json`` in a version directory (``manifest.json`` in versions written before folder
layout 2 of :mod:`data_catalog.layout`; both are found) lists every file with its size and
sha256, the version's identity (parents, sources, parameters, code version) and its schema and
statistics: free-form JSON to the catalog, a typed layout with a ``layout_version`` of its own
for what the ingests and preprocessing write there (:mod:`data_catalog.layout`). Readers check
the ``format_version`` before trusting any other field: 2 (:data:`FORMAT_VERSION`) says the
files' bytes are objects addressed by their sha256 (data_catalog/storage.py); 1, written
before, says they live under the version's own prefix. Both are read.

A committed manifest also carries ``manifest_digest``: the sha256 of its own content (every
other field, as canonical JSON). :meth:`Manifest.from_json` refuses a manifest whose content no
longer matches it (:class:`ManifestEdited`): a hand-edited row count or statistic is reported,
not trusted. The digest has no key: it catches edits and corruption, not a forger who recomputes
it (the catalog's checks of the fields against the files catch some of those). Manifests
written before the field existed have none and stay readable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from data_catalog.errors import CatalogError

FORMAT_VERSION = 2
# Every format this code reads (see the module docstring).
READABLE_FORMATS = (1, 2)
MANIFEST_NAME = "_manifest.json"
"""The manifest of a version written now: a name Parquet readers skip (a leading "_")."""
LEGACY_MANIFEST_NAME = "manifest.json"
"""The manifest of a version written before (folder layout 1): still found and read."""
MANIFEST_NAMES = (MANIFEST_NAME, LEGACY_MANIFEST_NAME)
"""Where a version's manifest may be, in the order readers look."""
DIGEST_FIELD = "manifest_digest"
# What `catalog verify` says of a manifest without a digest (written by shardflow before
# manifests carried one): readable, but its own fields are not protected.
NO_DIGEST_NOTE = (
    "no manifest digest (written before manifests carried one); the files are checked, "
    "the manifest's own fields are not protected against edits"
)


class ManifestEdited(CatalogError):
    """A manifest whose content no longer matches the digest recorded when it was committed."""


@dataclass(frozen=True, kw_only=True)
class ParentRef:
    """A reference to one committed version."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a version."""

    path: str
    """Relative to the version directory, '/'-separated."""
    bytes: int
    sha256: str
    rows: int | None
    """Row count: from the Parquet footer for ``*.parquet``, else what the writer declared."""
    row_groups: int | None
    """Parquet row groups; None for other files."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything the catalog knows about one version."""

    format_version: int
    name: str
    version: str
    kind: str
    created: str
    """ISO-8601 UTC, microseconds: orders versions of one dataset."""
    code_version: str
    parameters: dict[str, Any]
    parents: tuple[ParentRef, ...]
    sources: tuple[dict[str, Any], ...]
    schema: dict[str, Any]
    statistics: dict[str, Any]
    rows: int
    files: tuple[FileEntry, ...]
    extra: dict[str, Any]
    manifest_digest: str | None = None
    """sha256 of every other field (:func:`content_sha256`), recorded when the version was
    committed; None in manifests written before the catalog recorded it."""

    @property
    def ref(self) -> ParentRef:
        """This version as a parent of another."""
        return ParentRef(name=self.name, version=self.version)

    def to_json(self) -> str:
        data = {
            "format_version": self.format_version,
            "name": self.name,
            "version": self.version,
            "kind": self.kind,
            "created": self.created,
            "code_version": self.code_version,
            "parameters": self.parameters,
            "parents": [{"name": p.name, "version": p.version} for p in self.parents],
            "sources": list(self.sources),
            "schema": self.schema,
            "statistics": self.statistics,
            "rows": self.rows,
            "files": [
                {
                    "path": f.path,
                    "bytes": f.bytes,
                    "sha256": f.sha256,
                    "rows": f.rows,
                    "row_groups": f.row_groups,
                }
                for f in self.files
            ],
            "extra": self.extra,
        }
        if self.manifest_digest is not None:
            data[DIGEST_FIELD] = self.manifest_digest
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"

    def sealed(self) -> Manifest:
        """This manifest with ``manifest_digest`` set to the digest of its content."""
        data = json.loads(replace(self, manifest_digest=None).to_json())
        return replace(self, manifest_digest=content_sha256(data))

    def content_digest(self) -> str:
        """sha256 of everything the manifest says except when it was written: two runs that
        produced the same version, files, schema and statistics have the same digest.

        Unlike ``manifest_digest`` (which covers ``created`` and so differs between such runs),
        it leaves out ``created``, the notes on the run that committed it (``extra["run"]``:
        its seconds, its reused tasks) and the recorded digest itself.
        """
        data = json.loads(self.to_json())
        del data["created"]
        data["extra"].pop("run", None)
        data.pop(DIGEST_FIELD, None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, *, check_digest: bool = True) -> Manifest:
        """Parse a manifest; raise :class:`CatalogError` if it is garbled or of another format,
        and :class:`ManifestEdited` if its content no longer matches its recorded digest (unless
        ``check_digest`` is False: for ``verify``, which goes on to check the fields)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CatalogError(f"garbled manifest: not JSON ({exc})") from exc
        if not isinstance(data, dict) or "format_version" not in data:
            raise CatalogError(
                "garbled manifest: no format_version; it is not a shardflow manifest"
            )
        if (
            isinstance(data["format_version"], bool)
            or data["format_version"] not in READABLE_FORMATS
        ):
            raise CatalogError(
                f"manifest format_version {data['format_version']!r} is not supported "
                f"(this shardflow reads {', '.join(map(str, READABLE_FORMATS))}); upgrade shardflow"
            )
        manifest = cls(
            format_version=int(data["format_version"]),
            name=_typed(data, "name", str),
            version=_typed(data, "version", str),
            kind=_typed(data, "kind", str),
            created=_typed(data, "created", str),
            code_version=_typed(data, "code_version", str),
            parameters=_typed(data, "parameters", dict),
            parents=tuple(
                ParentRef(name=_typed(p, "name", str), version=_typed(p, "version", str))
                for p in _typed(data, "parents", list)
            ),
            sources=tuple(_object(s) for s in _typed(data, "sources", list)),
            schema=_typed(data, "schema", dict),
            statistics=_typed(data, "statistics", dict),
            rows=_typed(data, "rows", int),
            files=tuple(
                FileEntry(
                    path=_typed(f, "path", str),
                    bytes=_typed(f, "bytes", int),
                    sha256=_typed(f, "sha256", str),
                    rows=_optional_int(f, "rows"),
                    row_groups=_optional_int(f, "row_groups"),
                )
                for f in _typed(data, "files", list)
            ),
            extra=_typed(data, "extra", dict),
        )
        recorded = _optional_str(data, DIGEST_FIELD)
        if check_digest and recorded is not None and recorded != content_sha256(data):
            raise ManifestEdited(
                f"manifest of {manifest.ref} was edited after it was committed: its content no "
                f"longer matches its {DIGEST_FIELD}"
            )
        return replace(manifest, manifest_digest=recorded)


def content_sha256(data: Mapping[str, Any]) -> str:
    """sha256 of a manifest's JSON object without its ``manifest_digest``, as canonical JSON.

    Computed from the parsed JSON rather than from the :class:`Manifest`, so that a field this
    version of shardflow does not know (written by a newer one, or added by hand) counts too.
    """
    content = {k: v for k, v in data.items() if k != DIGEST_FIELD}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _typed(data: Any, key: str, kind: type[Any]) -> Any:
    value = _object(data).get(key)
    if key not in data:
        raise CatalogError(f"garbled manifest: missing field {key!r}")
    # bool is an int subclass; a count of True rows is a garbled manifest, not 1 row.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CatalogError(
            f"garbled manifest: field {key!r} is {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise CatalogError(f"garbled manifest: expected an object, found {type(data).__name__}")
    return data


def _optional_int(data: Any, key: str) -> int | None:
    if isinstance(data, dict) and data.get(key) is None:
        return None
    value: int = _typed(data, key, int)
    return value


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    if data.get(key) is None:
        return None
    value: str = _typed(data, key, str)
    return value
