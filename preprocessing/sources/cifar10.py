"""CIFAR-10 in either published shape: the binary batches or the Python (pickle) batches.

source: a directory (the batches, or a cifar-10-batches-{bin,py}/ folder inside it) or a
        .tar.gz archive of either
    │  archives: members extracted one by one, refusing "..", absolute paths, links, devices
    ▼
staging dir of a new raw version ── the batch files' exact bytes
    │  binary: 1 label byte + 3,072 pixel bytes per record
    │  python: pickles read with a RESTRICTED unpickler (numpy array reconstruction only)
    ▼
raw catalog version "cifar10" (rows = train + test images)

``read_batch`` turns either file kind into (labels uint8[n], images uint8[n, 32, 32, 3]).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import posixpath
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from data_catalog import Catalog, Manifest
from preprocessing.sources.mnist import SourceError

__all__ = ["CLASS_NAMES", "SourceError", "ingest", "read_batch"]

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
            # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(text, "latin1").
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def _unpickle(data: bytes, where: str) -> Any:
    try:
        return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # a hostile or corrupt pickle can raise nearly anything
        raise SourceError(f"{where}: not a CIFAR-10 pickle: {exc}") from exc


def _key(d: dict[Any, Any], name: str) -> Any:
    for key in (name.encode(), name):
        if key in d:
            return d[key]
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Reading batches


def read_batch(path: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(labels, images HWC) of one batch file; binary if named ``*.bin``, else a pickle."""
    data = Path(path).read_bytes()
    where = str(path)
    if path.name.endswith(".bin"):
        if not data or len(data) % RECORD_BYTES:
            raise SourceError(
                f"{where}: {len(data):,} bytes is not a whole number of "
                f"{RECORD_BYTES:,}-byte records"
            )
        records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)
        labels = records[:, 0].copy()
        planes = records[:, 1:]
    else:
        batch = _unpickle(data, where)
        try:
            if not isinstance(batch, dict):
                raise TypeError(type(batch).__name__)
            planes = _key(batch, "data")
            raw_labels = _key(batch, "labels")
        except (KeyError, TypeError) as exc:
            raise SourceError(f"{where}: pickle lacks CIFAR-10's data/labels ({exc})") from None
        if (
            not isinstance(planes, np.ndarray)
            or planes.dtype != np.uint8
            or planes.ndim != 2
            or planes.shape[1] != IMAGE_BYTES
        ):
            got = getattr(planes, "shape", type(planes).__name__)
            raise SourceError(f"{where}: data is {got}, expected uint8 (n, {IMAGE_BYTES})")
        try:
            labels = np.array(list(raw_labels), dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{where}: labels are not integers ({exc})") from None
        if labels.shape != (planes.shape[0],):
            raise SourceError(f"{where}: {labels.size:,} labels for {planes.shape[0]:,} images")
        if labels.size and (labels.min() < 0 or labels.max() > 255):
            raise SourceError(f"{where}: labels outside 0..9")
        labels = labels.astype(np.uint8)
    if labels.size == 0:
        raise SourceError(f"{where}: no images")
    if int(labels.max()) >= len(CLASS_NAMES):
        raise SourceError(f"{where}: label {int(labels.max())} outside 0..9")
    images = planes.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return labels, np.ascontiguousarray(images)


# ---------------------------------------------------------------------------------------------
# Locating and copying


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


def _wanted_names() -> dict[str, str]:
    """File name -> format, for every file either format may hold."""
    out: dict[str, str] = {}
    for fmt, spec in FORMATS.items():
        for name in (*spec.batches, spec.meta):
            out[name] = fmt
    return out


def _from_archive(archive: Path, dest: Path, progress: Progress, *, label: str) -> dict[str, Path]:
    """Extract the wanted members of ``archive`` (named ``label`` in errors) into ``dest``."""
    wanted = _wanted_names()
    found: dict[str, Path] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                path = _safe_member(member, label)
                if path is None:
                    continue
                base = posixpath.basename(path)
                if base not in wanted:
                    continue
                if base in found:
                    raise SourceError(f"{label}: holds {base} twice")
                src = tar.extractfile(member)
                if src is None:
                    raise SourceError(f"{label}: cannot read member {path!r}")
                with src, open(dest / base, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                found[base] = dest / base
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SourceError(f"{label}: unreadable archive: {exc}") from exc
    progress(f"extracted {len(found)} files from {posixpath.basename(label)}")
    return found


def _from_directory(directory: Path, dest: Path) -> dict[str, Path]:
    wanted = _wanted_names()
    found: dict[str, Path] = {}
    folders = [directory] + [directory / str(spec.folder) for spec in FORMATS.values()]
    for folder in folders:
        if not folder.is_dir():
            continue
        for name in wanted:
            path = folder / name
            if path.is_file() and name not in found:
                shutil.copyfile(path, dest / name)
                found[name] = dest / name
    return found


def _format_of(found: dict[str, Path], source: str) -> str:
    complete = [fmt for fmt, spec in FORMATS.items() if all(b in found for b in spec.batches)]
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise SourceError(f"{source}: holds both the binary and the python batches; pick one")
    best = max(FORMATS, key=lambda f: sum(b in found for b in FORMATS[f].batches))
    missing = [b for b in FORMATS[best].batches if b not in found]
    raise SourceError(f"{source}: lacks {', '.join(missing)} ({best} CIFAR-10 batches)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, dest: Path, progress: Progress) -> None:
    import fsspec

    try:
        with fsspec.open(url, "rb") as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (OSError, ValueError, ImportError) as exc:
        raise SourceError(f"cannot fetch {url}: {exc}") from exc
    progress(f"fetched {url} ({dest.stat().st_size:,} bytes)")


def ingest(
    catalog: Catalog,
    *,
    source: str,
    progress: Progress = lambda _msg: None,
) -> Manifest:
    """CIFAR-10 into raw version "cifar10", from a directory of binary or python batches, a
    .tar.gz of either, or the URL of such an archive (any fsspec URL: https://, s3://, ...).

    The batch files are kept byte for byte; every one is read and checked before the commit.
    """
    remote = "://" in source
    path = Path(source).expanduser()
    if not remote and not path.exists():
        raise SourceError(f"--source {source}: no such file or directory")
    uri = source if remote else path.resolve().as_uri()
    archive_sha256: str | None = None
    with catalog.stage("cifar10", kind="raw") as stage:
        if remote:
            archive = stage.path / "_download.tar.gz"
            try:
                _download(source, archive, progress)
                archive_sha256 = _sha256(archive)
                found = _from_archive(archive, stage.path, progress, label=source)
            finally:
                archive.unlink(missing_ok=True)
        elif path.is_dir():
            found = _from_directory(path, stage.path)
        else:
            archive_sha256 = _sha256(path)
            found = _from_archive(path, stage.path, progress, label=source)
        fmt = _format_of(found, source)
        spec = FORMATS[fmt]
        for name in list(found):  # the other format's strays, if any, are not kept
            if name not in (*spec.batches, spec.meta):
                found.pop(name).unlink()
        file_rows: dict[str, int] = {}
        class_counts = {"train": [0] * 10, "test": [0] * 10}
        for name in spec.batches:
            labels, _images = read_batch(found[name])
            file_rows[name] = int(labels.size)
            split = "test" if name.startswith("test") else "train"
            for label, count in enumerate(np.bincount(labels, minlength=10).tolist()):
                class_counts[split][label] += int(count)
            progress(f"checked {name}: {labels.size:,} images")
        sources = [
            {
                "uri": uri,
                "file": name,
                "sha256": _sha256(found[name]),
                "bytes": found[name].stat().st_size,
                **({"archive_sha256": archive_sha256} if archive_sha256 else {}),
            }
            for name in sorted(found)
        ]
        train = sum(class_counts["train"])
        test = sum(class_counts["test"])
        manifest: Manifest = stage.commit(
            sources=sources,
            parameters={},
            schema={
                "format": f"cifar10-{fmt}",
                "image_shape": [32, 32, 3],
                "num_classes": 10,
                "class_names": list(CLASS_NAMES),
                "train_files": [f for f in spec.batches if not f.startswith("test")],
                "test_files": [f for f in spec.batches if f.startswith("test")],
            },
            statistics={
                "train_rows": train,
                "test_rows": test,
                "class_counts": class_counts,
            },
            rows=train + test,
            file_rows=file_rows,
        )
    return manifest
