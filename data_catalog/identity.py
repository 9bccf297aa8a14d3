"""Version identity: which inputs make two versions the same.

A version id is a digest of what produced the version (name, kind, parents, sources, parameters
and code), not of its bytes, so a caller can know the id before doing the work and skip work that
is already committed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data_catalog.manifest import ParentRef


def canonical_json(value: Any) -> str:
    """The one JSON text of ``value`` that identities are hashed from.

    ``allow_nan=False`` because NaN is not JSON and would make manifests unreadable elsewhere.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def version_id(
    *,
    name: str,
    kind: str,
    parents: Sequence[ParentRef],
    sources: Sequence[Mapping[str, Any]],
    parameters: Mapping[str, Any],
    code_version: str,
) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of the identity fields."""
    identity = {
        "name": name,
        "kind": kind,
        "parents": [{"name": p.name, "version": p.version} for p in parents],
        "sources": [dict(s) for s in sources],
        "parameters": dict(parameters),
        "code_version": code_version,
    }
    return hashlib.sha256(canonical_json(identity).encode()).hexdigest()[:16]


def derived_version(
    *, name: str, kind: str, parents: Sequence[ParentRef], parameters: Mapping[str, Any]
) -> str:
    """The id of a version this code makes from other catalog versions (processed data from
    raw, a model from processed data): its parents, parameters and :func:`code_version`."""
    return version_id(
        name=name,
        kind=kind,
        parents=parents,
        sources=(),
        parameters=parameters,
        code_version=code_version(),
    )


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        result = subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        # Not a checkout, no git, or a repository without commits: fall back below.
        return None
    return result.stdout


@functools.cache
def code_version() -> str:
    """The code that produces versions: ``<commit>[-dirty]``, ``shardflow==X`` or ``unknown``.

    "-dirty" says the working tree differs from the commit without saying how, so versions made
    from a dirty tree are only as reproducible as that tree.
    """
    head = _git("rev-parse", "HEAD")
    if head and head.strip():
        status = _git("status", "--porcelain")
        dirty = status is None or bool(status.strip())
        return head.strip() + ("-dirty" if dirty else "")
    try:
        return f"shardflow=={importlib.metadata.version('shardflow')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
