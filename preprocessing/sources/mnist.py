"""MNIST and Fashion-MNIST: the four IDX files, fetched from a directory or any fsspec URL.

source (dir, file://, http(s)://, s3://, ...)
    │  locate each of the four files, raw or .gz
    ▼
staging dir of a new raw version ── exact fetched bytes, sha256 while streaming
    │  check magic, dimensions, size, counts, label range
    ▼
raw catalog version (rows = train + test)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from data_catalog import Catalog, Manifest
from data_catalog.errors import ShardflowError
from preprocessing.sources import idx

Progress = Callable[[str], None]
FileDone = Callable[[dict[str, Any]], None]

FILE_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True, kw_only=True)
class ImageSet:
    """What we know of one IDX image dataset."""

    name: str
    num_classes: int
    class_names: tuple[str, ...]
    # Tried in order when the user gives no --source.
    default_sources: tuple[str, ...]
    # Published md5 digests keyed by file stem, checked when the source is one of the defaults.
    known_md5: dict[str, str]
    # "gz": digests of the .gz files as published. "decompressed": digests of the contents,
    # for Fashion-MNIST, whose Debian .gz files differ from upstream's in the gzip header only.
    known_md5_of: str
    # Digits must never be mirrored; clothes and objects may.
    flips_allowed: bool


DATASETS: dict[str, ImageSet] = {
    "mnist": ImageSet(
        name="mnist",
        num_classes=10,
        class_names=tuple(str(d) for d in range(10)),
        default_sources=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ),
        # As published by torchvision for the upstream .gz files.
        known_md5={
            "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        known_md5_of="gz",
        flips_allowed=False,
    ),
    "fashion-mnist": ImageSet(
        name="fashion-mnist",
        num_classes=10,
        class_names=(
            "T-shirt/top",
            "Trouser",
            "Pullover",
            "Dress",
            "Coat",
            "Sandal",
            "Shirt",
            "Sneaker",
            "Bag",
            "Ankle boot",
        ),
        default_sources=(
            DEBIAN_FASHION_MNIST,
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        ),
        known_md5={
            "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
            "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
            "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
        },
        known_md5_of="decompressed",
        flips_allowed=True,
    ),
}


class SourceError(ShardflowError):
    """A source cannot be read or does not hold what it should."""


def image_set(name: str) -> ImageSet:
    try:
        return DATASETS[name]
    except KeyError:
        raise ShardflowError(
            f"unknown image dataset {name!r}; known: {', '.join(sorted(DATASETS))}"
        ) from None


def _join(base: str, stem: str) -> str:
    return base.rstrip("/") + "/" + stem


def _locate(fs: fsspec.AbstractFileSystem, base: str, stem: str) -> str | None:
    """The URL of ``stem`` under ``base``: the ``.gz`` file if present, else the raw one."""
    for candidate in (_join(base, stem) + ".gz", _join(base, stem)):
        try:
            # info, not exists: over HTTP fsspec's exists is a GET of the whole file, info a HEAD.
            fs.info(candidate)
        except FileNotFoundError:
            continue
        except OSError:
            # An HTTP server may answer a HEAD for a missing file with an error, not a 404.
            continue
        return candidate
    return None


def _copy(
    fs: fsspec.AbstractFileSystem, url: str, dest: Path, *, attempts: int = 3
) -> tuple[str, int]:
    """Stream ``url`` to ``dest``; returns (sha256, bytes). Retries transient network errors."""
    for attempt in range(1, attempts + 1):
        digest = hashlib.sha256()
        size = 0
        try:
            with fs.open(url, "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            return digest.hexdigest(), size
        except (OSError, TimeoutError) as exc:
            if attempt == attempts:
                raise SourceError(f"cannot fetch {url}: {exc}") from exc
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def _transfer(
    fs: fsspec.AbstractFileSystem, url: str, dest: Path, progress: Progress
) -> tuple[str, int]:
    """http(s): timeouts, retries, Range resume and progress (fetch.download); else fsspec."""
    if url.lower().startswith(("http://", "https://")):
        # Imported here: fetch builds on this module's SourceError.
        from preprocessing.sources.fetch import download

        return download(url, dest, progress=progress)
    return _copy(fs, url, dest)


def _cache_key(fs: fsspec.AbstractFileSystem, url: str) -> str:
    """Names one state of a remote file: its URL, size and modification stamp (or ETag)."""
    try:
        info = fs.info(url)
    except (OSError, ValueError):
        info = {}
    stamp = [
        url,
        info.get("size"),
        info.get("mtime"),
        info.get("ETag"),
        info.get("etag"),
        info.get("LastModified"),
        info.get("Last-Modified"),
    ]
    return hashlib.sha256(repr(stamp).encode()).hexdigest()[:32]


def _fetch(
    fs: fsspec.AbstractFileSystem, url: str, dest: Path, cache: Path | None, progress: Progress
) -> tuple[str, int]:
    """Fetch ``url`` to ``dest`` through the download cache: a file fetched whole before (by a
    run that then crashed, say) is not fetched again while the source is unchanged."""
    if cache is None:
        return _transfer(fs, url, dest, progress)
    cache.mkdir(parents=True, exist_ok=True)
    key = _cache_key(fs, url)
    cached, recorded = cache / key, cache / f"{key}.sha256"
    if cached.exists() and recorded.exists():
        digest = hashlib.sha256()
        with open(cached, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() == recorded.read_text().strip():
            _place(cached, dest)
            progress(f"reused {url} from the download cache")
            return digest.hexdigest(), cached.stat().st_size
    partial = cache / f"{key}.part"
    sha256, size = _transfer(fs, url, partial, progress)
    os.replace(partial, cached)  # whole or absent: a crash leaves at most a .part file
    recorded.write_text(sha256 + "\n")
    _place(cached, dest)
    return sha256, size


def _place(cached: Path, dest: Path) -> None:
    """Hard-link a cached download into staging, copying across filesystems."""
    try:
        os.link(cached, dest)
    except OSError:
        shutil.copyfile(cached, dest)


def _forget(fs: fsspec.AbstractFileSystem, urls: list[str], cache: Path | None) -> None:
    """Drop cache entries once their version is committed: the catalog holds the bytes."""
    if cache is None:
        return
    for url in urls:
        key = _cache_key(fs, url)
        for path in (cache / key, cache / f"{key}.sha256"):
            path.unlink(missing_ok=True)


def _md5(path: Path, *, decompressed: bool) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    opener: Any = gzip.open if decompressed and idx.is_gzip(path) else open
    with opener(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _resolve(source: str) -> tuple[fsspec.AbstractFileSystem, str]:
    if "://" not in source:
        path = Path(source).expanduser()
        if not path.is_dir():
            raise SourceError(f"--source {source}: no such directory")
        source = str(path.resolve())
    try:
        fs, base = fsspec.core.url_to_fs(source)
    except (ImportError, ValueError) as exc:
        raise SourceError(f"--source {source}: {exc}") from exc
    return fs, base


def _fetch_all(
    dataset: ImageSet,
    source: str,
    dest: Path,
    progress: Progress,
    on_file: FileDone,
    cache: Path | None,
) -> list[dict[str, Any]]:
    fs, base = _resolve(source)
    located: list[tuple[str, str]] = []
    missing: list[str] = []
    for stem in FILE_STEMS:
        url = _locate(fs, base, stem)
        if url is None:
            missing.append(stem)
        else:
            located.append((stem, url))
    if missing:
        raise SourceError(
            f"{source} lacks {', '.join(missing)} (looked for each name raw and with .gz)"
        )
    sources = []
    for stem, url in located:
        name = url.rsplit("/", 1)[-1]
        digest, size = _fetch(fs, url, dest / name, cache, progress)
        progress(f"fetched {url} ({size:,} bytes)")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        uri = url if protocol != "file" else "file://" + url
        fetched = {
            "uri": uri,
            "file": name,
            "sha256": digest,
            "bytes": size,
            "stem": stem,
            "url": url,
        }
        sources.append(fetched)
        on_file(fetched)
    return sources


def ingest(
    catalog: Catalog,
    dataset_name: str,
    *,
    source: str | None = None,
    progress: Progress = lambda _msg: None,
    on_file: FileDone = lambda _file: None,
    download_cache: Path | None = None,
) -> Manifest:
    """Fetch the four IDX files of ``dataset_name`` into a new raw catalog version.

    A source that yields exactly the bytes of an existing version gives that version back and
    writes nothing. With ``download_cache``, files fetched whole by an earlier, interrupted
    run are taken from there instead of the source (hard-linked into staging where the
    filesystem allows, else copied).
    """
    dataset = image_set(dataset_name)
    candidates: Sequence[str]
    if source is not None:
        candidates = (source,)
    else:
        candidates = [s for s in dataset.default_sources if "://" in s or os.path.isdir(s)]
    errors: list[str] = []
    for candidate in candidates:
        with catalog.stage(dataset.name, kind="raw") as stage:
            try:
                sources = _fetch_all(
                    dataset, candidate, stage.path, progress, on_file, download_cache
                )
            except SourceError as exc:
                if source is not None:
                    raise
                errors.append(str(exc))
                continue
            canonical = source is None
            provenance = _provenance(candidate)
            manifest = _commit(
                stage,
                dataset,
                sources,
                canonical=canonical,
                progress=progress,
                provenance=provenance,
            )
            fs, _ = _resolve(candidate)
            _forget(fs, [s["url"] for s in sources], download_cache)
            return manifest
    raise SourceError(
        f"no default source of {dataset.name} could be read ({'; '.join(errors)}); "
        "pass --source DIR_OR_URL"
    )


def _provenance(source: str) -> dict[str, Any]:
    """What SYNTHETIC.json beside the files says (written by `shardflow synth`), if present."""
    fs, base = _resolve(source)
    try:
        marker = json.loads(fs.cat_file(_join(base, "SYNTHETIC.json")))
    except (FileNotFoundError, OSError, ValueError):
        return {"provenance": "real"}
    return {"provenance": "synthetic", "synthetic": marker}


def _commit(
    stage: Any,
    dataset: ImageSet,
    sources: list[dict[str, Any]],
    *,
    canonical: bool,
    progress: Progress,
    provenance: dict[str, Any],
) -> Manifest:
    by_stem = {s["stem"]: stage.path / s["file"] for s in sources}
    if canonical:
        for stem, path in by_stem.items():
            decompressed = dataset.known_md5_of == "decompressed"
            md5 = _md5(path, decompressed=decompressed)
            if md5 != dataset.known_md5[stem]:
                raise SourceError(
                    f"{path.name} from the default source has md5 {md5}, expected "
                    f"{dataset.known_md5[stem]} ({dataset.known_md5_of}); the mirror is corrupt"
                )
    train = idx.check_pair(
        by_stem["train-images-idx3-ubyte"],
        by_stem["train-labels-idx1-ubyte"],
        num_classes=dataset.num_classes,
    )
    test = idx.check_pair(
        by_stem["t10k-images-idx3-ubyte"],
        by_stem["t10k-labels-idx1-ubyte"],
        num_classes=dataset.num_classes,
    )
    if train.image_shape != test.image_shape:
        raise SourceError(
            f"train images are {train.image_shape}, test images {test.image_shape}: "
            "the files are from different datasets"
        )
    progress(f"checked {train.count:,} train + {test.count:,} test images")
    file_rows = {
        s["file"]: (train.count if s["stem"].startswith("train") else test.count) for s in sources
    }
    manifest: Manifest = stage.commit(
        sources=[{k: v for k, v in s.items() if k not in ("stem", "url")} for s in sources],
        parameters={},
        schema={
            "format": "idx",
            "image_shape": list(train.image_shape),
            "num_classes": dataset.num_classes,
            "class_names": list(dataset.class_names),
            "files": {s["stem"]: s["file"] for s in sources},
        },
        statistics={
            "train_rows": train.count,
            "test_rows": test.count,
            "canonical_digests_checked": canonical,
            **provenance,
        },
        rows=train.count + test.count,
        file_rows=file_rows,
    )
    return manifest
