"""Raw image versions (MNIST-style IDX, CIFAR-10 batches) → train/validation/test shards.

raw version: IDX files (maybe gzipped) or CIFAR-10 batch files
    │  scan pass, one Dask task per raw file: decode into plain uint8 records (HWC) in the
    │  job's folder, once, so that shard tasks can seek instead of re-reading a gzip stream
    ▼
plan (pure): the training source is hashed by record number into train and validation
(:mod:`preprocessing.splits`), the official test source is the test split; splits → shards →
equal training row groups (:mod:`preprocessing.plan`)
    │  write pass, one Dask task per shard: its records, as Parquet (raw bytes in a binary
    │  column) or as a Petastorm dataset (Unischema, ndarray codec); training shards also
    │  return per-channel sums for the normalisation statistics
    ▼
processed version "<dataset>-processed" (parent: the raw version); the manifest holds the
statistics, each split's plan and the remainder policy
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest, ParentRef, Staging, derived_version, processed_name
from data_catalog.errors import ConfigError, ShardflowError
from data_catalog.layout import (
    IDX_STEMS,
    Cifar10Layout,
    Format,
    IdxLayout,
    ImageSetLayout,
    ProcessedLayout,
    part_folder,
    raw_layout,
)
from preprocessing import schemas, splits
from preprocessing.config import JobOptions
from preprocessing.driver import Result, Results, TaskSpec
from preprocessing.fingerprint import stage_code
from preprocessing.plan import (
    Shard,
    SplitPlan,
    plan_evaluation_split,
    plan_training_split,
    with_equal_groups_remainder,
)
from preprocessing.publish import commit_processed, split_layouts
from preprocessing.raw_files import is_url, local_copy
from preprocessing.shard_files import (
    described,
    partial_path,
    record_result,
    recorded_result,
    write_parquet,
)
from preprocessing.sources import idx
from preprocessing.statistics import normalization_of

# Bumped when the bytes this module writes change for the same input and parameters.
WRITER_VERSION = 4

DEFAULT_VALIDATION_FRACTION = 0.05


@dataclass(frozen=True, kw_only=True)
class RawPart:
    """One raw file (or IDX image/label pair) of a source split, in record order."""

    split: str
    """The source's own split: "train" or "test"."""
    number: int
    kind: str
    """"idx" (gzipped), "idx-plain" (read in place) or "cifar"."""
    paths: tuple[str, ...]
    """idx: (images, labels); cifar: (batch file,)."""
    rows: int
    bytes: int = 0
    """Of its files, from the manifest (for progress)."""

    @property
    def stem(self) -> str:
        return f"inputs/{self.split}-{self.number:03d}"


@dataclass(frozen=True, kw_only=True)
class Decoded:
    """A raw part as plain records: decoded into the job's folder, or an uncompressed IDX
    file of the raw version read in place past its header."""

    images: str
    labels: str
    rows: int
    images_offset: int = 0
    labels_offset: int = 0


def decode_part(part: RawPart, work: str, item_bytes: int) -> Result:
    """Scan task: decode one raw part into ``<stem>.images`` (rows x item_bytes uint8, HWC)
    and ``<stem>.labels`` (rows uint8), each whole or absent; kept if already there."""
    result: Result = {"part": part.number, "split": part.split, "rows": part.rows}
    # Files in an object store are copied into the job's folder: read by seeking or whole.
    paths = tuple(local_copy(p, work) for p in part.paths)
    if part.kind == "idx-plain":
        # Uncompressed IDX: the writers seek in it past the header; nothing to decode.
        image_header = idx.inspect(paths[0], num_dims=3)
        label_header = idx.inspect(paths[1], num_dims=1)
        return {
            **result,
            "images": paths[0],
            "labels": paths[1],
            "images_offset": image_header.offset,
            "labels_offset": label_header.offset,
        }
    images = Path(work) / f"{part.stem}.images"
    labels = Path(work) / f"{part.stem}.labels"
    result.update(images=str(images), labels=str(labels))
    if (
        images.exists()
        and labels.exists()
        and images.stat().st_size == part.rows * item_bytes
        and labels.stat().st_size == part.rows
    ):
        return {**result, "reused": True}
    images.parent.mkdir(parents=True, exist_ok=True)
    partial_images, partial_labels = partial_path(images), partial_path(labels)
    try:
        if part.kind == "idx":
            with open(partial_images, "wb") as out:
                for _start, block in idx.iter_records(paths[0], batch=4096):
                    out.write(block.tobytes())
            partial_labels.write_bytes(idx.read_records(paths[1]).tobytes())
        else:
            from preprocessing.sources.cifar10 import read_batch

            batch_labels, batch_images = read_batch(Path(paths[0]))
            partial_images.write_bytes(batch_images.tobytes())
            partial_labels.write_bytes(batch_labels.tobytes())
        for partial, final in ((partial_images, images), (partial_labels, labels)):
            expected = part.rows * item_bytes if final is images else part.rows
            if partial.stat().st_size != expected:
                raise ShardflowError(f"{part.paths[0]}: decoded size differs from the catalog's")
            os.replace(partial, final)
    finally:
        partial_images.unlink(missing_ok=True)
        partial_labels.unlink(missing_ok=True)
    return result


def split_records(
    source_rows: int, fractions: dict[str, float], split: str
) -> npt.NDArray[np.int64]:
    """Record numbers (in the source split) of the samples hashed into ``split``.

    A sample's id is its record number in its source split: stable as long as the raw
    version is, and hashed alone, so it always lands in the same split.
    """
    if set(fractions) == {split}:
        return np.arange(source_rows, dtype=np.int64)
    hashes = splits.sample_hash(np.arange(source_rows, dtype=np.uint64))
    chosen: npt.NDArray[np.int64] = np.flatnonzero(splits.select(hashes, fractions, split))
    return chosen.astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class ShardTask:
    """Everything a write task needs (picklable, small)."""

    shard: Shard
    parts: tuple[Decoded, ...]
    """The source split's decoded parts, in record order."""
    fractions: dict[str, float]
    """How the source split is hashed into splits (the shard's split is one of them)."""
    source_rows: int
    image_shape: tuple[int, ...]
    """(rows, cols, channels)."""
    format: str
    out_dir: str


def _records(task: ShardTask) -> npt.NDArray[np.int64]:
    chosen = split_records(task.source_rows, task.fractions, task.shard.split)
    positions = np.arange(task.shard.start, task.shard.start + task.shard.rows) % len(chosen)
    records: npt.NDArray[np.int64] = chosen[positions]  # "pad": positions wrap to the start
    return records


def _gather(task: ShardTask, records: npt.NDArray[np.int64]) -> tuple[Any, Any]:
    """(images n x item uint8, labels n) of ``records``, read by seeking in the parts."""
    item = int(np.prod(task.image_shape))
    images = np.empty((len(records), item), dtype=np.uint8)
    labels = np.empty(len(records), dtype=np.uint8)
    first = 0
    for part in task.parts:
        inside = (records >= first) & (records < first + part.rows)
        if inside.any():
            local = records[inside] - first
            pixels = np.memmap(
                part.images,
                dtype=np.uint8,
                mode="r",
                offset=part.images_offset,
                shape=(part.rows, item),
            )
            images[inside] = pixels[local]
            all_labels = np.memmap(
                part.labels, dtype=np.uint8, mode="r", offset=part.labels_offset, shape=part.rows
            )
            labels[inside] = all_labels[local]
            del pixels, all_labels
        first += part.rows
    return images, labels


def channel_sums(images: npt.NDArray[np.uint8], channels: int) -> Result:
    """Count, sum and sum of squares of pixel/255 per channel, to be combined.

    Summed as integers (exact: each shard's figures are the same on every run, and no float
    copy of every pixel is made), then scaled.
    """
    pixels = images.reshape(-1, channels)
    sums = pixels.sum(axis=0, dtype=np.uint64)
    # einsum casts in small buffers: no widened copy of every pixel (page faults cost more
    # than the arithmetic here).
    sumsq = np.einsum("ij,ij->j", pixels, pixels, dtype=np.uint64)
    return {
        "count": int(pixels.shape[0]),
        "sum": [int(s) / 255.0 for s in sums],
        "sumsq": [int(s) / 255.0**2 for s in sumsq],
    }


def write_shard(task: ShardTask) -> Result:
    """Write task: one shard's rows with row groups of equal size, unless a run of the same
    job already wrote it whole; training shards return their channel sums either way."""
    shard = task.shard
    path = Path(task.out_dir) / shard.path
    recorded = recorded_result(path)
    if recorded is not None:
        return {**recorded, "reused": True}
    records = _records(task)
    images, labels = _gather(task, records)
    result: Result = {"path": shard.path, "split": shard.split}
    if shard.split == "train":
        result["sums"] = channel_sums(images, task.image_shape[-1])
    if task.format == "petastorm":
        image_column = pa.array(
            [schemas.encode_image(task.image_shape, image) for image in images],
            type=pa.binary(),
        )
    else:
        # One contiguous buffer + offsets: the binary column without a Python object per image.
        item = images.shape[1]
        offsets = pa.array(range(0, (len(records) + 1) * item, item), type=pa.int32())
        image_column = pa.BinaryArray.from_buffers(
            pa.binary(), len(records), [None, offsets.buffers()[1], pa.py_buffer(images)]
        )
    table = pa.Table.from_arrays(
        [pa.array(records, type=pa.int64()), image_column, pa.array(labels.astype(np.int64))],
        schema=schemas.IMAGE_SCHEMA,
    )
    result.update(write_parquet(table, path, row_group_size=shard.rows_per_group))
    record_result(path, result)
    return result


def write_petastorm_metadata(
    path: Path, image_shape: Sequence[int], row_groups: dict[str, int]
) -> None:
    """A split's ``_common_metadata`` at ``path``, as petastorm's ``materialize_dataset``
    writes it (the pickled Unischema and each file's row-group count, from the writers'
    results) without needing Spark."""
    from petastorm.etl.dataset_metadata import ROW_GROUPS_PER_FILE_KEY, UNISCHEMA_KEY

    arrow_schema = schemas.IMAGE_SCHEMA.with_metadata(
        {
            UNISCHEMA_KEY: pickle.dumps(schemas.image_unischema(image_shape)),
            ROW_GROUPS_PER_FILE_KEY: json.dumps(row_groups, sort_keys=True).encode(),
        }
    )
    pq.write_metadata(arrow_schema, path)


@dataclass(frozen=True, kw_only=True)
class ImageJob:
    """A planned preprocessing run of one raw image version (an :class:`engine.Job`)."""

    raw: Manifest
    source: ImageSetLayout
    """What the raw version's ingest recorded of it."""
    name: str
    version: str
    parents: tuple[ParentRef, ...]
    parameters: dict[str, Any]
    parts: tuple[RawPart, ...]
    image_shape: tuple[int, ...]
    format: str
    fractions: dict[str, dict[str, float]]
    """Per source split, its hash fractions (the train source feeds train and validation)."""
    plans: tuple[SplitPlan, ...]
    source_of: dict[str, str]
    """The source split of each output split."""

    kind: str = "processed"

    @property
    def passes(self) -> tuple[str, ...]:
        # Uncompressed IDX on a local (or mounted) filesystem needs no decoding: its shards
        # are written straight from it. In an object store its files are copied first.
        if all(
            part.kind == "idx-plain" and not any(is_url(p) for p in part.paths)
            for part in self.parts
        ):
            return ("write",)
        return ("decode", "write")

    @property
    def work_key(self) -> str:
        return f"{self.name}-{self.version}"

    def tasks(self, pass_name: str, done: Results, work: Path) -> list[TaskSpec]:
        if pass_name == "decode":
            return self._decode_tasks(work)
        if "decode" not in done:
            # Where each uncompressed IDX file's records start: its header, read here.
            return self._write_tasks([decode_part(p, str(work), 0) for p in self.parts], work)
        return self._write_tasks(done["decode"], work)

    @property
    def shards(self) -> list[Shard]:
        return [shard for plan in self.plans for shard in plan.shards]

    @property
    def rows(self) -> int:
        return sum(plan.rows for plan in self.plans)

    @property
    def item_bytes(self) -> int:
        return int(np.prod(self.image_shape))

    def _decode_tasks(self, work: Path) -> list[TaskSpec]:
        return [
            TaskSpec(
                key=f"decode-{part.split}-{part.number:03d}",
                fn=decode_part,
                args=(part, str(work), self.item_bytes),
                rows=part.rows,
                bytes=part.bytes,
            )
            for part in self.parts
        ]

    def _write_tasks(self, scans: Sequence[Result], work: Path) -> list[TaskSpec]:
        decoded: dict[str, list[Decoded]] = {}
        for result in sorted(scans, key=lambda r: (r["split"], r["part"])):
            decoded.setdefault(result["split"], []).append(
                Decoded(
                    images=result["images"],
                    labels=result["labels"],
                    rows=result["rows"],
                    images_offset=int(result.get("images_offset", 0)),
                    labels_offset=int(result.get("labels_offset", 0)),
                )
            )
        tasks = []
        for shard in self.shards:
            source = self.source_of[shard.split]
            task = ShardTask(
                shard=shard,
                parts=tuple(decoded[source]),
                fractions=self.fractions[source],
                source_rows=sum(d.rows for d in decoded[source]),
                image_shape=self.image_shape,
                format=self.format,
                out_dir=str(work / "out"),
            )
            tasks.append(
                TaskSpec(
                    key=f"write-{shard.split}-{shard.index:05d}",
                    fn=write_shard,
                    args=(task,),
                    rows=shard.rows,
                )
            )
        return tasks

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        written = done["write"]
        expected = {shard.path for shard in self.shards}
        missing = expected - {str(r["path"]) for r in written}
        if missing:
            raise ShardflowError(f"{len(missing)} shards were not written, e.g. {min(missing)}")
        out = work / "out"
        files = {str(r["path"]): r for r in written}
        for relpath in sorted(files):
            stage.adopt(out / relpath, relpath)
        if self.format == "petastorm":
            for plan in self.plans:
                row_groups = {
                    PurePosixPath(path).name: int(r["row_groups"])
                    for path, r in files.items()
                    if path.startswith(f"{part_folder(plan.split)}/")
                }
                metadata = stage.path / part_folder(plan.split) / "_common_metadata"
                write_petastorm_metadata(metadata, self.image_shape, row_groups)
        train_sums = [
            r["sums"] for r in sorted(written, key=lambda r: str(r["path"])) if "sums" in r
        ]
        layout = ProcessedLayout(
            kind="images",
            format=cast(Format, self.format),  # one of FORMATS (JobOptions checked it)
            arrow_schema=schemas.IMAGE_SCHEMA.to_string(),
            columns=schemas.IMAGE_COLUMNS,
            image_shape=self.source.image_shape,
            unischema=(
                str(schemas.image_unischema(self.image_shape))
                if self.format == "petastorm"
                else None
            ),
            label_column="label",
            num_classes=self.source.num_classes,
            class_names=self.source.class_names,
            split_by="hash of the record number in the source split "
            "(preprocessing.splits.sample_hash)",
            split_fractions=self.fractions,
            splits=split_layouts(self.plans),
            normalization=normalization_of(train_sums, "train split, pixel / 255, per channel"),
            rows_in=int(self.raw.rows),
        )
        return commit_processed(
            stage,
            code=stage_code(__name__),
            layout=layout,
            parents=self.parents,
            parameters=self.parameters,
            # The shards were hashed and counted by the tasks that wrote them.
            described={relpath: described(relpath, result) for relpath, result in files.items()},
        )


def image_source(raw: Manifest) -> ImageSetLayout:
    """The layout of a raw image set (IDX files or CIFAR-10 batches)."""
    source = raw_layout(raw)
    if not isinstance(source, IdxLayout | Cifar10Layout):
        raise ShardflowError(
            f"{raw.name}@{raw.version}: raw format {source.format!r} is not an image set "
            "shardflow can preprocess (IDX or CIFAR-10 batches)"
        )
    return source


def _parts(
    catalog: Catalog, raw: Manifest, source: ImageSetLayout
) -> tuple[list[RawPart], tuple[int, ...]]:
    path_of = {e.path: catalog.file_url(raw, e) for e in raw.files}
    size_of = {catalog.file_url(raw, e): e.bytes for e in raw.files}
    if isinstance(source, IdxLayout):
        # The uncompressed copies the ingest made beside gzipped files, where there are any.
        files = {**source.files, **source.decompressed}
        parts = []
        for split, stems in IDX_STEMS.items():
            paths = tuple(path_of[files[stem]] for stem in stems)
            plain = all(stem in source.decompressed for stem in stems) or (
                not any(is_url(p) or idx.is_gzip(p) for p in paths)
            )
            parts.append(
                RawPart(
                    split=split,
                    number=0,
                    kind="idx-plain" if plain else "idx",
                    paths=paths,
                    rows=source.train_rows if split == "train" else source.test_rows,
                    bytes=sum(size_of[p] for p in paths),
                )
            )
        return parts, source.pixel_shape
    parts = []
    for split, names in (("train", source.train_files), ("test", source.test_files)):
        for number, name in enumerate(names):
            entry = next(e for e in raw.files if e.path == name)
            if entry.rows is None:
                raise ShardflowError(f"{raw.name}@{raw.version}: {name} has no row count")
            parts.append(
                RawPart(
                    split=split,
                    number=number,
                    kind="cifar",
                    paths=(path_of[entry.path],),
                    rows=entry.rows,
                    bytes=entry.bytes,
                )
            )
    return parts, source.pixel_shape


def plan_job(catalog: Catalog, raw: Manifest, options: JobOptions) -> ImageJob:
    """Plan the processing of the raw image version ``raw`` (reads manifests only)."""
    source = image_source(raw)
    parts, image_shape = _parts(catalog, raw, source)
    output_format = options.format or "parquet"
    validation = (
        DEFAULT_VALIDATION_FRACTION
        if options.validation_fraction is None
        else options.validation_fraction
    )
    if options.redshift_feature:
        raise ConfigError("redshift_feature", f"is for sdss; {raw.name} holds images")
    if options.test_fraction:
        raise ConfigError(
            "test_fraction",
            f"is for sources without an official test split, and {raw.name} has one",
        )
    train_fractions = {"train": 1.0 - validation, "validation": validation}
    if validation == 0:
        train_fractions = {"train": 1.0}
    fractions = {"train": train_fractions, "test": {"test": 1.0}}
    source_rows = {
        split: sum(p.rows for p in parts if p.split == split) for split in ("train", "test")
    }
    config = with_equal_groups_remainder(options.plan, raw.name)
    plans = [
        plan_training_split(
            "train", len(split_records(source_rows["train"], train_fractions, "train")), config
        )
    ]
    if validation:
        plans.append(
            plan_evaluation_split(
                "validation",
                len(split_records(source_rows["train"], train_fractions, "validation")),
                config,
            )
        )
    plans.append(plan_evaluation_split("test", source_rows["test"], config))
    name = processed_name(raw.name)
    parents = (raw.ref,)
    parameters = {
        "plan": asdict(config),
        "format": output_format,
        "split_fractions": fractions,
        "writer_version": WRITER_VERSION,
    }
    return ImageJob(
        raw=raw,
        source=source,
        name=name,
        version=derived_version(
            name=name,
            kind="processed",
            parents=parents,
            parameters=parameters,
            code=stage_code(__name__),
        ),
        parents=parents,
        parameters=parameters,
        parts=tuple(parts),
        image_shape=image_shape,
        format=output_format,
        fractions=fractions,
        plans=tuple(plans),
        source_of={"train": "train", "validation": "train", "test": "test"},
    )
