"""A catalog root given by URL: which URLs are object stores, and where such a catalog keeps
its local staging and index.

``s3://bucket/prefix``, ``gs://bucket/prefix``, ``hdfs://namenode/path``, ``memory://name``: any
URL whose protocol fsspec knows, except ``file://`` (which is a local path and keeps the local
commit protocol). The store itself is :class:`data_catalog.storage.ObjectStorage`.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import cast

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
