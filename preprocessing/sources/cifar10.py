"""CIFAR-10 in either published shape: the binary batches or the Python (pickle) batches.

source ── plan_ingest (reads no data; a directory is listed)
    │  a directory (the batches, or a cifar-10-batches-{bin,py}/ folder inside it):
    │      pass "copy", one task per file: copied into work/copies/, hashed as it is read,
    │      a batch checked from the same bytes
    │  a .tar.gz of either, or its URL (any fsspec URL, fetched through the download cache):
    │      pass "extract", one task: members extracted one by one into work/archive-<state>/,
    │      refusing "..", absolute paths, links, devices and oversize members; the archive
    │      and every member hashed as they stream through
    │      pass "check", one task per batch: read once and checked
    │  binary: 1 label byte + 3,072 pixel bytes per record
    │  python: pickles read with a RESTRICTED unpickler (numpy array reconstruction only)
    ▼
commit (in the driver): the files hard-linked into staging, described by the tasks' digests
    │  (nothing read again)
    ▼
raw catalog version "cifar10" (rows = train + test images)

Every task's files are whole or absent, its result kept beside them: a rerun of the same job
after a crash keeps what the crashed run finished. ``read_batch`` turns either file kind into
(labels uint8[n], images uint8[n, 32, 32, 3]).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import posixpath
import shutil
import tarfile
import tempfile
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from data_catalog import Catalog, FileEntry, Manifest, Staging
from data_catalog.layout import Cifar10Layout
from preprocessing.driver import Result, Results, TaskSpec, run_job, serial_runner
from preprocessing.fingerprint import stage_code
from preprocessing.shard_files import crash_point, partial_path, record_result, recorded_result
from preprocessing.sources import task_progress
from preprocessing.sources.errors import SourceError
from preprocessing.sources.fetch import fetch, forget

__all__ = ["CLASS_NAMES", "Cifar10Job", "ingest", "plan_ingest", "read_batch", "read_cifar10"]

Progress = Callable[[str], None]

CLASS_NAMES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES
TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST = ("test_batch",)


@dataclass(frozen=True)
class Layout:
    """The file names of one published format."""

    batches: tuple[str, ...]
    meta: str
    folder: str


FORMATS = {
    "binary": Layout(
        batches=tuple(f"{b}.bin" for b in TRAIN + TEST),
        meta="batches.meta.txt",
        folder="cifar-10-batches-bin",
    ),
    "python": Layout(batches=TRAIN + TEST, meta="batches.meta", folder="cifar-10-batches-py"),
}
# No real member of the archives comes near this; a bigger one is refused, not extracted.
MAX_MEMBER_BYTES = 512 * 1024 * 1024
# Bytes read and written at a time.
_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------
# Restricted unpickling


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled numpy array needs; anything else is refused."""

    ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(text, "latin1"),
            # numpy's dtype code among them; resolved to a latin-1-only stand-in below.
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        return super().find_class(module, name)


def _latin1_encode(text: object, encoding: object = "latin1", *rest: object) -> bytes:
    """What protocol-2 pickles of bytes call; any other codec or argument is refused."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
        raise pickle.UnpicklingError("_codecs.encode is allowed for latin-1 text only")
    return text.encode("latin-1")


def _unpickle(data: bytes, where: str) -> Any:
    try:
        return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # a hostile or corrupt pickle can raise nearly anything
        raise SourceError(f"{where}: not a CIFAR-10 pickle: {exc}") from exc


_BATCH_KEYS = frozenset({"batch_label", "labels", "data", "filenames"})


def _checked_batch(batch: Any, where: str) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(labels, channel-major pixel rows) of an unpickled batch, whose every part is checked:
    a dict of b"data" (uint8 n x 3072), b"labels" (n ints), b"batch_label" (text) and
    b"filenames" (n texts), keys as bytes (Python 2 pickles) or str; nothing else."""
    if not isinstance(batch, dict):
        raise SourceError(f"{where}: pickle holds a {type(batch).__name__}, not a CIFAR-10 dict")
    fields: dict[str, Any] = {}
    for key, value in batch.items():
        name = key.decode("latin-1") if isinstance(key, bytes) else key
        if not isinstance(name, str) or name not in _BATCH_KEYS or name in fields:
            raise SourceError(f"{where}: unexpected key {str(key)[:40]!r} in the batch dict")
        fields[name] = value
    for name in ("data", "labels"):
        if name not in fields:
            raise SourceError(f"{where}: pickle lacks CIFAR-10's {name!r} entry")
    planes = fields["data"]
    if (
        type(planes) is not np.ndarray
        or planes.dtype != np.uint8
        or planes.ndim != 2
        or planes.shape[1] != IMAGE_BYTES
    ):
        got = getattr(planes, "shape", type(planes).__name__)
        raise SourceError(f"{where}: data is {got}, expected uint8 (n, {IMAGE_BYTES})")
    count = planes.shape[0]
    raw_labels = fields["labels"]
    # bool is an int subclass: refused, as are numpy scalars and anything else.
    if not isinstance(raw_labels, list) or any(type(x) is not int for x in raw_labels):
        raise SourceError(f"{where}: labels are not a list of integers")
    if len(raw_labels) != count:
        raise SourceError(f"{where}: {len(raw_labels):,} labels for {count:,} images")
    if raw_labels and not 0 <= min(raw_labels) <= max(raw_labels) <= 255:
        raise SourceError(f"{where}: labels outside 0..9")
    if "batch_label" in fields and not isinstance(fields["batch_label"], bytes | str):
        raise SourceError(f"{where}: batch_label is not text")
    if "filenames" in fields:
        names = fields["filenames"]
        if not isinstance(names, list) or any(not isinstance(n, bytes | str) for n in names):
            raise SourceError(f"{where}: filenames are not a list of texts")
        if len(names) != count:
            raise SourceError(f"{where}: {len(names):,} filenames for {count:,} images")
    return np.array(raw_labels, dtype=np.uint8), planes


# ---------------------------------------------------------------------------------------------
# Reading batches


def read_batch(path: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(labels, images HWC) of one batch file; binary if named ``*.bin``, else a pickle."""
    path = Path(path)
    return _decode_batch(path.read_bytes(), path.name, str(path))


def _decode_batch(
    data: bytes, name: str, where: str
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(labels, images HWC) of the bytes of the batch file ``name`` (``where`` in errors)."""
    if name.endswith(".bin"):
        if not data or len(data) % RECORD_BYTES:
            raise SourceError(
                f"{where}: {len(data):,} bytes is not a whole number of "
                f"{RECORD_BYTES:,}-byte records"
            )
        records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)
        labels = records[:, 0].copy()
        planes = records[:, 1:]
    else:
        labels, planes = _checked_batch(_unpickle(data, where), where)
    if labels.size == 0:
        raise SourceError(f"{where}: no images")
    if int(labels.max()) >= len(CLASS_NAMES):
        raise SourceError(f"{where}: label {int(labels.max())} outside 0..9")
    images = planes.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return labels, np.ascontiguousarray(images)


_META_NAMES = frozenset(spec.meta for spec in FORMATS.values())
_META_KEYS = frozenset({"label_names", "num_cases_per_batch", "num_vis"})


def _check_meta(data: bytes, name: str, where: str) -> None:
    """A meta file is what CIFAR-10 publishes, or refused: ``batches.meta.txt`` ten class names
    as UTF-8 lines; ``batches.meta`` a pickle read with the restricted unpickler (one that would
    run code on load is refused as it loads) holding a dict of ``label_names`` (ten texts) and
    the counts ``num_cases_per_batch`` and ``num_vis``, nothing else."""
    if name.endswith(".txt"):
        try:
            names = [line for line in data.decode("utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise SourceError(f"{where}: not UTF-8 text: no CIFAR-10 meta file") from None
        if len(names) != len(CLASS_NAMES):
            raise SourceError(f"{where}: {len(names)} class names, CIFAR-10 has 10")
        return
    meta = _unpickle(data, where)
    if not isinstance(meta, dict):
        raise SourceError(f"{where}: pickle holds a {type(meta).__name__}, not a CIFAR-10 dict")
    fields = {(k.decode("latin-1") if isinstance(k, bytes) else k): v for k, v in meta.items()}
    unexpected = [k for k in fields if k not in _META_KEYS]
    if unexpected or len(fields) != len(meta):
        raise SourceError(f"{where}: unexpected key {str(unexpected[:1])[1:-1]} in the meta dict")
    label_names = fields.get("label_names")
    if not isinstance(label_names, list) or len(label_names) != len(CLASS_NAMES):
        raise SourceError(f"{where}: label_names is not a list of 10 class names")
    if any(not isinstance(n, bytes | str) for n in label_names):
        raise SourceError(f"{where}: label_names are not texts")
    for key in ("num_cases_per_batch", "num_vis"):
        if key in fields and type(fields[key]) is not int:
            raise SourceError(f"{where}: {key} is not an integer")


def _checked(data: bytes, name: str, where: str) -> Result:
    """What the commit needs of a batch: its rows and its images per class; of a meta file,
    nothing (it is checked, :func:`_check_meta`)."""
    if name in _META_NAMES:
        _check_meta(data, name, where)
        return {}
    labels, _images = _decode_batch(data, name, where)
    counts = np.bincount(labels, minlength=len(CLASS_NAMES)).tolist()
    return {"rows": int(labels.size), "class_counts": [int(c) for c in counts]}


# ---------------------------------------------------------------------------------------------
# Locating and extracting


def _safe_member(member: tarfile.TarInfo, archive: str) -> str | None:
    """The member's normalised path, or None for a directory; refuses anything unsafe."""
    name = member.name
    if name.startswith("/") or "\\" in name or Path(name).is_absolute():
        raise SourceError(f"{archive}: member {name!r} has an absolute path; refused")
    parts = [p for p in posixpath.normpath(name).split("/") if p not in ("", ".")]
    if ".." in name.split("/") or ".." in parts:
        raise SourceError(f"{archive}: member {name!r} climbs out with '..'; refused")
    if member.issym() or member.islnk():
        raise SourceError(f"{archive}: member {name!r} is a link; refused")
    if member.isdir():
        return None
    if not member.isfile():
        raise SourceError(f"{archive}: member {name!r} is a device or special file; refused")
    if member.size > MAX_MEMBER_BYTES:
        raise SourceError(f"{archive}: member {name!r} is {member.size:,} bytes; refused")
    return "/".join(parts)


def _data_filter(member: tarfile.TarInfo, dest: Path, label: str) -> None:
    """Python's own check of an extracted member (PEP 706's "data" filter: no absolute path,
    nothing outside ``dest``, no link, device or setuid bit), under the checks above, which
    name the refusal in the archive's terms."""
    try:
        tarfile.data_filter(member, str(dest))
    except tarfile.FilterError as exc:
        raise SourceError(f"{label}: member {member.name!r} refused: {exc}") from exc


def _wanted_names() -> dict[str, str]:
    """File name -> format, for every file either format may hold."""
    out: dict[str, str] = {}
    for fmt, spec in FORMATS.items():
        for name in (*spec.batches, spec.meta):
            out[name] = fmt
    return out


_BATCH_NAMES = frozenset(b for spec in FORMATS.values() for b in spec.batches)


def _from_directory(directory: Path) -> dict[str, Path]:
    """The files either format may hold in ``directory`` (or its cifar-10-batches-* folders),
    by name; the first found of each name."""
    wanted = _wanted_names()
    found: dict[str, Path] = {}
    folders = [directory] + [directory / str(spec.folder) for spec in FORMATS.values()]
    for folder in folders:
        if not folder.is_dir():
            continue
        for name in wanted:
            path = folder / name
            if path.is_file() and name not in found:
                found[name] = path
    return found


def _format_of(found: Mapping[str, object], source: str) -> str:
    complete = [fmt for fmt, spec in FORMATS.items() if all(b in found for b in spec.batches)]
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise SourceError(f"{source}: holds both the binary and the python batches; pick one")
    best = max(FORMATS, key=lambda f: sum(b in found for b in FORMATS[f].batches))
    missing = [b for b in FORMATS[best].batches if b not in found]
    raise SourceError(f"{source}: lacks {', '.join(missing)} ({best} CIFAR-10 batches)")


def _kept(fmt: str) -> tuple[str, ...]:
    """The files of ``fmt`` a version keeps: its batches and its meta file."""
    return (*FORMATS[fmt].batches, FORMATS[fmt].meta)


class _HashingReader(io.RawIOBase):
    """Reads ``raw`` for tarfile, hashing and counting every byte it hands out."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._hash = hashlib.sha256()
        self.bytes = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._raw.read(size)
        self._hash.update(chunk)
        self.bytes += len(chunk)
        return chunk

    def drain(self) -> None:
        """Read (and hash) what tarfile left: end-of-archive blocks, the gzip trailer."""
        while self.read(_CHUNK):
            pass

    def digest(self) -> str:
        return self._hash.hexdigest()

    def readable(self) -> bool:
        return True


def _write_whole(source: IO[bytes], target: Path) -> dict[str, Any]:
    """Copy ``source`` to ``target`` whole or not at all; its sha256 and size."""
    digest = hashlib.sha256()
    size = 0
    partial = partial_path(target)
    try:
        with open(partial, "xb") as out:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return {"sha256": digest.hexdigest(), "bytes": size}


@dataclass(frozen=True)
class _Extracted:
    fmt: str
    archive: dict[str, Any]
    """The archive's sha256 and size."""
    files: dict[str, dict[str, Any]]
    """sha256 and size of each file kept (the batches and meta file of ``fmt``), by name."""


def _extract(archive: Path, dest: Path, label: str) -> _Extracted:
    """Extract the wanted members of ``archive`` (named ``label`` in errors) into ``dest``,
    reading it once, as a stream: the archive and every member hashed on the way through."""
    wanted = _wanted_names()
    found: dict[str, dict[str, Any]] = {}
    try:
        with open(archive, "rb") as raw:
            reader = _HashingReader(raw)
            # "r|*": a stream, read front to back and never sought, so the hash sees every byte
            # once and in order.
            with tarfile.open(fileobj=reader, mode="r|*") as tar:
                for member in tar:
                    path = _safe_member(member, label)
                    if path is None:
                        continue
                    _data_filter(member, dest, label)
                    base = posixpath.basename(path)
                    if base not in wanted:
                        continue
                    if base in found:
                        raise SourceError(f"{label}: holds {base} twice")
                    src = tar.extractfile(member)
                    if src is None:
                        raise SourceError(f"{label}: cannot read member {path!r}")
                    with src:
                        found[base] = _write_whole(src, dest / base)
                    crash_point("after-file", dest / base)
            reader.drain()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise SourceError(f"{label}: unreadable archive: {exc}") from exc
    fmt = _format_of(found, label)
    for name in set(found) - set(_kept(fmt)):  # the other format's strays are not kept
        (dest / name).unlink()
        del found[name]
    return _Extracted(
        fmt=fmt, archive={"sha256": reader.digest(), "bytes": reader.bytes}, files=found
    )


def _is_remote(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def _local_path(source: str) -> Path | None:
    """The existing local path ``source`` names; None for a remote URL."""
    if _is_remote(source):
        return None
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.exists():
        raise SourceError(f"--source {source}: no such file or directory")
    return path


def _state(url: str) -> str | None:
    """16 hex digits naming the current state of ``url`` (size, modification time, ETag),
    from its metadata; None when fsspec tells none of them."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except (ImportError, OSError, ValueError):
        return None
    fields = ("size", "mtime", "ETag", "etag", "LastModified", "Last-Modified")
    state = [info.get(name) for name in fields]
    if all(value is None for value in state):
        return None
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# The tasks


def copy_task(path: str, name: str, out: str) -> Result:
    """Copy one file of a directory source to ``out`` whole or not at all, hashing it as it is
    read, and check it from the same bytes when it is a batch; kept when an interrupted run
    of the same job already did (its result is kept beside ``out``).

    Returns ``{"file", "output": {"sha256", "bytes"}}``, and ``"rows"``, ``"class_counts"``
    for a batch.
    """
    target = Path(out)
    recorded = recorded_result(target)
    if recorded is not None:
        return {**recorded, "reused": True}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target)
    try:
        # Whole, in memory (a batch is ~30 MB; plan_ingest refuses big files): hashed, written
        # and checked from the one read.
        try:
            with open(path, "rb") as src:
                data = src.read()
            with open(partial, "xb") as dst:
                dst.write(data)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as exc:
            raise SourceError(f"{path}: cannot copy: {exc}") from exc
        digest = hashlib.sha256(data)
        result: Result = {
            "file": name,
            "output": {"sha256": digest.hexdigest(), "bytes": len(data)},
        }
        if name in _BATCH_NAMES or name in _META_NAMES:
            result.update(_checked(data, name, path))
        os.replace(partial, target)  # checked first: a bad batch leaves nothing
    finally:
        partial.unlink(missing_ok=True)
    record_result(target, result)
    crash_point("after-file", target)
    return result


_EXTRACTION_RECORD = "extraction.json"


def extract_task(archive: str, label: str, cache: str | None, work: str) -> Result:
    """Fetch ``archive`` (a local path or any fsspec URL; through the download ``cache`` when
    remote) and extract its wanted members into ``work/archive-<state>/``, reading it once;
    kept when an interrupted run of the same job extracted this state of it.

    Returns ``{"folder", "format", "archive": {"sha256", "bytes"}, "files": {name: {"sha256",
    "bytes"}}}``; the files exist only when this returns.
    """
    state = _state(archive)
    # Named by the archive's state: a changed archive is extracted afresh, never mixed with
    # what an interrupted run took from the old one. An archive of unknown state: every time.
    folder_name = f"archive-{state or uuid.uuid4().hex[:16]}"
    folder = Path(work) / folder_name
    if state is not None:
        recorded = _recorded_extraction(folder)
        if recorded is not None:
            return {**recorded, "reused": True}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if _is_remote(archive):
            download = partial_path(folder / "archive")
            try:
                fetch(
                    archive,
                    download,
                    cache=Path(cache) if cache is not None else None,
                    progress=task_progress.retries_only,
                )
                extracted = _extract(download, folder, label)
            finally:
                download.unlink(missing_ok=True)
        else:
            extracted = _extract(Path(archive), folder, label)
    except BaseException:
        # Without its record an extraction is never kept: its files are only in the way.
        shutil.rmtree(folder, ignore_errors=True)
        raise
    result: Result = {
        "folder": folder_name,
        "format": extracted.fmt,
        "archive": extracted.archive,
        "files": extracted.files,
    }
    _record_extraction(folder, result)
    return result


def _recorded_extraction(folder: Path) -> Result | None:
    """The result of an extraction into ``folder`` that finished (its record there and every
    file whole), else None."""
    try:
        result: Result = json.loads((folder / _EXTRACTION_RECORD).read_text())
        whole = all(
            (folder / name).stat().st_size == int(entry["bytes"])
            for name, entry in result["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return result if whole else None


def _record_extraction(folder: Path, result: Result) -> None:
    record = folder / _EXTRACTION_RECORD
    partial = partial_path(record)
    partial.write_text(json.dumps(result, sort_keys=True))
    os.replace(partial, record)


def check_task(path: str, where: str, sha256: str) -> Result:
    """Check one extracted batch, reading it once (its ``sha256`` is the extraction's); kept
    when an interrupted run of the same job already checked it.

    Returns ``{"file", "output": {"sha256", "bytes"}, "rows", "class_counts"}``.
    """
    target = Path(path)
    recorded = recorded_result(target)
    if recorded is not None:
        return {**recorded, "reused": True}
    data = target.read_bytes()
    result: Result = {
        "file": target.name,
        "output": {"sha256": sha256, "bytes": len(data)},
        **_checked(data, target.name, where),
    }
    record_result(target, result)
    return result


# ---------------------------------------------------------------------------------------------
# The ingest job


@dataclass(frozen=True, kw_only=True)
class LocalFile:
    """One file of a directory source, as listed."""

    name: str
    path: str
    """Absolute."""
    size: int
    stamp: str
    """16 hex digits naming this state of the file (path, size, modification time)."""


@dataclass(frozen=True, kw_only=True)
class Cifar10Job:
    """CIFAR-10 into a new raw "cifar10" version (a :class:`preprocessing.driver.Job`).

    A directory: pass "copy". An archive or URL: passes "extract", then "check".
    """

    source: str
    """As given (named in errors)."""
    uri: str
    """What the manifest records: the URL, or the local path's file:// URI."""
    archive: str | None
    """The archive's local path or URL; None for a directory."""
    files: tuple[LocalFile, ...] = ()
    """A directory's files: the batches and meta file of ``fmt``."""
    fmt: str | None = None
    """A directory's format ("binary" or "python"); an archive's is known once extracted."""
    archive_bytes: int = 0
    """A local archive's size (for progress)."""
    provenance: str = "real"
    cache: Path | None = None
    """The download cache of a URL."""
    name: str = "cifar10"
    kind: str = "raw"
    version: None = None
    """Known at the commit: the version derives from the files' digests."""

    @property
    def passes(self) -> tuple[str, ...]:
        return ("copy",) if self.archive is None else ("extract", "check")

    @property
    def work_key(self) -> str:
        identity = [stage_code(__name__), self.uri]
        return f"{self.name}-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}"

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        if pass_name == "copy":
            return [
                TaskSpec(
                    key=f"copy-{item.name}",
                    fn=copy_task,
                    args=(item.path, item.name, str(_copy_output(work, item))),
                    bytes=item.size,
                )
                for item in self.files
            ]
        if pass_name == "extract":
            assert self.archive is not None
            return [
                TaskSpec(
                    key="extract",
                    fn=extract_task,
                    args=(
                        self.archive,
                        self.source,
                        str(self.cache) if self.cache is not None else None,
                        str(work),
                    ),
                    bytes=self.archive_bytes,
                )
            ]
        extraction = done["extract"][0]
        folder = work / extraction["folder"]
        files = extraction["files"]
        spec = FORMATS[extraction["format"]]
        checked = [*spec.batches, *((spec.meta,) if spec.meta in files else ())]
        return [
            TaskSpec(
                key=f"check-{name}",
                fn=check_task,
                args=(str(folder / name), f"{self.source}: {name}", files[name]["sha256"]),
                bytes=int(files[name]["bytes"]),
            )
            for name in checked
        ]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        archive_sha256: str | None = None
        if self.archive is None:
            assert self.fmt is not None
            fmt = self.fmt
            paths = {item.name: _copy_output(work, item) for item in self.files}
            files = {r["file"]: r["output"] for r in done["copy"]}
            checks = {r["file"]: r for r in done["copy"] if "rows" in r}
        else:
            extraction = done["extract"][0]
            fmt = extraction["format"]
            files = extraction["files"]
            paths = {name: work / extraction["folder"] / name for name in files}
            checks = {r["file"]: r for r in done["check"] if "rows" in r}
            archive_sha256 = extraction["archive"]["sha256"]
        spec = FORMATS[fmt]
        described: dict[str, FileEntry] = {}
        for name in sorted(files):
            stage.adopt(paths[name], name)
            described[name] = FileEntry(
                path=name,
                bytes=int(files[name]["bytes"]),
                sha256=str(files[name]["sha256"]),
                rows=int(checks[name]["rows"]) if name in checks else None,
                row_groups=None,
            )
        class_counts = {"train": [0] * len(CLASS_NAMES), "test": [0] * len(CLASS_NAMES)}
        for name in spec.batches:
            split = "test" if name.startswith("test") else "train"
            for label, count in enumerate(checks[name]["class_counts"]):
                class_counts[split][label] += int(count)
        sources = [
            {
                "uri": self.uri,
                "file": name,
                "sha256": str(files[name]["sha256"]),
                "bytes": int(files[name]["bytes"]),
                **({"archive_sha256": archive_sha256} if archive_sha256 else {}),
            }
            for name in sorted(files)
        ]
        train = sum(class_counts["train"])
        test = sum(class_counts["test"])
        manifest: Manifest = stage.commit(
            code_version=stage_code(__name__),
            sources=sources,
            parameters={},
            **Cifar10Layout(
                batch_format=fmt,
                image_shape=(32, 32, 3),
                num_classes=len(CLASS_NAMES),
                class_names=tuple(CLASS_NAMES),
                train_files=tuple(f for f in spec.batches if not f.startswith("test")),
                test_files=tuple(f for f in spec.batches if f.startswith("test")),
                train_rows=train,
                test_rows=test,
                class_counts={split: tuple(c) for split, c in class_counts.items()},
                provenance=self.provenance,
            ).to_manifest(),
            rows=train + test,
            described=described,
        )
        if self.archive is not None and _is_remote(self.archive):
            # The catalog holds the bytes now (a local archive was never cached).
            forget([self.archive], cache=self.cache)
        return manifest


def _copy_output(work: Path, item: LocalFile) -> Path:
    # The file's stamp in the name: a file changed since an interrupted run is copied again.
    return work / "copies" / f"{item.stamp}-{item.name}"


def plan_ingest(source: str, *, cache: Path | None = None) -> Cifar10Job:
    """The ingest of CIFAR-10 from ``source``: a directory of binary or python batches (or a
    cifar-10-batches-{bin,py}/ folder inside it), a .tar.gz of either, or the URL of such an
    archive (any fsspec URL: https://, s3://, ...), fetched through the download ``cache``.

    Reads no data: a directory is listed (and refused when it lacks batches or holds both
    formats), a local archive only checked to exist.
    """
    path = _local_path(source)
    if path is None:
        return Cifar10Job(source=source, uri=source, archive=source, cache=cache)
    uri = path.resolve().as_uri()
    if not path.is_dir():
        archive = path.resolve()
        return Cifar10Job(
            source=source,
            uri=uri,
            archive=str(archive),
            archive_bytes=archive.stat().st_size,
            cache=cache,
        )
    found = _from_directory(path)
    fmt = _format_of(found, source)
    files = []
    for name in _kept(fmt):
        if name not in found:
            continue  # the meta file is optional
        resolved = found[name].resolve()
        stat = resolved.stat()
        if stat.st_size > MAX_MEMBER_BYTES:
            # Checked in memory on a worker: a file this big is no CIFAR-10 batch.
            raise SourceError(f"{resolved}: {stat.st_size:,} bytes; refused")
        state = [str(resolved), stat.st_size, stat.st_mtime_ns]
        files.append(
            LocalFile(
                name=name,
                path=str(resolved),
                size=stat.st_size,
                stamp=hashlib.sha256(repr(state).encode()).hexdigest()[:16],
            )
        )
    return Cifar10Job(
        source=source,
        uri=uri,
        archive=None,
        files=tuple(files),
        fmt=fmt,
        # Written by `shardflow synth cifar10` beside the batches it makes.
        provenance="synthetic" if (path / "SYNTHETIC.json").is_file() else "real",
        cache=cache,
    )


# ---------------------------------------------------------------------------------------------
# Entry points


def read_cifar10(
    source: str | Path, *, progress: Progress = lambda _msg: None
) -> dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]:
    """{"train": (images, labels), "test": (images, labels)} of a directory of binary or python
    batches, a .tar.gz of either, or a URL of such an archive.

    Images are uint8 [n, 32, 32, 3] (HWC), labels uint8 [n]; train is data_batch_1..5 in order.
    Archives are extracted (safely) into a temporary folder that is removed afterwards.
    """
    source = str(source)
    with tempfile.TemporaryDirectory(prefix="shardflow-cifar10-") as scratch:
        path = _local_path(source)
        if path is not None and path.is_dir():
            files = _from_directory(path)
            fmt = _format_of(files, source)
        else:
            archive = path
            if archive is None:
                archive = Path(scratch) / "archive.tar.gz"
                fetch(source, archive, progress=progress)
            extracted = _extract(archive, Path(scratch), source)
            fmt = extracted.fmt
            files = {name: Path(scratch) / name for name in extracted.files}
        spec = FORMATS[fmt]
        out: dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] = {}
        for split in ("train", "test"):
            names = [b for b in spec.batches if b.startswith("test") == (split == "test")]
            parts = [read_batch(files[name]) for name in names]
            out[split] = (
                np.concatenate([images for _labels, images in parts]),
                np.concatenate([labels for labels, _images in parts]),
            )
    return out


def ingest(
    catalog: Catalog,
    *,
    source: str,
    progress: Progress = lambda _msg: None,
    download_cache: Path | None = None,
    work_root: Path | None = None,
) -> Manifest:
    """CIFAR-10 into raw version "cifar10" (see :func:`plan_ingest` for ``source``), its tasks
    run one after the other in this process.

    The batch files are kept byte for byte; every one is checked before the commit. With
    ``download_cache``, an archive fetched whole by an earlier, interrupted run is taken from
    there instead of the URL while the source is unchanged; with ``work_root``, the files an
    interrupted run finished are kept too.
    """
    return run_job(
        catalog,
        plan_ingest(source, cache=download_cache),
        runner=serial_runner,
        work_root=work_root,
        progress=progress,
    )
