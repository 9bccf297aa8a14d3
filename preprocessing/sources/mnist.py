"""MNIST and Fashion-MNIST: the four IDX files, fetched from a directory or any fsspec URL.

source (dir, file://, http(s)://, s3://, ...; default: Debian's folder, then upstream)
    │  plan: locate each of the four files, raw or .gz
    ▼
one fetch task per file (on Dask): exact bytes into the job's folder through the download
    │  cache, sha256 while streaming; magic, dimensions, size, label range, published md5
    ▼
commit: equal counts per pair, equal shapes ──▶ raw catalog version (rows = train + test)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from data_catalog import Catalog, Manifest, Staging
from data_catalog.errors import ShardflowError
from data_catalog.layout import IdxLayout
from preprocessing.driver import Results, TaskSpec, run_job, serial_runner
from preprocessing.fingerprint import stage_code
from preprocessing.shard_files import described as described_file
from preprocessing.shard_files import record_result, recorded_result
from preprocessing.sources import idx, task_progress
from preprocessing.sources.errors import SourceError
from preprocessing.sources.fetch import fetch, forget

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

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
    # The largest image side accepted. The real sets are 28 x 28; the cap leaves room for
    # MNIST-like sets of other sizes while refusing a header that declares gigapixel images.
    max_image_side: int = idx.MAX_IMAGE_SIDE


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
    """The URL of ``stem`` under ``base``: the ``.gz`` file if present, else the raw one; with
    both there, the ``.gz`` one, and a warning that says so (they may differ)."""
    found = [c for c in (_join(base, stem) + ".gz", _join(base, stem)) if _exists(fs, c)]
    if len(found) == 2:
        log.warning(
            "shardflow: warning: %s holds both %s.gz and %s: ingesting %s.gz (remove the one "
            "you do not mean)",
            base,
            stem,
            stem,
            stem,
        )
    return found[0] if found else None


def _exists(fs: fsspec.AbstractFileSystem, url: str) -> bool:
    try:
        # info, not exists: over HTTP fsspec's exists is a GET of the whole file, info a HEAD.
        fs.info(url)
    except OSError:
        # FileNotFoundError; or an HTTP server answering a HEAD for a missing file with an
        # error, not a 404.
        return False
    return True


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


@dataclass(frozen=True, kw_only=True)
class IdxFile:
    """One of the four files, located at its source."""

    stem: str
    url: str
    """The whole URL to fetch (fsspec's paths drop the protocol)."""
    uri: str
    """What the manifest records."""

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


def _locate_all(source: str) -> list[IdxFile]:
    fs, base = _resolve(source)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    located: list[IdxFile] = []
    missing: list[str] = []
    for stem in FILE_STEMS:
        url = _locate(fs, base, stem)
        if url is None:
            missing.append(stem)
        else:
            uri = url if protocol != "file" else "file://" + url
            located.append(IdxFile(stem=stem, url=fs.unstrip_protocol(url), uri=uri))
    if missing:
        raise SourceError(
            f"{source} lacks {', '.join(missing)} (looked for each name raw and with .gz)"
        )
    return located


def fetch_task(
    file: IdxFile,
    work: str,
    cache: str | None,
    num_classes: int,
    expected_md5: str | None,
    md5_decompressed: bool,
    max_side: int = idx.MAX_IMAGE_SIDE,
) -> dict[str, Any]:
    """Fetch one IDX file into the job's folder (through the download cache) and check it
    whole: magic, dimensions (images at most ``max_side`` on a side, no empty dimension), size
    against the header, label range, and the published md5 when the source is a default one.

    A file refused keeps no copy behind: not in the job's folder, not in the download cache."""
    dest = Path(work) / file.name
    recorded = recorded_result(dest)
    if recorded is not None:
        return {**recorded, "reused": True}
    cache_dir = Path(cache) if cache else None
    digest, size = fetch(file.url, dest, cache=cache_dir, progress=task_progress.retries_only)
    try:
        result = _checked_fetch(
            file, dest, Path(work), num_classes, expected_md5, md5_decompressed, max_side
        )
    except ShardflowError as exc:
        # Refused data: the next run fetches it again (its source may be fixed by then).
        dest.unlink(missing_ok=True)
        (Path(work) / file.stem).unlink(missing_ok=True)
        forget([file.url], cache=cache_dir)
        # The checks read the job's copies, which are gone now: name the user's file.
        message = str(exc)
        for copy in (str(dest), str(Path(work) / file.stem)):
            message = message.replace(copy, file.uri.removeprefix("file://"))
        if message == str(exc):
            raise
        raise type(exc)(message) from None
    result.update(sha256=digest, bytes=size)
    record_result(dest, result)
    return result


def _checked_fetch(
    file: IdxFile,
    dest: Path,
    work: Path,
    num_classes: int,
    expected_md5: str | None,
    md5_decompressed: bool,
    max_side: int,
) -> dict[str, Any]:
    """The checks of :func:`fetch_task` on the fetched file; its result but the digest."""
    num_dims = 3 if "images" in file.stem else 1
    copy: dict[str, Any] | None = None
    if idx.is_gzip(dest):
        # Checked while decompressed once, here: the preprocessing's shard writers seek in the
        # copy instead of each inflating the serial gzip stream (or a decode pass doing it).
        copy = idx.decompressed_copy(dest, work / file.stem, num_dims=num_dims, max_side=max_side)
        header = copy.pop("header")
        copy["file"] = file.stem
    else:
        header = idx.inspect(dest, num_dims=num_dims, max_side=max_side)
    if "labels" in file.stem:
        idx.check_labels(work / file.stem if copy else dest, num_classes=num_classes)
    if expected_md5 is not None:
        md5 = _md5(dest, decompressed=md5_decompressed)
        if md5 != expected_md5:
            of = "decompressed" if md5_decompressed else "gz"
            raise SourceError(
                f"{file.name} from the default source has md5 {md5}, expected {expected_md5} "
                f"({of}); the mirror is corrupt"
            )
    result: dict[str, Any] = {
        "stem": file.stem,
        "file": file.name,
        "records": header.count,
        "shape": list(header.shape[1:]),
    }
    if copy is not None:
        result["decompressed"] = copy
    return result


@dataclass(frozen=True, kw_only=True)
class IdxJob:
    """The four IDX files of an image set into a new raw version (a driver Job)."""

    dataset: ImageSet
    source: str
    files: tuple[IdxFile, ...]
    canonical: bool
    """A default source: the published digests are checked."""
    provenance: str
    """"real", or "synthetic" when a SYNTHETIC.json marker lies beside the files."""
    synthetic: Any
    """That marker's JSON (None for real sources)."""
    cache: str | None
    kind: str = "raw"
    passes: tuple[str, ...] = ("fetch",)
    version: None = None

    @property
    def name(self) -> str:
        return self.dataset.name

    @property
    def work_key(self) -> str:
        identity = [stage_code(__name__), self.source, [f.url for f in self.files]]
        return f"{self.name}-idx-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}"

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        return [
            TaskSpec(
                key=f"fetch-{file.stem}",
                fn=fetch_task,
                args=(
                    file,
                    str(work),
                    self.cache,
                    self.dataset.num_classes,
                    self.dataset.known_md5[file.stem] if self.canonical else None,
                    self.dataset.known_md5_of == "decompressed",
                    self.dataset.max_image_side,
                ),
            )
            for file in self.files
        ]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        try:
            self._check_splits({r["stem"]: r for r in done["fetch"]})
        except SourceError:
            # Refused data: the download cache keeps no copy of it.
            self._forget()
            raise
        return self._commit(stage, done, work)

    def _forget(self) -> None:
        forget([file.url for file in self.files], cache=Path(self.cache) if self.cache else None)

    def _check_splits(self, fetched: dict[str, dict[str, Any]]) -> None:
        """Refuse pairs whose counts differ, and splits whose image shapes differ."""
        shapes = {}
        for prefix in ("train", "t10k"):
            images, labels = (
                fetched[f"{prefix}-images-idx3-ubyte"],
                fetched[f"{prefix}-labels-idx1-ubyte"],
            )
            if images["records"] != labels["records"]:
                raise SourceError(
                    f"{images['file']} holds {images['records']} images but {labels['file']} "
                    f"holds {labels['records']} labels"
                )
            shapes[prefix] = tuple(images["shape"])
        if shapes["train"] != shapes["t10k"]:
            raise SourceError(
                f"train images are {shapes['train']}, test images {shapes['t10k']}: "
                "the files are from different datasets"
            )

    def _commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        fetched = {r["stem"]: r for r in done["fetch"]}
        counts = {
            split: int(fetched[f"{prefix}-images-idx3-ubyte"]["records"])
            for split, prefix in (("train", "train"), ("test", "t10k"))
        }
        shapes = {"train": tuple(fetched["train-images-idx3-ubyte"]["shape"])}
        described = {}
        decompressed = {}
        for file in self.files:
            result = fetched[file.stem]
            rows = counts["train" if file.stem.startswith("train") else "test"]
            copies = [(file.name, result)]
            if "decompressed" in result:
                copies.append((result["decompressed"]["file"], result["decompressed"]))
                decompressed[file.stem] = result["decompressed"]["file"]
            for name, made in copies:
                stage.adopt(work / name, name)
                described[name] = described_file(name, {**made, "rows": rows, "row_groups": None})
        manifest: Manifest = stage.commit(
            code_version=stage_code(__name__),
            sources=[
                {
                    "uri": file.uri,
                    "file": file.name,
                    "sha256": fetched[file.stem]["sha256"],
                    "bytes": fetched[file.stem]["bytes"],
                }
                for file in self.files
            ],
            parameters={},
            **IdxLayout(
                image_shape=shapes["train"],
                num_classes=self.dataset.num_classes,
                class_names=tuple(self.dataset.class_names),
                files={file.stem: file.name for file in self.files},
                decompressed=decompressed,
                train_rows=counts["train"],
                test_rows=counts["test"],
                canonical_digests_checked=self.canonical,
                provenance=self.provenance,
                synthetic=self.synthetic,
            ).to_manifest(),
            rows=counts["train"] + counts["test"],
            described=described,
        )
        # The catalog holds the bytes now.
        self._forget()
        return manifest


def plan_ingest(
    dataset_name: str, *, source: str | None = None, cache: Path | None = None
) -> IdxJob:
    """The ingest of the four IDX files of ``dataset_name`` from ``source`` (a directory or an
    fsspec URL), or from the first default source that holds them all (reads listings only).
    With ``cache``, files fetched whole by an interrupted run are not fetched again."""
    dataset = image_set(dataset_name)
    candidates: Sequence[str]
    if source is not None:
        candidates = (source,)
    else:
        candidates = [s for s in dataset.default_sources if "://" in s or os.path.isdir(s)]
    errors: list[str] = []
    for candidate in candidates:
        try:
            files = _locate_all(candidate)
        except SourceError as exc:
            if source is not None:
                raise
            errors.append(str(exc))
            continue
        provenance, marker = _provenance(candidate)
        return IdxJob(
            dataset=dataset,
            source=candidate,
            files=tuple(files),
            canonical=source is None,
            provenance=provenance,
            synthetic=marker,
            cache=str(cache) if cache else None,
        )
    raise SourceError(
        f"no default source of {dataset.name} could be read ({'; '.join(errors)}); "
        "pass --source DIR_OR_URL"
    )


def ingest(
    catalog: Catalog,
    dataset_name: str,
    *,
    source: str | None = None,
    progress: Progress = lambda _msg: None,
    download_cache: Path | None = None,
) -> Manifest:
    """Fetch the four IDX files of ``dataset_name`` into a new raw catalog version, in this
    process (the CLI and the flows run :func:`plan_ingest`'s job on Dask).

    A source that yields exactly the bytes of an existing version gives that version back and
    writes nothing.
    """
    job = plan_ingest(dataset_name, source=source, cache=download_cache)
    return run_job(catalog, job, runner=serial_runner, progress=progress)


def _provenance(source: str) -> tuple[str, Any]:
    """("synthetic", what SYNTHETIC.json beside the files says) when it is there (written by
    `shardflow synth`), else ("real", None)."""
    fs, base = _resolve(source)
    try:
        marker = json.loads(fs.cat_file(_join(base, "SYNTHETIC.json")))
    except (FileNotFoundError, OSError, ValueError):
        return "real", None
    return "synthetic", marker
