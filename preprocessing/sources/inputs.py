"""The input files of an ingest: found in a directory, a glob or a URL, each with a stamp.

source ── a local directory or glob; or an fsspec URL: a file, a "directory" (an s3:// prefix,
    │     an http(s):// listing page), or a glob (s3://bucket/exports/*.csv)
    ▼
InputFile per matching file, in name order: the URL a task opens, the URI the manifest records,
its size, and a stamp naming this state of it (URL, size, modification time or ETag), so that
a rerun knows which files an interrupted run already converted. Nothing is read here.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import posixpath
import unicodedata
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preprocessing.sources.errors import SourceError

_GLOB_CHARS = frozenset("*?[")
# The longest stem a derived file name takes: with a number, a stamp and suffixes in front and
# behind, it stays far below a filesystem's 255-byte name limit.
STEM_BYTES = 100
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class InputFile:
    url: str
    """What a task opens: a local absolute path or an fsspec URL."""
    uri: str
    """What the manifest records (file:// for local files)."""
    name: str
    size: int | None
    stamp: str
    """16 hex digits naming this state of the file (URL, size, mtime, ETag)."""

    @property
    def stem(self) -> str:
        """The name without its suffix, as it goes into the names of files made from it (the
        job's work files, the catalog's): control characters and "/" as "_", and at most
        :data:`STEM_BYTES` bytes of UTF-8 (a longer stem: its start and a digest of the whole
        name), so that a legal 255-byte source name never makes an illegal derived one."""
        stem = "".join(
            "_" if unicodedata.category(c).startswith("C") or c in "/\\" else c
            for c in self.name.rsplit(".", 1)[0]
        )
        if len(stem.encode()) <= STEM_BYTES:
            return stem
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:12]
        start = stem.encode()[: STEM_BYTES - len(digest) - 1].decode(errors="ignore")
        return f"{start}-{digest}"


def _stamp(url: str, info: dict[str, Any]) -> str:
    state = [
        url,
        info.get("size"),
        info.get("mtime"),
        info.get("ETag") or info.get("etag"),
        str(info.get("LastModified") or info.get("last_modified") or info.get("Last-Modified")),
    ]
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def _local(source: str, accept: Callable[[str], bool], what: str) -> list[InputFile]:
    path = Path(source).expanduser()
    if path.is_dir():
        every = sorted(p for p in path.iterdir() if p.is_file())
        files = [p for p in every if accept(p.name)]
        if not files:
            raise SourceError(f"{source}: no {what} in this directory")
        _note_skipped(source, [p.name for p in every if not accept(p.name)], what)
    else:
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise SourceError(f"{source}: no such directory, and no file matches it as a glob")
        for match in files:
            if not accept(match.name):
                raise SourceError(f"{match}: not one of the {what} (by its suffix)")
    found = []
    for file in files:
        resolved = file.resolve()
        stat = resolved.stat()
        info = {"size": stat.st_size, "mtime": stat.st_mtime_ns}
        found.append(
            InputFile(
                url=str(resolved),
                uri=resolved.as_uri(),
                name=resolved.name,
                size=stat.st_size,
                stamp=_stamp(str(resolved), info),
            )
        )
    return found


def list_inputs(
    source: str,
    accept: Callable[[str], bool],
    what: str,
    *,
    storage_options: dict[str, Any] | None = None,
) -> list[InputFile]:
    """The files of ``source`` that ``accept`` (by name), in name order; ``what`` names them in
    errors ("CSV, FITS or VOTable files")."""
    if "://" not in source or source.startswith("file://"):
        local = urllib.parse.urlsplit(source).path if source.startswith("file://") else source
        return _local(local, accept, what)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise SourceError(f"{source}: cannot open: {exc}") from exc
    try:
        if _GLOB_CHARS & set(path):
            entries = [fs.info(p) for p in fs.glob(path)]
        elif fs.isdir(path):
            entries = fs.ls(path, detail=True)
        else:
            entries = [fs.info(path)]
    except FileNotFoundError:
        raise SourceError(f"{source}: no such file or directory") from None
    except OSError as exc:
        raise SourceError(f"{source}: cannot list: {exc}") from exc
    found = []
    skipped = []
    for entry in entries:
        if entry.get("type") == "directory":
            continue
        url = fs.unstrip_protocol(entry["name"])
        name = posixpath.basename(urllib.parse.urlsplit(url).path.rstrip("/"))
        if not accept(name):
            skipped.append(name)
            continue
        size = entry.get("size")
        found.append(
            InputFile(
                url=url,
                uri=url,
                name=name,
                size=int(size) if size is not None else None,
                stamp=_stamp(url, entry),
            )
        )
    if not found:
        raise SourceError(f"{source}: no {what} there")
    _note_skipped(source, skipped, what)
    return sorted(found, key=lambda f: f.name)


def _note_skipped(source: str, names: list[str], what: str) -> None:
    """Say which files of a source folder are left out, and why (a warning on the terminal):
    a compressed export (``d.csv.gz``) or a stray file is never skipped unseen."""
    if not names:
        return
    shown = ", ".join(repr(n) for n in sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    log.warning(
        "shardflow: warning: %s: skipping %d file(s) that are not %s (by suffix; compressed "
        "files are not read): %s",
        source,
        len(names),
        what,
        shown,
    )
