"""Where a catalog's bytes live: one interface for a local directory and an object store.

Both hold the same tree under the root::

    objects/<aa>/<sha256>                     every file of every version, once, by content
    datasets/<name>/<version>/manifest.json   present = the version is committed

and they differ only where the medium does:

- :class:`LocalStorage` (a POSIX directory) also shows each version as a folder of its files
  (``datasets/<name>/<version>/<path>``): each is a hard link to its object, so the folder reads
  as a dataset in any tool, and two versions that share a file share its bytes. An object whose
  only link is its own (link count 1) belongs to no version. Publishing a version is a rename
  and a link, under ``flock``; the manifest is created by a link, which fails if it exists.
- :class:`ObjectStorage` (``s3://``, ``gs://``, ``memory://`` ... through fsspec) has neither
  links nor renames: a version is its manifest, and its files are read at their objects. The
  manifest is created with one PUT, conditional on its absence where the store supports it.

Objects are whole or absent: a local one is linked from a complete, fsynced file; a remote one
is uploaded whole and its size checked before any manifest names it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from data_catalog.durability import failpoint, fsync_dir, make_dirs
from data_catalog.errors import CatalogError

CHUNK_BYTES = 1 << 20
OBJECTS = "objects"


def object_key(sha256: str) -> str:
    """Where the bytes whose digest is ``sha256`` live, relative to the root."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise CatalogError(f"{sha256!r} is not a sha256 digest; the manifest is corrupt")
    return f"{OBJECTS}/{sha256[:2]}/{sha256}"


def is_object_key(relative: str) -> bool:
    """Whether ``relative`` is where :func:`object_key` puts some digest's bytes."""
    sha = relative.rsplit("/", 1)[-1]
    return (
        len(sha) == 64
        and all(c in "0123456789abcdef" for c in sha)
        and (relative == f"{OBJECTS}/{sha[:2]}/{sha}")
    )


class Storage(Protocol):
    """What the catalog asks of the medium; paths are '/'-joined, relative to the root."""

    url: str
    """The root: a URL, or for a local directory its absolute path."""

    def url_of(self, relative: str) -> str: ...

    def exists(self, relative: str) -> bool: ...

    def read_text(self, relative: str) -> str: ...

    def subdirectories(self, relative: str) -> list[str]: ...

    def files_under(self, relative: str) -> dict[str, int]:
        """``{path relative to `relative`: size}`` of every file under it."""
        ...

    def size(self, relative: str) -> int | None:
        """The size of a file, or None if it is absent."""
        ...

    def digest(self, relative: str) -> tuple[int, str]: ...

    def parquet_counts(self, relative: str) -> tuple[int, int]: ...

    def create(self, relative: str, data: bytes) -> bool:
        """Write ``data`` whole unless ``relative`` exists (False then)."""
        ...

    def remove_tree(self, relative: str) -> None: ...


class LocalStorage:
    """A catalog in a local (or mounted) directory; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def path(self, relative: str) -> Path:
        return self.root.joinpath(*relative.split("/")) if relative else self.root

    def url_of(self, relative: str) -> str:
        return str(self.path(relative))

    def exists(self, relative: str) -> bool:
        return self.path(relative).exists()

    def read_text(self, relative: str) -> str:
        return self.path(relative).read_text(encoding="utf-8")

    def subdirectories(self, relative: str) -> list[str]:
        """Real directories directly under ``relative`` (never a symlink: the catalog does not
        follow links out of its root)."""
        folder = self.path(relative)
        if folder.is_symlink() or not folder.is_dir():
            return []
        return sorted(
            entry.name for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)
        )

    def files_under(self, relative: str) -> dict[str, int]:
        folder = self.path(relative)
        sizes: dict[str, int] = {}
        for dirpath, _dirnames, filenames in os.walk(folder):
            for name in filenames:
                full = Path(dirpath, name)
                sizes[full.relative_to(folder).as_posix()] = full.lstat().st_size
        return sizes

    def size(self, relative: str) -> int | None:
        try:
            return self.path(relative).stat().st_size
        except FileNotFoundError:
            return None

    def digest(self, relative: str) -> tuple[int, str]:
        return file_digest(self.path(relative))

    def parquet_counts(self, relative: str) -> tuple[int, int]:
        import pyarrow.parquet as pq

        metadata = pq.read_metadata(self.path(relative))
        return int(metadata.num_rows), int(metadata.num_row_groups)

    def create(self, relative: str, data: bytes) -> bool:
        """Written to a temporary file and fsynced, then linked in place: a link fails when the
        name exists, so two writers cannot both create it, and readers see all or nothing."""
        path = self.path(relative)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            failpoint("manifest_tmp")
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def remove_tree(self, relative: str) -> None:
        path = self.path(relative)
        if path.is_symlink():
            raise CatalogError(f"{path} is a symlink; the catalog removes only what it wrote")
        shutil.rmtree(path)

    # --- objects ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def objects_lock(self, *, exclusive: bool) -> Iterator[None]:
        """Writers link objects under a shared lock, gc removes them under an exclusive one:
        gc never removes an object between a writer's decision to use it and its link."""
        folder = self.path(OBJECTS)
        make_dirs(folder)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def store_objects(self, directory: Path, digests: Mapping[str, str]) -> None:
        """Make every file of ``directory`` named in ``digests`` (a version's folder, not yet
        visible; sha256 by relative path) a link to its object: a file whose bytes an object
        already holds is replaced by a link to it (the copy is freed), any other becomes the
        object. Files are read-only from then on: every version that holds them shares them."""
        with self.objects_lock(exclusive=False):
            touched: set[Path] = set()
            for relpath, sha in digests.items():
                path = directory.joinpath(*relpath.split("/"))
                touched.add(self._link_object(path, sha).parent)
            for folder in touched:
                fsync_dir(folder)

    def _link_object(self, path: Path, sha: str) -> Path:
        target = self.path(object_key(sha))
        target.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            if target.exists():
                if os.path.samefile(target, path):
                    return target
                tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.link")
                try:
                    os.link(target, tmp)
                except FileNotFoundError:
                    continue  # removed meanwhile (only a gc without our lock could): retry
                os.replace(tmp, path)
                return target
            try:
                os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
                os.link(path, target)
                return target
            except FileExistsError:
                continue  # another writer stored the same bytes first: use theirs
        raise CatalogError(f"cannot store {path} as object {target}")

    def link_object(
        self, sha: str, source: Callable[[], Path], dest: Path
    ) -> Literal["object", "source"] | None:
        """Put the object ``sha`` (or else the file at ``source()``, which holds the same
        bytes) at ``dest`` as a hard link: no copy. Which it linked: "object" (``dest`` is the
        object, nothing to store) or "source"; None when neither exists."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self.objects_lock(exclusive=False):
            try:
                os.link(self.path(object_key(sha)), dest)
                return "object"
            except FileNotFoundError:
                pass
            try:
                os.link(source(), dest)
                return "source"
            except FileNotFoundError:
                return None

    def unreferenced_objects(self) -> Iterator[Path]:
        """Objects no version folder links to (link count 1); call under the exclusive lock."""
        folder = self.path(OBJECTS)
        for prefix in self.subdirectories(OBJECTS):
            for entry in os.scandir(folder / prefix):
                if not is_object_key(f"{OBJECTS}/{prefix}/{entry.name}"):
                    continue  # not a name the catalog writes: never removed
                if entry.is_file(follow_symlinks=False) and entry.stat().st_nlink == 1:
                    yield Path(entry.path)


class ObjectStorage:
    """An fsspec filesystem and the catalog's base path in it (see the module docstring).

    Every listing first drops fsspec's listing cache: another process may have published since.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        import fsspec

        self.url = url.rstrip("/")
        protocol = self.url.split("://", 1)[0].lower()
        if protocol in READ_ONLY_PROTOCOLS:
            raise CatalogError(
                f"catalog URL {self.url!r}: {protocol}:// is read-only to fsspec, and a catalog "
                "is written to; use a path or an object store (s3://bucket/prefix, gs://...)"
            )
        options = bounded_options(protocol, storage_options)
        try:
            fs, base = fsspec.url_to_fs(self.url, **options)
        except ImportError as exc:
            raise CatalogError(
                f"catalog {self.url} needs an fsspec filesystem that is not installed ({exc}); "
                "see data_catalog/README.md, 'Object storage', for the pip command"
            ) from exc
        except ValueError as exc:  # fsspec: "Protocol not known"
            raise CatalogError(f"catalog URL {self.url!r} is not usable: {exc}") from exc
        except Exception as exc:  # a filesystem that connects as it is made (ftp, hdfs)
            raise CatalogError(
                f"catalog {self.url} cannot be opened ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); check SHARDFLOW_CATALOG and that its "
                "server is reachable"
            ) from exc
        self.fs: Any = fs
        self.base: str = cast(str, base).rstrip("/")
        self.protocol = protocol
        if protocol in ("s3", "s3a") and not storage_options.get("config_kwargs"):
            # s3fs retries each request 5 times around botocore's own attempts (a class
            # attribute, no option); botocore's two attempts are enough.
            self.fs.retries = 1

    def check(self) -> None:
        """Refuse, before any work, a store this catalog cannot use: a bucket that does not
        exist, credentials it refuses (a CatalogError each); no credentials at all or a store
        that does not answer raise the filesystem's own error (botocore's), bounded by the
        ``connect`` and ``reply`` deadlines."""
        self._fresh()
        bucket = self.base.split("/", 1)[0]
        where = bucket if self.protocol in BUCKET_PROTOCOLS else self.base
        try:
            if self.protocol in BUCKET_PROTOCOLS:
                self._call("ls", bucket, detail=False)
            else:
                self._call("exists", self.base)
        except FileNotFoundError:
            raise CatalogError(
                f"bucket {bucket!r} of catalog {self.url} does not exist (or these credentials "
                "cannot see it): create it, or fix SHARDFLOW_CATALOG"
            ) from None
        except PermissionError as exc:
            raise CatalogError(
                f"the object store refuses these credentials for {self.url} ({where}: "
                f"{' '.join(str(exc).split())[:200]}): check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ) from None

    # The slowest transfer a call's deadline allows for: a call moving N bytes may take the
    # ``reply`` deadline plus N at this rate.
    MIN_BYTES_PER_SECOND = 1 << 20

    def _call(self, method: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        """``self.fs.<method>(*args, **kwargs)``, within the ``reply`` deadline (plus ``size``
        bytes at :data:`MIN_BYTES_PER_SECOND`) on an asynchronous filesystem (s3fs, gcsfs):
        their clients' own timeouts leave waits unbounded (an S3 PUT whose server stopped
        answering hung past 297 s). Past it, a DeadlineExceeded naming the store."""
        from fsspec.asyn import AsyncFileSystem
        from fsspec.exceptions import FSTimeoutError

        from data_catalog import deadlines

        call = getattr(self.fs, method)
        if not isinstance(self.fs, AsyncFileSystem):
            return call(*args, **kwargs)
        limit = deadlines.REPLY.seconds() + size / self.MIN_BYTES_PER_SECOND
        try:
            return call(*args, timeout=limit, **kwargs)
        except FSTimeoutError:
            raise deadlines.exceeded(
                f"the object store of catalog {self.url} ({method} {args[0]})",
                deadlines.REPLY,
                "check that it is up and reachable, then rerun: finished work is kept",
                seconds=limit,
            ) from None

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
        return bool(self._call("exists", self.path(relative)))

    def read_text(self, relative: str) -> str:
        return cast(bytes, self._call("cat_file", self.path(relative))).decode("utf-8")

    def subdirectories(self, relative: str) -> list[str]:
        self._fresh()
        try:
            listing = self._call("ls", self.path(relative), detail=True)
        except FileNotFoundError:
            return []
        names = {
            posixpath.basename(str(info["name"]).rstrip("/"))
            for info in listing
            if info.get("type") == "directory"
        }
        return sorted(names)

    def files_under(self, relative: str) -> dict[str, int]:
        return {name: int(info["size"]) for name, info in self._found(relative).items()}

    def _found(self, relative: str) -> dict[str, dict[str, Any]]:
        self._fresh()
        prefix = self.path(relative).rstrip("/") + "/"
        try:
            found = self._call("find", self.path(relative), detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(name)[len(prefix) :]: info
            for name, info in found.items()
            if info.get("type") == "file" and str(name).startswith(prefix)
        }

    def size(self, relative: str) -> int | None:
        self._fresh()
        try:
            return int(self._call("info", self.path(relative))["size"])
        except FileNotFoundError:
            return None

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
        """(rows, row groups) from a Parquet object's footer: ranged reads of its end."""
        import pyarrow.parquet as pq

        with self.fs.open(self.path(relative), "rb") as f:
            metadata = pq.read_metadata(f)
        return int(metadata.num_rows), int(metadata.num_row_groups)

    def upload(self, local: Path, relative: str) -> None:
        self._call("put_file", str(local), self.path(relative), size=local.stat().st_size)

    def copy(self, source: str, relative: str) -> None:
        """A copy of the object ``source`` at ``relative`` (server-side where the store can)."""
        self._call("copy", self.path(source), self.path(relative))

    def create(self, relative: str, data: bytes) -> bool:
        """Write ``data`` to ``relative`` in one PUT unless it exists; False if it existed.

        Conditional (S3 ``If-None-Match: *``, an exclusive create elsewhere) where the
        filesystem supports it; otherwise a check then an unconditional PUT, which is still
        safe for the catalog because two writers of one version write the same identity.
        """
        path = self.path(relative)
        try:
            self._call("pipe_file", path, data, mode="create", size=len(data))
        except FileExistsError:
            return False
        except (NotImplementedError, TypeError, ValueError, OSError) as exc:
            # No exclusive create here: fsspec's own refusals, or a server's 501 (s3fs: ENOSYS).
            if isinstance(exc, OSError) and exc.errno != errno.ENOSYS:
                raise
            if self.exists(relative):
                return False
            self._call("pipe_file", path, data, size=len(data))
        self._fresh()
        return True

    def modified(self, relative: str, info: Mapping[str, Any] | None = None) -> datetime | None:
        """When an object was written; None if the store cannot tell."""
        found = None
        for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
            if info is not None and info.get(key) is not None:
                found = info[key]
                break
        if found is None:
            try:
                found = self.fs.modified(self.path(relative))
            except (NotImplementedError, FileNotFoundError):
                return None
        if isinstance(found, int | float):
            found = datetime.fromtimestamp(found, tz=UTC)
        elif isinstance(found, str):
            found = datetime.fromisoformat(found.replace("Z", "+00:00"))
        if not isinstance(found, datetime):
            return None
        return found if found.tzinfo is not None else found.replace(tzinfo=UTC)

    def newest_change(self, relative: str) -> datetime | None:
        """When the newest object under ``relative`` was written; None if the store cannot tell."""
        newest = None
        for name, info in self._found(relative).items():
            modified = self.modified(f"{relative}/{name}", info)
            if modified is None:
                return None
            newest = modified if newest is None else max(newest, modified)
        return newest

    def objects(self) -> dict[str, dict[str, Any]]:
        """Every object, by its path relative to the root, with its listing's details."""
        return {f"{OBJECTS}/{name}": info for name, info in self._found(OBJECTS).items()}

    def remove(self, relative: str) -> None:
        self._call("rm_file", self.path(relative))

    def remove_tree(self, relative: str) -> None:
        self._call("rm", self.path(relative), recursive=True)
        self._fresh()


# fsspec filesystems that only read: no catalog can live there.
READ_ONLY_PROTOCOLS = frozenset({"http", "https", "zip", "tar", "github", "git"})
# Stores whose first path component is a bucket (or container) that must exist.
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oci"})


def bounded_options(protocol: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` with limits on how long a request to an S3 store may wait, where the
    caller set none: a store that stops answering mid-commit is an error naming it, not a hang
    (botocore's defaults waited 60 s per read, 5 attempts, each retried 5 times by s3fs: the
    store's instance also tries each request once, :meth:`ObjectStorage.__init__`)."""
    options = dict(storage_options)
    if protocol not in ("s3", "s3a"):
        return options
    from data_catalog import deadlines

    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", deadlines.CONNECT.seconds())
    config.setdefault("read_timeout", deadlines.REPLY.seconds())
    config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
    options["config_kwargs"] = config
    return options


def file_digest(path: Path) -> tuple[int, str]:
    """``(bytes, sha256 hex)`` of a local file, read in 1 MiB chunks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()
