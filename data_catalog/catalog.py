"""The catalog: immutable, verifiable versions of datasets and models, with lineage.

Layout under the root::

    objects/<aa>/<sha256>                      every file of every version, stored once
    objects/.lock                              flock: writers link objects (shared), gc (exclusive)
    datasets/<name>/.lock                      flock held while a version of <name> is published
    datasets/<name>/<version>/_manifest.json   present = the version is committed (manifest.json
                                               in versions of folder layout 1: still read)
    datasets/<name>/<version>/<files...>       local roots: hard links to the objects
    staging/<id>/                              a writer's files before commit
    staging/<id>.lock                          flock held by the live writer of staging/<id>
    index.sqlite                               SQL cache of the manifests (default index URL)

A version becomes visible in one step, when ``_manifest.json`` appears; everything before that
(staged files, a moved directory without manifest, objects no version holds) is invisible and
removed by :meth:`Catalog.gc`. Two versions that hold the same bytes share one object: a new
version that keeps most of its parent's files stores only the new ones
(:meth:`Staging.reuse` puts a committed file into a staging without copying it).

A root given as a URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``) keeps the same
``objects/`` and ``datasets/`` layout on that filesystem through fsspec (a version there is its
manifest; its files are read at their objects), and ``staging/`` and ``index.sqlite`` in a local
cache directory; see :mod:`data_catalog.storage` and README.md, "Object storage".
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from types import MappingProxyType, TracebackType
from typing import Any

from data_catalog import identity, openlineage_events
from data_catalog.data_files import data_entries
from data_catalog.durability import exclusive_lock, failpoint, fsync_dir, make_dirs, try_lock
from data_catalog.errors import CatalogError, NotFound
from data_catalog.index import Index, IndexUnusable
from data_catalog.layout import ProcessedLayout
from data_catalog.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MANIFEST_NAMES,
    NO_DIGEST_NOTE,
    FileEntry,
    Manifest,
    ManifestEdited,
    ParentRef,
)
from data_catalog.names import (
    NAME_PATTERN,
    VERSION_PATTERN,
    validate_kind,
    validate_name,
    validate_version,
    validate_version_prefix,
)
from data_catalog.object_store import default_cache_dir, is_url, local_path_of
from data_catalog.staged_files import describe_and_sync
from data_catalog.storage import LocalStorage, ObjectStorage, object_key

log = logging.getLogger(__name__)

_EMPTY: Mapping[str, Any] = MappingProxyType({})
# What Catalog.stage names a staging folder: "<dataset name>-<16 hex digits>".
_STAGING_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}-[0-9a-f]{16}")
# A URL catalog's gc leaves a version prefix without manifest alone until its newest object is
# this old: a live writer may still be uploading into it (there is no lock to ask).
DEFAULT_GC_MIN_AGE = timedelta(hours=1)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing ``verify`` found wrong."""

    path: str
    """The absolute path (for a URL catalog, the URL) of the bad file or manifest."""
    reason: str
    """What differs; a manifest field that disagrees with the files is named."""


@dataclass(frozen=True, kw_only=True)
class Verification:
    """What :meth:`Catalog.verify_report` found."""

    problems: tuple[Problem, ...]
    """Damage: files or manifests that are not as committed. Empty when all is well."""
    notes: tuple[Problem, ...]
    """What could not be checked, without being wrong (a manifest written before manifests
    carried a digest)."""
    versions: int
    """How many versions were checked."""


# A data-level check that a layer above the catalog passes to verify (the catalog does not know
# what a processed image split should hold): the problems it finds in one parsed manifest.
ManifestCheck = Callable[["Catalog", Manifest], Sequence[Problem]]


class Catalog:
    """Versions under ``root``; the index at ``index_url`` (default ``<root>/index.sqlite``).

    ``root`` is a local path (or ``file://`` URL), or the URL of any fsspec filesystem
    (``s3://bucket/prefix``, ``gs://``, ``hdfs://``, ``memory://``); ``storage_options`` are
    passed to that filesystem (credentials, ``client_kwargs={"endpoint_url": ...}``). A URL
    catalog stages files and keeps its SQLite index in ``cache_dir`` on local disk (default
    ``$XDG_CACHE_HOME/shardflow/catalogs/<hash of the URL>``).

    Nothing is created on disk until the first write.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        index_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        local_root: str | os.PathLike[str] | None = root
        if is_url(root):
            local_root = local_path_of(str(root))
        self._store: ObjectStorage | None = None
        self._root: Path | None = None
        if local_root is None:
            self._store = ObjectStorage(str(root), storage_options or {})
            self._storage: LocalStorage | ObjectStorage = self._store
            self._local = (
                Path(cache_dir).absolute()
                if cache_dir is not None
                else default_cache_dir(self._store.url)
            )
        else:
            if storage_options or cache_dir is not None:
                raise CatalogError(
                    f"catalog {root} is a local path: storage_options and cache_dir apply only "
                    "to a URL root such as s3://bucket/prefix"
                )
            self._root = Path(local_root).absolute()
            self._local = self._root
            self._storage = LocalStorage(self._root)
        self.url: str = self._storage.url
        """The root: a URL, or for a local catalog its absolute path."""
        self._index = Index(index_url or f"sqlite:///{self._local / 'index.sqlite'}")

    def __repr__(self) -> str:
        return f"Catalog({self.url!r})"

    @property
    def root(self) -> Path:
        """The local root directory; a :class:`CatalogError` for a URL catalog (see ``url``)."""
        if self._root is None:
            raise CatalogError(f"catalog {self.url} is not on a local filesystem; use .url")
        return self._root

    def check(self) -> None:
        """Refuse, before any work, a root the catalog cannot use: for a URL root, a bucket
        that does not exist or credentials the store refuses (:meth:`ObjectStorage.check`);
        a local root is made on first write."""
        if self._store is not None:
            self._store.check()

    @property
    def is_local(self) -> bool:
        """Whether the catalog is a local directory (else a URL through fsspec)."""
        return self._store is None

    @property
    def _staging(self) -> Path:
        return self._local / "staging"

    # --- paths ------------------------------------------------------------------------------

    def version_dir(self, name: str, version: str) -> Path:
        """The version's local directory; a :class:`CatalogError` for a URL catalog."""
        if self._store is not None:
            raise CatalogError(
                f"{name}@{version} of catalog {self.url} is not on a local filesystem; "
                "use version_url"
            )
        return self.root / "datasets" / validate_name(name) / validate_version(version)

    def version_url(self, name: str, version: str) -> str:
        """The version's directory as a URL (for a local catalog, its absolute path)."""
        if self._store is None:
            return str(self.version_dir(name, version))
        return self._store.url_of(_version_key(name, version))

    def split_dir(self, manifest: Manifest, split: str) -> Path:
        """The local folder of ``split`` of a processed version: ``split=<split>/``, or
        ``<split>/`` in a version of folder layout 1 (its manifest's ``schema.splits`` says
        which); a :class:`CatalogError` for a URL catalog."""
        folder = ProcessedLayout.of(manifest).folder(split)
        return self.version_dir(manifest.name, manifest.version) / folder

    def split_url(self, manifest: Manifest, split: str) -> str:
        """:meth:`split_dir` as a URL under the catalog's (for a local catalog, a path)."""
        folder = ProcessedLayout.of(manifest).folder(split)
        return f"{self.version_url(manifest.name, manifest.version)}/{folder}"

    def file_path(self, manifest: Manifest, entry: FileEntry) -> Path:
        """Absolute path of ``entry``; refuses entries that would leave the version directory.

        A :class:`CatalogError` for a URL catalog: use :meth:`file_url`.
        """
        parts = _entry_parts(manifest, entry)
        if self._store is not None:
            raise CatalogError(
                f"{entry.path} of {manifest.ref} in catalog {self.url} is not on a local "
                "filesystem; use file_url"
            )
        return self.version_dir(manifest.name, manifest.version).joinpath(*parts)

    def file_url(self, manifest: Manifest, entry: FileEntry) -> str:
        """Full URL of ``entry``'s bytes (for a local catalog, the absolute path of the file in
        the version's folder), for fsspec or pyarrow."""
        return self._storage.url_of(_bytes_key(self, manifest, entry))

    def files(
        self, name: str, version: str | None = None, *, split: str | None = None
    ) -> list[str]:
        """The data files of ``name@version`` (newest when None), each checked against the
        manifest (size, sha256, Parquet footer), as paths or object URLs for a Parquet reader:
        ``dd.read_parquet(files)``, DuckDB's ``read_parquet(files)``, ``pl.scan_parquet(files)``,
        ``pyarrow.dataset.dataset(files)``, Spark's ``spark.read.parquet(*files)``.

        A processed version's files of ``split`` (default: every split; never its quarantine
        or metadata); other kinds: their Parquet files. See :mod:`data_catalog.data_files`.
        A :class:`CatalogError` naming the first file that is not as committed.
        """
        manifest = self.get(name, version)
        where = [
            (entry, _bytes_key(self, manifest, entry)) for entry in data_entries(manifest, split)
        ]
        for entry, key in where:
            problem = _check_bytes(self._storage, key, entry, self._storage.size(key))
            if problem is not None:
                raise CatalogError(
                    f"{manifest.ref}: {problem.path}: {problem.reason}; run "
                    f"`shardflow catalog verify {manifest.name}`"
                )
        return [self._storage.url_of(key) for _, key in where]

    def manifest_location(self, name: str, version: str) -> str:
        """The URL (local: path) of the version's manifest: ``_manifest.json``, or
        ``manifest.json`` in a version written in folder layout 1."""
        return self._manifest_where(name, version)[1]

    def _manifest_where(self, name: str, version: str) -> tuple[str, str]:
        """The version's manifest key and its URL (local: path), found once: on an object
        store each look for a manifest name is a request."""
        key = self._manifest_key(_version_key(name, version))
        return key, self._storage.url_of(key)

    def _manifest_key(self, key: str) -> str:
        """The manifest's key under the version key ``key``: the first of
        :data:`MANIFEST_NAMES` that exists (the current name when none does)."""
        for name in MANIFEST_NAMES:
            if self._storage.exists(f"{key}/{name}"):
                return f"{key}/{name}"
        return f"{key}/{MANIFEST_NAME}"

    def _has_manifest(self, key: str) -> bool:
        return any(self._storage.exists(f"{key}/{name}") for name in MANIFEST_NAMES)

    # --- reading ----------------------------------------------------------------------------

    def exists(self, name: str, version: str) -> bool:
        """Whether ``name@version`` is committed."""
        return self._has_manifest(_version_key(name, version))

    def names(self) -> list[str]:
        """Names with at least one committed version, sorted.

        A folder under ``datasets/`` that is no valid name is not the catalog's and is left
        out (``versions`` would refuse the name)."""
        return sorted(
            {name for name, _ in self._committed() if NAME_PATTERN.fullmatch(name) is not None}
        )

    def versions(self, name: str, *, unreadable: list[Problem] | None = None) -> list[Manifest]:
        """Committed versions of ``name``, oldest first (ties by version id); [] if none.

        A manifest that cannot be read raises a :class:`CatalogError`; with ``unreadable``
        (a list), it is appended there as a :class:`Problem` instead and the versions that
        can be read are returned, so that one corrupt manifest does not hide the others."""
        manifests = []
        for _, version in self._committed(validate_name(name)):
            try:
                manifests.append(self._read_manifest(name, version))
            except CatalogError as exc:
                if unreadable is None:
                    raise
                path = self.manifest_location(name, version)
                unreadable.append(Problem(path=path, reason=str(exc)))
        return sorted(manifests, key=lambda m: (m.created, m.version))

    def get(self, name: str, version: str | None = None) -> Manifest:
        """The manifest of ``name@version``; the newest version when ``version`` is None.

        ``version`` may be a unique prefix of a version id.
        """
        if version is None:
            versions = self.versions(name)
            if not versions:
                raise NotFound(
                    f"no dataset {name!r} in catalog {self.url}; run `shardflow catalog list`"
                )
            return versions[-1]
        return self._read_manifest(name, self._resolve(name, version))

    def lineage(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The tree of ``name@version`` and its ancestors, each with kind and sources.

        A parent that is not in the catalog appears as ``{"name", "version", "missing": True}``.
        """
        return self._lineage_of(self.get(name, version))

    def _lineage_of(self, manifest: Manifest) -> dict[str, Any]:
        parents: list[dict[str, Any]] = []
        for parent in manifest.parents:
            if self.exists(parent.name, parent.version):
                parents.append(self._lineage_of(self.get(parent.name, parent.version)))
            else:
                parents.append({"name": parent.name, "version": parent.version, "missing": True})
        node: dict[str, Any] = {
            "name": manifest.name,
            "version": manifest.version,
            "kind": manifest.kind,
            "sources": list(manifest.sources),
            "parents": parents,
        }
        # A version its writer grew from an earlier one: which parts are new since that one.
        new_since = manifest.extra.get("run", {}).get("new_since")
        if new_since is not None:
            node["new_since"] = new_since
        return node

    def search(self, *, kind: str | None = None, parent: ParentRef | None = None) -> list[Manifest]:
        """Versions of ``kind`` and/or with ``parent``, oldest first, answered by the index.

        The index is rebuilt first if it is missing or disagrees with the manifests on disk.
        """
        if kind is not None:
            validate_kind(kind)
        if not self._storage.exists("datasets"):
            return []
        make_dirs(self._local)
        on_disk = set(self._committed())
        if self._index.ensure_tables() or self._index.entries() != on_disk:
            log.info("catalog index at %s is stale; rebuilding it", self._index.url)
            self.reindex()
        return [self._read_manifest(n, v) for n, v in self._index.search(kind=kind, parent=parent)]

    # --- checking ---------------------------------------------------------------------------

    def verify(
        self,
        name: str | None = None,
        version: str | None = None,
        *,
        checks: Sequence[ManifestCheck] = (),
    ) -> list[Problem]:
        """Check the selected committed versions; [] when every one is as its manifest says.

        All versions when ``name`` is None; all of ``name`` when ``version`` is None. See
        :meth:`verify_report`, which also returns what could not be checked.
        """
        return list(self.verify_report(name, version, checks=checks).problems)

    def verify_report(
        self,
        name: str | None = None,
        version: str | None = None,
        *,
        checks: Sequence[ManifestCheck] = (),
    ) -> Verification:
        """Check the selected committed versions against their manifests, and each manifest
        against its own digest.

        For every version: the manifest's ``manifest_digest`` (a manifest edited after its commit
        is a problem naming the version; one written before manifests carried a digest, a note);
        every file's size and sha256; every Parquet file's rows and row groups from its footer
        against the manifest's entry (read only when the bytes match: otherwise the digest
        already tells); no file that the manifest does not list. Then, when every file is
        intact, each of ``checks``: data-level checks that need to know the dataset kind, from
        the layers above (``preprocessing.verify_processed.check_processed``).
        """
        if name is None:
            selected = list(self._committed())
        elif version is None:
            selected = list(self._committed(validate_name(name)))
        else:
            selected = [(name, self._resolve(name, version))]
        problems: list[Problem] = []
        notes: list[Problem] = []
        for n, v in selected:
            found, noted = self._verify_version(n, v, checks)
            problems += found
            notes += noted
        return Verification(problems=tuple(problems), notes=tuple(notes), versions=len(selected))

    def _verify_version(
        self, name: str, version: str, checks: Sequence[ManifestCheck]
    ) -> tuple[list[Problem], list[Problem]]:
        key, location = self._manifest_where(name, version)
        try:
            text = self._storage.read_text(key)
        except (OSError, UnicodeDecodeError) as exc:
            return [Problem(path=location, reason=f"unreadable manifest: {exc}")], []
        manifest, problems, notes = _parse_for_verify(text, location, name, version)
        if manifest is None:
            return problems, notes
        damaged = self._verify_files(manifest, location)
        if damaged:
            # The data-level checks would recompute statistics from damaged bytes and blame
            # the manifest for them.
            return [*problems, *damaged], notes
        for check in checks:
            problems += check(self, manifest)
        return problems, notes

    def _verify_files(self, manifest: Manifest, location: str) -> list[Problem]:
        """Every file's size, sha256 and (Parquet) footer counts where its bytes are, and no
        file in the version's folder that the manifest does not list; ``location`` is the
        manifest's own."""
        storage = self._storage
        key = _version_key(manifest.name, manifest.version)
        in_folder = storage.files_under(key)  # one listing instead of a look per file
        problems = []
        listed = {location.rsplit("/", 1)[-1]}  # the manifest's own name
        for entry in manifest.files:
            try:
                where = _bytes_key(self, manifest, entry)
            except CatalogError as exc:
                problems.append(Problem(path=location, reason=str(exc)))
                continue
            if where.startswith(f"{key}/"):
                listed.add(where[len(key) + 1 :])
                size = in_folder.get(where[len(key) + 1 :])
            else:
                size = storage.size(where)
            problem = _check_bytes(storage, where, entry, size)
            if problem is not None:
                problems.append(problem)
        for relpath in sorted(set(in_folder) - listed):
            problems.append(
                Problem(path=storage.url_of(f"{key}/{relpath}"), reason="not in manifest")
            )
        return problems

    # --- writing ----------------------------------------------------------------------------

    def stage(self, name: str, *, kind: str) -> Staging:
        """A fresh staging directory for a new version of ``name``; use it as a context manager."""
        validate_name(name)
        validate_kind(kind)
        make_dirs(self._staging)
        while True:
            staging_id = f"{name}-{secrets.token_hex(8)}"
            lock_path = self._staging / f"{staging_id}.lock"
            lock_fd = try_lock(lock_path, create=True)
            if lock_fd is not None:
                break
        path = self._staging / staging_id
        path.mkdir()
        return Staging(catalog=self, name=name, kind=kind, path=path, lock_fd=lock_fd)

    def _publish(self, staging: Staging, manifest: Manifest) -> Manifest:
        """Steps 2-4 of a commit: the staged files into objects (and, on a local root, into the
        version's folder), then the manifest, then the index.

        The manifest written records the digest of its own content, which every later read
        checks. A local root holds the dataset's lock from the move to the manifest; a URL
        root needs none: two writers of one version store the same objects, and the manifest
        is created once (conditional PUT).
        """
        manifest = manifest.sealed()
        key = _version_key(manifest.name, manifest.version)
        with self._publishing(manifest.name):
            if self.exists(manifest.name, manifest.version):
                # Another writer finished the same version while we staged: keep theirs.
                staging.discard()
                return self.get(manifest.name, manifest.version)
            if self._store is not None:
                self._upload_objects(self._store, staging, manifest)
            else:
                self._move_into_objects(staging, manifest)
            try:
                created = self._storage.create(
                    f"{key}/{MANIFEST_NAME}", manifest.to_json().encode("utf-8")
                )
            except BaseException:
                if self._store is None:
                    # No manifest, no version: nothing half-made is left behind.
                    shutil.rmtree(self.version_dir(manifest.name, manifest.version), True)
                raise
        if not created:
            staging.discard()  # another writer published the same version first
            return self.get(manifest.name, manifest.version)
        if self._store is not None:
            self._upload_objects(self._store, staging, manifest, only_missing=True)
        staging.discard()
        self._record(manifest)
        openlineage_events.emit_committed(self.url, manifest)  # nothing unless configured
        return manifest

    @contextlib.contextmanager
    def _publishing(self, name: str) -> Iterator[None]:
        """A local root's lock on the dataset while a version of it is published."""
        if self._store is not None:
            yield
            return
        dataset_dir = self.root / "datasets" / name
        make_dirs(dataset_dir)
        with exclusive_lock(dataset_dir / ".lock"):
            yield

    def _move_into_objects(self, staging: Staging, manifest: Manifest) -> None:
        """The staging folder becomes the version's folder (one rename), each of its files a
        link to its object (:meth:`LocalStorage.store_objects`)."""
        assert isinstance(self._storage, LocalStorage)
        dataset_dir = self.root / "datasets" / manifest.name
        directory = dataset_dir / manifest.version
        if directory.exists():
            shutil.rmtree(directory)  # a crashed commit's leftover, never visible
        os.rename(staging.path, directory)
        staging._release()
        fsync_dir(dataset_dir)
        fsync_dir(self._staging)
        try:
            failpoint("moved")
            self._storage.store_objects(
                directory,
                {f.path: f.sha256 for f in manifest.files if f.path not in staging.linked_objects},
            )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def _upload_objects(
        self,
        store: ObjectStorage,
        staging: Staging,
        manifest: Manifest,
        *,
        only_missing: bool = False,
    ) -> None:
        """Every file of ``manifest`` whose object is not in the store, uploaded from the
        staging (a reused file from its parent's bytes); then every object's size checked.

        Run again after the manifest (``only_missing``): a ``gc`` that listed the manifests
        before this one appeared may have removed an old object this version reuses."""
        uploads = 0
        for entry in manifest.files:
            target = object_key(entry.sha256)
            if store.size(target) == entry.bytes:
                continue
            staged = staging.path / entry.path
            if staged.is_file():
                store.upload(staged, target)
            elif entry.path in staging.reused_from:
                store.copy(staging.reused_from[entry.path], target)
            else:
                raise CatalogError(
                    f"object {store.url_of(target)} of {entry.path} is missing and was not "
                    f"staged; {manifest.ref} was not committed, commit it again"
                )
            uploads += 1
            if uploads == 1 and not only_missing:
                failpoint("after_first_file")
        for entry in manifest.files:
            target = object_key(entry.sha256)
            size = store.size(target)
            if size != entry.bytes:
                # Left for gc (or overwritten by a rerun); nothing is published.
                raise CatalogError(
                    f"uploaded {store.url_of(target)} has {size if size is not None else 'no'} "
                    f"bytes, staged {entry.bytes}; {manifest.ref} was not committed, commit it "
                    "again"
                )
        if not only_missing:
            # Everything is uploaded; only the manifest PUT remains (there is no rename step).
            failpoint("staged")
            failpoint("moved")
            failpoint("manifest_tmp")

    def _record(self, manifest: Manifest) -> None:
        manifest_path = self.manifest_location(manifest.name, manifest.version)
        try:
            if self._index.ensure_tables():
                self.reindex()
            else:
                self._index.record(manifest, manifest_path)
        except IndexUnusable as exc:
            # The version is committed (its manifest is written); the index is only a cache and
            # `search` and `reindex` repair it from the manifests.
            log.warning("%s is committed but not indexed: %s", manifest.ref, exc)

    # --- maintenance ------------------------------------------------------------------------

    def reindex(self) -> int:
        """Rebuild the index from the manifests; returns how many versions it holds.

        A SQLite index file that is garbled (not a database, or a malformed one) is deleted
        and built afresh; other errors of the index are raised as a :class:`CatalogError`."""
        make_dirs(self._local)
        try:
            return self._rebuild_index()
        except IndexUnusable as exc:
            if not exc.corrupt or not self._index.remove_garbled_file():
                raise
        return self._rebuild_index()

    def _rebuild_index(self) -> int:
        self._index.ensure_tables()

        def manifests() -> Iterator[tuple[Manifest, str]]:
            for name, version in self._committed():
                key, path = self._manifest_where(name, version)
                try:
                    manifest = Manifest.from_json(self._storage.read_text(key))
                except (OSError, UnicodeDecodeError, CatalogError) as exc:
                    log.warning("not indexing %s: %s; run `shardflow catalog verify`", path, exc)
                    continue
                yield manifest, path

        return self._index.rebuild(manifests)

    def gc(self, *, min_age: timedelta = DEFAULT_GC_MIN_AGE) -> list[str]:
        """Remove what no committed version holds; returns the paths (or URLs) removed:

        - staging left by dead writers (its lock is free), at once, on any root;
        - on a local root, version folders without a manifest and objects no version folder
          links to, under the locks that writers hold, so it is safe beside them;
        - on a URL root, version prefixes without a manifest and objects no manifest names,
          once their newest object is older than ``min_age``: there is no lock to tell a live
          uploader from a dead one, so ``min_age`` must exceed the longest upload of a commit;
          ``timedelta(0)`` removes them all (only when no writer runs).

        It never follows a symlink, never leaves the root, and removes only names it writes
        (staging ids, version ids, objects).
        """
        removed: list[str] = []
        if self._staging.is_dir() and not self._staging.is_symlink():
            removed += [str(p) for p in self._gc_staging()]
        if self._store is not None:
            return removed + self._gc_store(self._store, min_age)
        storage = self._storage
        assert isinstance(storage, LocalStorage)
        for name in storage.subdirectories("datasets"):
            if NAME_PATTERN.fullmatch(name) is not None:
                removed += [str(p) for p in self._gc_dataset(self.root / "datasets" / name)]
        if storage.exists("objects"):
            # Exclusive: no writer is between deciding to use an object and linking it.
            with storage.objects_lock(exclusive=True):
                for path in storage.unreferenced_objects():
                    path.unlink()
                    removed.append(str(path))
        return removed

    def _gc_staging(self) -> list[Path]:
        removed = []
        # "<id>.work" is the work folder a job without a work root keeps beside its staging
        # "<id>" (preprocessing's driver): it lives and dies with that staging's lock.
        entries = {
            p.name.removesuffix(".lock").removesuffix(".work")
            for p in self._staging.iterdir()
            if _STAGING_ID.fullmatch(p.name.removesuffix(".lock").removesuffix(".work"))
        }
        for staging_id in sorted(entries):
            work = self._staging / f"{staging_id}.work"
            directory = self._staging / staging_id
            lock_path = self._staging / f"{staging_id}.lock"
            if lock_path.exists():
                lock_fd = try_lock(lock_path, create=False)
                if lock_fd is None:
                    continue  # a live writer holds it (or it just vanished)
                try:
                    removed += _remove_trees(directory, work)
                    lock_path.unlink()
                    removed.append(lock_path)
                finally:
                    os.close(lock_fd)
                continue
            # A writer creates and locks the lock file before the directory, and removes it
            # only after the directory is gone: a directory without one has no writer.
            removed += _remove_trees(directory, work)
        return removed

    def _gc_store(self, store: ObjectStorage, min_age: timedelta) -> list[str]:
        removed: list[str] = []
        now = datetime.now(UTC)

        def old(changed: datetime | None) -> bool:
            return min_age <= timedelta(0) or (changed is not None and now - changed >= min_age)

        # Manifests first, objects second: an object uploaded after this listing is too young
        # to remove, and a commit that reused an old one checks it again after its manifest.
        referenced = {
            entry.sha256
            for name, version in self._committed()
            for entry in self._read_manifest(name, version).files
        }
        for name in store.subdirectories("datasets"):
            if NAME_PATTERN.fullmatch(name) is None:
                continue  # not the catalog's: never remove what it did not write
            for version in store.subdirectories(f"datasets/{name}"):
                key = f"datasets/{name}/{version}"
                if VERSION_PATTERN.fullmatch(version) is None:
                    continue
                if self._has_manifest(key) or not old(store.newest_change(key)):
                    continue  # committed, or maybe a live writer's upload
                store.remove_tree(key)
                removed.append(store.url_of(key))
        for key, info in store.objects().items():
            sha = key.rsplit("/", 1)[-1]
            if sha in referenced or key != _object_key_or_none(sha):
                continue
            if old(store.modified(key, info)):
                store.remove(key)
                removed.append(store.url_of(key))
        return removed

    def _gc_dataset(self, dataset_dir: Path) -> list[Path]:
        removed = []
        # The publisher holds this lock from the rename until the manifest is written.
        with exclusive_lock(dataset_dir / ".lock"):
            for entry in sorted(os.scandir(dataset_dir), key=lambda e: e.name):
                if VERSION_PATTERN.fullmatch(entry.name) is None:
                    continue  # not a version id: not the catalog's to remove
                if not entry.is_dir(follow_symlinks=False):
                    continue  # a symlink (or a file) the catalog did not write
                directory = Path(entry.path)
                if not any((directory / manifest).is_file() for manifest in MANIFEST_NAMES):
                    shutil.rmtree(directory)
                    removed.append(directory)
        return removed

    # --- internals --------------------------------------------------------------------------

    def _committed(self, name: str | None = None) -> Iterator[tuple[str, str]]:
        """``(name, version)`` of every committed version (of ``name``), from the folders."""
        storage = self._storage
        names = [name] if name is not None else storage.subdirectories("datasets")
        for dataset in names:
            if NAME_PATTERN.fullmatch(dataset) is None:
                continue  # not the catalog's: a stray folder
            for version in storage.subdirectories(f"datasets/{dataset}"):
                if VERSION_PATTERN.fullmatch(version) is None:
                    continue
                if self._has_manifest(f"datasets/{dataset}/{version}"):
                    yield dataset, version

    def _resolve(self, name: str, version: str) -> str:
        """The committed version id of ``name`` that ``version`` (an id or prefix) names."""
        validate_name(name)
        validate_version_prefix(version)
        matches = [v for _, v in self._committed(name) if v.startswith(version)]
        if version in matches:
            return version
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(
                f"no version {version!r} of dataset {name!r} in catalog {self.url}; "
                "run `shardflow catalog list`"
            )
        raise NotFound(
            f"version prefix {version!r} of {name!r} matches {len(matches)} versions; "
            "give more digits"
        )

    def _read_manifest(self, name: str, version: str) -> Manifest:
        key, path = self._manifest_where(name, version)
        try:
            manifest = Manifest.from_json(self._storage.read_text(key))
        except FileNotFoundError as exc:
            raise NotFound(
                f"no version {version!r} of dataset {name!r} in catalog {self.url}; "
                "run `shardflow catalog list`"
            ) from exc
        except ManifestEdited as exc:
            raise ManifestEdited(
                f"{path}: {exc}; not trusting it (run `shardflow catalog verify {name}`)"
            ) from exc
        except (OSError, UnicodeDecodeError, CatalogError) as exc:
            raise CatalogError(
                f"cannot read {path}: {exc}; run `shardflow catalog verify {name}`"
            ) from exc
        if (manifest.name, manifest.version) != (name, version):
            raise CatalogError(
                f"{path} describes {manifest.ref}, not {name}@{version}; the catalog is corrupt"
            )
        return manifest


def _version_key(name: str, version: str) -> str:
    """The version's directory relative to the root, '/'-separated, for an object store."""
    return f"datasets/{validate_name(name)}/{validate_version(version)}"


def _entry_parts(manifest: Manifest, entry: FileEntry) -> tuple[str, ...]:
    """The parts of ``entry.path``; refuses entries that would leave the version directory."""
    relative = PurePosixPath(entry.path)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise CatalogError(
            f"manifest of {manifest.ref} lists file {entry.path!r} outside its directory; "
            "the manifest is corrupt"
        )
    return relative.parts


def _bytes_key(catalog: Catalog, manifest: Manifest, entry: FileEntry) -> str:
    """Where ``entry``'s bytes are, relative to the root: in the version's folder on a local
    root (a link to its object) and in manifests of format 1; else at its object."""
    parts = _entry_parts(manifest, entry)
    if catalog.is_local or manifest.format_version == 1:
        return f"{_version_key(manifest.name, manifest.version)}/{'/'.join(parts)}"
    return object_key(entry.sha256)


def _object_key_or_none(sha: str) -> str | None:
    try:
        return object_key(sha)
    except CatalogError:
        return None  # not an object's name: never removed


def _check_bytes(
    storage: LocalStorage | ObjectStorage, where: str, entry: FileEntry, size: int | None
) -> Problem | None:
    """``entry`` against the bytes at ``where`` (their ``size`` already listed): size, sha256,
    and for Parquet the footer's counts (read only when the bytes match)."""
    location = storage.url_of(where)
    if size is None:
        return Problem(path=location, reason="missing")
    if size != entry.bytes:
        return Problem(path=location, reason=f"size {size} != manifest {entry.bytes}")
    try:
        _, sha = storage.digest(where)
    except OSError as exc:
        return Problem(path=location, reason=f"unreadable: {exc}")
    if sha != entry.sha256:
        return Problem(path=location, reason="sha256 mismatch")
    if entry.path.endswith(".parquet"):
        return _check_footer(location, entry, functools.partial(storage.parquet_counts, where))
    return None


def _remove_trees(*paths: Path) -> list[Path]:
    removed = []
    for path in paths:
        if path.is_symlink():
            continue  # never followed, never the catalog's
        if path.exists():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _check_footer(
    location: str, entry: FileEntry, read_counts: Callable[[], tuple[int, int]]
) -> Problem | None:
    """The manifest's rows and row groups of a Parquet file against its footer."""
    try:
        rows, row_groups = read_counts()
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        return Problem(path=location, reason=f"unreadable Parquet footer: {_one_line(exc)}")
    for field, recorded, actual in (
        ("rows", entry.rows, rows),
        ("row_groups", entry.row_groups, row_groups),
    ):
        if recorded != actual:
            return Problem(
                path=location,
                reason=f"manifest field files[{entry.path}].{field} is {recorded}, its Parquet "
                f"footer says {actual}",
            )
    return None


def _parse_for_verify(
    text: str, location: str, name: str, version: str
) -> tuple[Manifest | None, list[Problem], list[Problem]]:
    """(the manifest or None, problems, notes) of one version's manifest text.

    An edited manifest is a problem, and is still parsed so that its fields get checked against
    the files (which names the field that was changed).
    """
    problems: list[Problem] = []
    notes: list[Problem] = []
    try:
        manifest = Manifest.from_json(text)
    except ManifestEdited as exc:
        problems.append(Problem(path=location, reason=str(exc)))
        manifest = Manifest.from_json(text, check_digest=False)
    except CatalogError as exc:
        return None, [Problem(path=location, reason=f"unreadable manifest: {exc}")], []
    if (manifest.name, manifest.version) != (name, version):
        reason = f"manifest describes {manifest.ref}, not {name}@{version}"
        return None, [*problems, Problem(path=location, reason=reason)], []
    if manifest.manifest_digest is None:
        notes.append(Problem(path=location, reason=f"{manifest.ref}: {NO_DIGEST_NOTE}"))
    return manifest, problems, notes


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class Staging:
    """A directory to write one new version into; :meth:`commit` publishes it.

    Leaving the ``with`` block without committing, or with an exception, removes the directory.
    Get one from :meth:`Catalog.stage`.
    """

    def __init__(self, *, catalog: Catalog, name: str, kind: str, path: Path, lock_fd: int) -> None:
        self.name = name
        self.kind = kind
        self.path = path
        """The directory the caller writes files into, in any subdirectories."""
        self._catalog = catalog
        # Held for the staging's whole life so `gc` in another process can tell it is live.
        self._lock_fd: int | None = lock_fd
        self._run: dict[str, Any] = {}
        self._reused: dict[str, FileEntry] = {}
        self.reused_from: dict[str, str] = {}
        """On a URL root, each reused file's parent bytes (relative to the root): copied to
        its object at the commit if that object is missing (a parent of manifest format 1)."""
        self.linked_objects: set[str] = set()
        """On a local root, the reused files that are links to their objects: committed and
        durable, nothing to fsync or store again at the commit."""

    def note_run(self, **facts: Any) -> None:
        """Facts about the run that made this version (wall seconds, bytes read, tasks), kept
        in the manifest's ``extra["run"]``: they describe this commit, not the data, so they are
        not part of the version."""
        self._run.update(facts)

    def __repr__(self) -> str:
        return f"Staging({self.name!r}, kind={self.kind!r}, path={str(self.path)!r})"

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.discard()

    @property
    def _lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def commit(
        self,
        *,
        parents: Sequence[ParentRef] = (),
        sources: Sequence[Mapping[str, Any]] = (),
        parameters: Mapping[str, Any] = _EMPTY,
        schema: Mapping[str, Any] = _EMPTY,
        statistics: Mapping[str, Any] = _EMPTY,
        rows: int,
        file_rows: Mapping[str, int] | None = None,
        described: Mapping[str, FileEntry] | None = None,
        extra: Mapping[str, Any] = _EMPTY,
        code_version: str | None = None,
    ) -> Manifest:
        """Publish the staged files as a version; returns its manifest.

        If the version (same name, kind, parents, sources, parameters and code version) is
        already committed, the staged files are discarded and the existing manifest returned.

        ``described``: entries of staged files that their writers hashed and counted as they
        wrote them (tasks on other machines); those are not read again.

        ``code_version``: the fingerprint of the code that made the files
        (:func:`~data_catalog.identity.source_fingerprint`); by default the checkout's commit.
        """
        if self._lock_fd is None:
            raise RuntimeError(f"{self!r} was already committed or discarded")
        if not all(isinstance(p, ParentRef) for p in parents):
            raise TypeError("parents must be ParentRef instances (use manifest.ref)")
        for parent in parents:
            validate_name(parent.name)
            validate_version(parent.version)
        # The stages of shardflow pass their own code's fingerprint; the checkout is a note on
        # the run that made the version, never part of it.
        code = code_version if code_version is not None else identity.code_version()
        self._run.setdefault("checkout", identity.code_version())
        # Stored through JSON so that the returned manifest equals the one read back later.
        plain_parameters = _plain(parameters, "parameters")
        plain_sources = tuple(_plain(s, "sources") for s in sources)
        version = identity.version_id(
            name=self.name,
            kind=self.kind,
            parents=parents,
            sources=plain_sources,
            parameters=plain_parameters,
            code_version=code,
        )
        if self._catalog.exists(self.name, version):
            self.discard()
            return self._catalog.get(self.name, version)
        local = self._catalog.is_local
        # Reused files are committed files: described by their parent's manifest, never read.
        staged_reused = {k: v for k, v in self._reused.items() if (self.path / k).is_file()}
        # A URL catalog uploads the files instead: fsync would buy nothing, and its failpoints
        # fire during the upload (Catalog._upload_objects).
        files = describe_and_sync(
            self.path,
            file_rows,
            sync=local,
            described={**(described or {}), **staged_reused},
            durable=self.linked_objects,
        )
        unstaged = [e for k, e in self._reused.items() if k not in staged_reused]
        files = tuple(sorted((*files, *unstaged), key=lambda e: e.path))
        if local:
            failpoint("staged")
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            name=self.name,
            version=version,
            kind=self.kind,
            created=datetime.now(UTC).isoformat(timespec="microseconds"),
            code_version=code,
            parameters=plain_parameters,
            parents=tuple(parents),
            sources=plain_sources,
            schema=_plain(schema, "schema"),
            statistics=_plain(statistics, "statistics"),
            rows=int(rows),
            files=files,
            extra=_plain({**extra, "run": self._run} if self._run else extra, "extra"),
        )
        return self._catalog._publish(self, manifest)

    def reuse(self, parent: Manifest, entry: FileEntry, relpath: str | None = None) -> FileEntry:
        """Put file ``entry`` of the committed version ``parent`` into this version, as
        ``relpath`` (default: its own path), without copying or reading it: the two versions
        share its object. Returns the new version's entry of it."""
        relpath = relpath or entry.path
        reused = replace(entry, path=relpath)
        _entry_parts(parent, reused)  # refuses a path that would leave the version
        catalog = self._catalog
        if isinstance(catalog._storage, LocalStorage):
            linked = catalog._storage.link_object(
                entry.sha256, lambda: catalog.file_path(parent, entry), self.path / relpath
            )
            if linked is None:
                raise CatalogError(
                    f"{entry.path} of {parent.ref} is gone from catalog {catalog.url}; run "
                    f"`shardflow catalog verify {parent.name}`"
                )
            if linked == "object":
                self.linked_objects.add(relpath)
        else:
            self.reused_from[relpath] = _bytes_key(catalog, parent, entry)
        self._reused[relpath] = reused
        return reused

    def adopt(self, source: Path, relpath: str) -> Path:
        """Put an existing file into the staging area as ``relpath``: a hard link when it is on
        the same filesystem (no copy, the source stays valid), else a copy."""
        target = self.path / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        return target

    def discard(self) -> None:
        """Remove the staged files; a no-op after commit or an earlier discard."""
        if self._lock_fd is None:
            return
        # A directory that cannot be removed now is unlocked once we release it; `gc` removes it.
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        """Give up the staging: its directory is gone (moved or removed)."""
        assert self._lock_fd is not None
        # Unlink while still holding the lock, so gc never sees an unlocked lock of a live dir.
        self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None


def _plain(value: Mapping[str, Any], field: str) -> dict[str, Any]:
    """``value`` as plain JSON data (tuples become lists), or a TypeError naming ``field``."""
    try:
        plain: dict[str, Any] = json.loads(identity.canonical_json(dict(value)))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{field} must be JSON data: {exc}") from exc
    return plain
