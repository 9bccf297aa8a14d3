"""Version identity: which inputs make two versions the same.

A version id is a digest of what produced the version (name, kind, parents, sources, parameters
and code), not of its bytes, so a caller can know the id before doing the work and skip work that
is already committed.

"Code" is the fingerprint of the stage that makes the version (:func:`source_fingerprint`): the
source of the modules that determine its bytes and the versions of the libraries that do, never
the repository's commit. A change to docs, tests or another stage's code changes no id; a change
to a module the stage imports changes that stage's ids (as Prefect 3 keys a task's cache on its
own source, and Dagster gives each asset a code version).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
    *,
    name: str,
    kind: str,
    parents: Sequence[ParentRef],
    parameters: Mapping[str, Any],
    code: str,
) -> str:
    """The id of a version made from other catalog versions (processed data from raw, a model
    from processed data): its parents, parameters and ``code``, the fingerprint of the stage
    that makes it (:func:`source_fingerprint`)."""
    return version_id(
        name=name,
        kind=kind,
        parents=parents,
        sources=(),
        parameters=parameters,
        code_version=code,
    )


def module_closure(
    roots: Iterable[str], *, within: Sequence[str], exclude: Sequence[str] = ()
) -> list[str]:
    """The modules ``roots`` import, directly or through each other, sorted: every ``import``
    statement of their source (at module level or inside a function), followed into modules
    whose top-level package is in ``within``; a module of ``exclude`` (or under one) is neither
    included nor followed."""

    def followed(name: str) -> bool:
        return name.split(".")[0] in within and not any(
            name == e or name.startswith(e + ".") for e in exclude
        )

    found: set[str] = set()
    pending = [r for r in roots if followed(r)]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        if _module_file(name) is None:
            continue  # "from package import name" where name is not a module
        found.add(name)
        pending += [n for n in _imported(name) if followed(n) and n not in found]
    return sorted(found)


def _imported(module: str) -> set[str]:
    """Modules named by the import statements of ``module``'s source (a ``from package import
    name`` counts ``package.name`` too: it may be a module)."""
    path = _module_file(module)
    if path is None:
        return set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _statements(ast.parse(path.read_bytes()).body):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return {n for n in names if n}


def _statements(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every statement of ``body`` and of the blocks inside it (functions, classes, if, try,
    with, loops, match cases): an import is a statement, so the expressions, most of a
    module's nodes, need no visit (``ast.walk`` visited them all: 60 % of a fingerprint)."""
    pending: list[ast.AST] = list(body)
    while pending:
        node = pending.pop()
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                pending += inner


@functools.cache
def _package_dir(top: str) -> Path | None:
    # Finding a top-level package runs nothing of it; its submodules are found by path, so that
    # fingerprinting imports none of the modules it reads.
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` (its ``__init__.py`` for a package), found by path under
    its top-level package; None when the name is no module (a class imported by name)."""
    top, *rest = module.split(".")
    base = _package_dir(top)
    if base is None:
        return None
    candidate = base.joinpath(*rest)
    for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
        if rest and path.is_file():
            return path
    return base / "__init__.py" if not rest and (base / "__init__.py").is_file() else None


def _installed(library: str) -> str:
    """The installed version of ``library``; "a|b" names one library under either of its
    distribution names (tensorflow-cpu on CPU hosts, tensorflow on GPU hosts)."""
    for name in library.split("|"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "absent"


def source_fingerprint(
    roots: Sequence[str],
    *,
    within: Sequence[str],
    exclude: Sequence[str] = (),
    libraries: Sequence[str] = (),
    facts: Mapping[str, int | str] | None = None,
) -> str:
    """``src-`` and 16 hex digits of the sha256 of the source of :func:`module_closure` (each
    module's name and bytes), of ``libraries``' installed versions and of ``facts`` (such as
    the version folder's layout, which lives outside the stage's modules): what a stage's
    output bytes and paths depend on, apart from its inputs and parameters.

    Reads source files only: none of the modules is imported."""
    digest = hashlib.sha256()
    for module in module_closure(roots, within=within, exclude=exclude):
        path = _module_file(module)
        if path is None:
            continue  # "from package import name" where name is not a module
        digest.update(f"{module}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    for library in sorted(libraries):
        digest.update(f"{library}=={_installed(library)}\0".encode())
    for fact, value in sorted((facts or {}).items()):
        digest.update(f"{fact}={value}\0".encode())
    return "src-" + digest.hexdigest()[:16]


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
    """The checkout this process runs: ``<commit>[-dirty]``, ``shardflow==X`` or ``unknown``.

    Provenance only (a manifest's ``extra["checkout"]``), never identity: versions are keyed by
    their stage's :func:`source_fingerprint`. "-dirty" says the working tree differs from the
    commit without saying how.
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
