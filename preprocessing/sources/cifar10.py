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

import io
import pickle
import posixpath
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from data_catalog import Catalog, Manifest
from preprocessing.sources.fetch import download, sha256_file
from preprocessing.sources.mnist import SourceError

__all__ = ["CLASS_NAMES", "SourceError", "ingest", "read_batch", "read_cifar10"]

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
        labels, planes = _checked_batch(_unpickle(data, where), where)
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


def _from_directory(directory: Path, dest: Path | None) -> dict[str, Path]:
    """The batch files in ``directory`` (or its cifar-10-batches-* folder), copied into
    ``dest`` when given, else where they lie."""
    wanted = _wanted_names()
    found: dict[str, Path] = {}
    folders = [directory] + [directory / str(spec.folder) for spec in FORMATS.values()]
    for folder in folders:
        if not folder.is_dir():
            continue
        for name in wanted:
            path = folder / name
            if path.is_file() and name not in found:
                if dest is not None:
                    shutil.copyfile(path, dest / name)
                    path = dest / name
                found[name] = path
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


@dataclass(frozen=True)
class _Gathered:
    files: dict[str, Path]  # the batch (and meta) files of one format, by name
    fmt: str
    uri: str
    archive_sha256: str | None


def _gather(source: str, dest: Path, progress: Progress, *, copy: bool) -> _Gathered:
    """Locate, fetch or extract the batches of ``source`` (dest receives what is copied;
    a local directory's files are only copied when ``copy``)."""
    remote = "://" in source and not source.startswith("file://")
    path = Path(source.removeprefix("file://")).expanduser()
    if not remote and not path.exists():
        raise SourceError(f"--source {source}: no such file or directory")
    uri = source if remote else path.resolve().as_uri()
    archive_sha256: str | None = None
    if remote:
        archive = dest / "_download.tar.gz"
        try:
            archive_sha256, _size = download(source, archive, progress=progress)
            found = _from_archive(archive, dest, progress, label=source)
        finally:
            archive.unlink(missing_ok=True)
    elif path.is_dir():
        found = _from_directory(path, dest if copy else None)
    else:
        archive_sha256, _size = sha256_file(path)
        found = _from_archive(path, dest, progress, label=source)
    fmt = _format_of(found, source)
    spec = FORMATS[fmt]
    for name in list(found):  # the other format's strays, if any, are not kept
        if name not in (*spec.batches, spec.meta):
            stray = found.pop(name)
            if stray.parent == dest:
                stray.unlink()
    return _Gathered(files=found, fmt=fmt, uri=uri, archive_sha256=archive_sha256)


def read_cifar10(
    source: str | Path, *, progress: Progress = lambda _msg: None
) -> dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]:
    """{"train": (images, labels), "test": (images, labels)} of a directory of binary or python
    batches, a .tar.gz of either, or a URL of such an archive.

    Images are uint8 [n, 32, 32, 3] (HWC), labels uint8 [n]; train is data_batch_1..5 in order.
    Archives are extracted (safely) into a temporary folder that is removed afterwards.
    """
    with tempfile.TemporaryDirectory(prefix="shardflow-cifar10-") as scratch:
        gathered = _gather(str(source), Path(scratch), progress, copy=False)
        spec = FORMATS[gathered.fmt]
        out: dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] = {}
        for split in ("train", "test"):
            names = [b for b in spec.batches if b.startswith("test") == (split == "test")]
            parts = [read_batch(gathered.files[name]) for name in names]
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
) -> Manifest:
    """CIFAR-10 into raw version "cifar10", from a directory of binary or python batches, a
    .tar.gz of either, or the URL of such an archive (any fsspec URL: https://, s3://, ...).

    The batch files are kept byte for byte; every one is read and checked before the commit.
    """
    with catalog.stage("cifar10", kind="raw") as stage:
        gathered = _gather(source, stage.path, progress, copy=True)
        found, fmt, archive_sha256 = gathered.files, gathered.fmt, gathered.archive_sha256
        spec = FORMATS[fmt]
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
                "uri": gathered.uri,
                "file": name,
                "sha256": sha256_file(found[name])[0],
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
                # Written by `shardflow synth cifar10` beside the batches it makes.
                "provenance": "synthetic"
                if (Path(source).expanduser() / "SYNTHETIC.json").is_file()
                else "real",
            },
            rows=train + test,
            file_rows=file_rows,
        )
    return manifest
