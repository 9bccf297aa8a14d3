"""A catalog root on object storage (or any fsspec filesystem) given by URL.

``s3://bucket/prefix``, ``gs://bucket/prefix``, ``hdfs://namenode/path``, ``memory://name``: any
URL whose protocol fsspec knows, except ``file://`` (which is a local path and keeps the local
commit protocol). Object stores have no atomic rename and no ``flock``, so a version is published
differently (see README.md, "Object storage"): the files are uploaded under the version's prefix,
and ``manifest.json`` is written last with one PUT, conditional on its absence where the store
supports it. A version is visible exactly when its manifest exists.

Every listing first drops fsspec's listing cache: another process may have published since.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from data_catalog.errors import CatalogError

CHUNK_BYTES = 1 << 20
# `scheme://...` or a chained fsspec URL such as `simplecache::s3://...`.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(://|::)")
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def is_url(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` is a URL (a str with ``scheme://``) rather than a local path."""
    return isinstance(root, str) and "://" in root and _URL.match(root) is not None


def local_path_of(url: str) -> str | None:
    """The local path a ``file://`` URL names; None for any other URL."""
    protocol = url.split("://", 1)[0].lower() if "::" not in url else ""
    if protocol not in LOCAL_PROTOCOLS:
        return None
    from fsspec.implementations.local import LocalFileSystem

    return cast(str, LocalFileSystem._strip_protocol(url))


def default_cache_dir(url: str) -> Path:
    """Where a URL catalog keeps its local staging and SQLite index, one directory per URL."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return Path(base) / "shardflow" / "catalogs" / key


class ObjectStore:
    """An fsspec filesystem and the catalog's base path in it; every method takes '/'-joined
    paths relative to the base."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        import fsspec

        self.url = url.rstrip("/")
        try:
            fs, base = fsspec.url_to_fs(self.url, **dict(storage_options))
        except ImportError as exc:
            raise CatalogError(
                f"catalog {self.url} needs an fsspec filesystem that is not installed ({exc}); "
                "see data_catalog/README.md, 'Object storage', for the pip command"
            ) from exc
        except ValueError as exc:  # fsspec: "Protocol not known"
            raise CatalogError(f"catalog URL {self.url!r} is not usable: {exc}") from exc
        self.fs: Any = fs
        self.base: str = cast(str, base).rstrip("/")

    def path(self, relative: str) -> str:
        """The filesystem path (no protocol) of ``relative``."""
        return f"{self.base}/{relative}" if relative else self.base

    def url_of(self, relative: str) -> str:
        """The full URL of ``relative``, as the user spelled the catalog's URL."""
        return f"{self.url}/{relative}" if relative else self.url

    def _fresh(self) -> None:
        # s3fs and gcsfs cache listings per instance, and fsspec shares instances.
        self.fs.invalidate_cache()

    def exists(self, relative: str) -> bool:
        self._fresh()
        return bool(self.fs.exists(self.path(relative)))

    def is_file(self, relative: str) -> bool:
        self._fresh()
        return bool(self.fs.isfile(self.path(relative)))

    def subdirectories(self, relative: str) -> list[str]:
        """Names of the directories (prefixes) directly under ``relative``, sorted; [] if none."""
        self._fresh()
        try:
            listing = self.fs.ls(self.path(relative), detail=True)
        except FileNotFoundError:
            return []
        names = {
            posixpath.basename(str(info["name"]).rstrip("/"))
            for info in listing
            if info.get("type") == "directory"
        }
        return sorted(names)

    def files_under(self, relative: str) -> dict[str, int]:
        """``{path relative to `relative`: size}`` of every object under ``relative``."""
        self._fresh()
        prefix = self.path(relative).rstrip("/") + "/"
        try:
            found = self.fs.find(self.path(relative), detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for name, info in found.items():
            name = str(name)
            if info.get("type") == "file" and name.startswith(prefix):
                sizes[name[len(prefix) :]] = int(info["size"])
        return sizes

    def read_text(self, relative: str) -> str:
        return cast(bytes, self.fs.cat_file(self.path(relative))).decode("utf-8")

    def digest(self, relative: str) -> tuple[int, str]:
        """``(bytes, sha256 hex)`` of an object, streamed in 1 MiB chunks."""
        sha = hashlib.sha256()
        size = 0
        with self.fs.open(self.path(relative), "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                sha.update(chunk)
                size += len(chunk)
        return size, sha.hexdigest()

    def parquet_counts(self, relative: str) -> tuple[int, int]:
        """(rows, row groups) from a Parquet object's footer: ranged reads of its end, not the
        whole object."""
        import pyarrow.parquet as pq

        with self.fs.open(self.path(relative), "rb") as f:
            metadata = pq.read_metadata(f)
        return int(metadata.num_rows), int(metadata.num_row_groups)

    def upload(self, local: Path, relative: str) -> None:
        self.fs.put_file(str(local), self.path(relative))

    def create(self, relative: str, data: bytes) -> bool:
        """Write ``data`` to ``relative`` in one PUT unless it exists; False if it existed.

        Conditional (S3 ``If-None-Match: *``, an exclusive create elsewhere) where the
        filesystem supports it; otherwise a check then an unconditional PUT, which is still
        safe for the catalog because two writers of one version write the same identity.
        """
        path = self.path(relative)
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except (NotImplementedError, TypeError, ValueError, OSError) as exc:
            # No exclusive create here: fsspec's own refusals, or a server's 501 (s3fs: ENOSYS).
            if isinstance(exc, OSError) and exc.errno != errno.ENOSYS:
                raise
            if self.exists(relative):
                return False
            self.fs.pipe_file(path, data)
        self._fresh()
        return True

    def newest_change(self, relative: str) -> datetime | None:
        """When the newest object under ``relative`` was written; None if the store cannot tell."""
        newest = None
        for name in self.files_under(relative):
            try:
                modified = self.fs.modified(self.path(f"{relative}/{name}"))
            except (NotImplementedError, FileNotFoundError):
                return None
            if modified.tzinfo is None:
                modified = modified.replace(tzinfo=UTC)
            newest = modified if newest is None else max(newest, modified)
        return newest

    def remove_tree(self, relative: str) -> None:
        self.fs.rm(self.path(relative), recursive=True)
        self._fresh()
