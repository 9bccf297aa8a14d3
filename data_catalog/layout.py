"""Typed, versioned layouts: what a manifest's ``schema`` and ``statistics`` say of its data.

```
ingest (preprocessing.sources)     preprocessing (images.py, sdss.py)    training, verify, reports
IdxLayout, Cifar10Layout,  ─raw─►  raw_layout(raw): the source's  ─processed─► ProcessedLayout.of()
ExportsLayout, SkyServerLayout     files, shape, classes, counts          .splits["train"]:
  .to_manifest()                   ProcessedLayout(...).to_manifest()     rows_per_group, ...
```

A layout is written by ``to_manifest()`` into the manifest's ``schema`` and ``statistics``
under the keys manifests have always used, plus ``schema.layout_version``; it is read back by
one parser per layout, ``of(manifest)``, which refuses a layout version it does not know and
names the first missing or garbled field (``statistics.train.rows_per_group is missing``).
There are no defaults for missing fields: a renamed key is an error, not a zero. A manifest
written before manifests carried ``layout_version`` is read as version 1, the layout it holds.

``schema`` and ``statistics`` are not part of a version's identity (data_catalog.identity), so
typing them changed no version id; README.md in this folder has the table of every field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, TypeVar, cast

from data_catalog.errors import CatalogError
from data_catalog.manifest import FileEntry, Manifest

LAYOUT_VERSION = 1
"""The layout version this code writes and reads. Manifests without ``schema.layout_version``
were written before it existed and hold version 1."""

FOLDER_LAYOUT = 2
"""The layout of a version folder this code writes. 2: each split in a hive folder
``split=<name>/``, the quarantine in ``_quarantine/``, incremental state in ``_state/`` and the
manifest as ``_manifest.json``, so that a Parquet reader pointed at the folder (pyarrow, Spark,
dask, DuckDB and Polars with a ``split=*`` glob) reads the splits and nothing else, with a
``split`` column. 1 (versions written before): ``<name>/``, ``quarantine/``, ``manifest.json``;
still read, verified and trained on. Part of the identity of every dataset version
(preprocessing.fingerprint), so a version in the new layout never takes an old one's id."""
QUARANTINE = "quarantine"
"""The part of a tabular version that holds the rows set aside (another schema)."""
FOLDER_LAYOUTS = (1, 2)

KINDS = ("images", "tabular")
FORMATS = ("parquet", "petastorm")
SPLIT_NAMES = ("train", "validation", "test")
SPLIT_POLICIES = ("drop", "pad", "whole")
"""How a split's rows were cut: "drop" and "pad" (image training splits) into equal row groups,
the rows that do not fill them dropped or the split padded with its first rows; "whole"
(evaluation splits, SDSS training splits): every row once, each file's last row group possibly
shorter."""
EQUAL_GROUP_POLICIES = ("drop", "pad")
IMAGE_LABEL_COLUMN = "label"
"""The label column of every image layout (not recorded in image manifests: always this)."""
PROVENANCES = ("real", "synthetic")
CIFAR10_BATCH_FORMATS = ("binary", "python")
IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
"""The (images, labels) IDX files of each source split, by the stems MNIST publishes."""

Kind = Literal["images", "tabular"]
Format = Literal["parquet", "petastorm"]
SplitFractions = dict[str, float] | dict[str, dict[str, float]]

T = TypeVar("T")


class LayoutError(CatalogError):
    """A manifest whose schema or statistics do not hold the layout its layout_version
    promises: a field missing, of the wrong type, or out of range."""


class ManifestFields(TypedDict):
    """What a layout writes: the ``schema`` and ``statistics`` of ``Staging.commit``."""

    schema: dict[str, Any]
    statistics: dict[str, Any]


def part_folder(part: str, folder_layout: int = FOLDER_LAYOUT) -> str:
    """The folder of ``part`` (a split name, or :data:`QUARANTINE`) in a version folder of
    ``folder_layout``: ``split=train``, ``_quarantine`` (layout 1: ``train``, ``quarantine``)."""
    if folder_layout == 1:
        return part
    return f"_{part}" if part == QUARANTINE else f"split={part}"


def version_file(part: str, filename: str) -> str:
    """The path, relative to the version folder, of ``filename`` of ``part`` (a split or
    :data:`QUARANTINE`) in a version written now: every writer names its files through this."""
    return f"{part_folder(part)}/{filename}"


# ---------------------------------------------------------------------------------------------
# Processed versions


@dataclass(frozen=True, kw_only=True)
class SplitLayout:
    """One split of a processed version (``statistics.<split>``): its rows and how they are cut
    into files and row groups. Training ranks plan their steps from it."""

    rows: int
    """Rows written, padding included."""
    source_rows: int
    """Rows of the source that fell in this split."""
    rows_per_group: int
    """Rows in every row group ("drop", "pad"), or in every row group but each file's last,
    which holds no more ("whole")."""
    num_row_groups: int
    """Row groups over all the split's files."""
    num_shards: int
    """Files (``<split>/part-NNNNN.parquet``)."""
    dropped_rows: int
    """Source rows left out so that the row groups are equal ("drop")."""
    padded_rows: int
    """First rows written a second time so that the row groups are equal ("pad")."""
    policy: str
    """One of :data:`SPLIT_POLICIES`."""

    def __post_init__(self) -> None:
        for name in ("rows", "source_rows", "num_row_groups", "num_shards", "dropped_rows"):
            _require_count(name, getattr(self, name))
        _require_count("padded_rows", self.padded_rows)
        _require_count("rows_per_group", self.rows_per_group, minimum=1)
        _require_choice("policy", self.policy, SPLIT_POLICIES)

    @property
    def equal_row_groups(self) -> bool:
        """Whether every row group holds ``rows_per_group`` rows (a training split)."""
        return self.policy in EQUAL_GROUP_POLICIES

    def to_manifest(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "source_rows": self.source_rows,
            "dropped_rows": self.dropped_rows,
            "padded_rows": self.padded_rows,
            "rows_per_group": self.rows_per_group,
            "num_row_groups": self.num_row_groups,
            "num_shards": self.num_shards,
            "policy": self.policy,
        }

    @classmethod
    def _read(cls, fields: _Fields) -> SplitLayout:
        return fields.build(
            cls,
            rows=fields.integer("rows"),
            source_rows=fields.integer("source_rows"),
            dropped_rows=fields.integer("dropped_rows"),
            padded_rows=fields.integer("padded_rows"),
            rows_per_group=fields.integer("rows_per_group"),
            num_row_groups=fields.integer("num_row_groups"),
            num_shards=fields.integer("num_shards"),
            policy=fields.text("policy"),
        )


@dataclass(frozen=True, kw_only=True)
class Normalization:
    """Mean and standard deviation of the training split (``statistics.normalization``): per
    channel of pixel / 255 for images, per feature (in ``feature_columns`` order) for tables."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    over: str
    """What the figures are over, in words."""

    def __post_init__(self) -> None:
        if not self.mean:
            raise LayoutError("mean is empty")
        if len(self.std) != len(self.mean):
            raise LayoutError(f"std has {len(self.std)} values, mean {len(self.mean)}")
        for i, value in enumerate(self.std):
            if value < 0:
                raise LayoutError(f"std[{i}] is {value!r}, below 0")

    def to_manifest(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "over": self.over}

    @classmethod
    def _read(cls, fields: _Fields) -> Normalization:
        return fields.build(
            cls,
            mean=fields.numbers("mean"),
            std=fields.numbers("std"),
            over=fields.text("over"),
        )


@dataclass(frozen=True, kw_only=True)
class Quarantine:
    """The rows a tabular job set aside (``statistics.quarantine``, ``schema.quarantine``)."""

    rows: int
    reasons: dict[str, int]
    """Rows per reason (the first check each row failed)."""
    files: int
    """Files under ``quarantine/``."""
    contents: str
    """What the quarantine files hold, in words (``schema.quarantine``)."""

    def __post_init__(self) -> None:
        _require_count("rows", self.rows)
        _require_count("files", self.files)
        for reason, count in self.reasons.items():
            _require_count(f"reasons[{reason!r}]", count)

    def to_statistics(self) -> dict[str, Any]:
        return {"rows": self.rows, "reasons": dict(self.reasons), "files": self.files}


@dataclass(frozen=True, kw_only=True)
class ProcessedLayout:
    """What a processed version holds and how, as preprocessing wrote it and training reads it.

    Images (``kind="images"``) have an ``image_shape`` and no ``feature_columns``; tables
    (``kind="tabular"``) the reverse, and a :class:`Quarantine`. Petastorm output has its
    Unischema recorded as text.
    """

    layout_version: int = LAYOUT_VERSION
    kind: Kind
    format: Format
    """"parquet" (petastorm's make_batch_reader) or "petastorm" (make_reader, a Unischema)."""
    arrow_schema: str
    """The Arrow schema of every file, as text."""
    columns: tuple[str, ...]
    image_shape: tuple[int, ...] | None = None
    """Images: (rows, cols) or (rows, cols, channels), as the raw version recorded it."""
    unischema: str | None = None
    """Petastorm output: its Unischema, as text."""
    feature_columns: tuple[str, ...] | None = None
    """Tables: the model's inputs, in order."""
    label_column: str
    num_classes: int
    class_names: tuple[str, ...]
    split_by: str
    """How a sample's split is chosen, in words."""
    split_fractions: SplitFractions
    """The hash fractions: ``{split: fraction}`` for tables (one source), ``{source split:
    {split: fraction}}`` for images (the source's train split feeds train and validation)."""
    splits: dict[str, SplitLayout]
    """Each split in its folder (:meth:`folder`); there is always a "train" split."""
    normalization: Normalization
    quarantine: Quarantine | None = None
    """Tables: the rows set aside; None for images."""
    rows_in: int
    """Rows read from the raw version (tables: the splits' source rows + rows quarantined)."""
    folder_layout: int = FOLDER_LAYOUT
    """How the version's folder is laid out (:data:`FOLDER_LAYOUT`), as ``schema.splits``
    records each split's folder."""

    def __post_init__(self) -> None:
        if self.layout_version != LAYOUT_VERSION:
            raise LayoutError(
                f"schema.layout_version is {self.layout_version!r}; this shardflow writes "
                f"{LAYOUT_VERSION}"
            )
        _require_choice("schema.kind", self.kind, KINDS)
        _require_choice("schema.format", self.format, FORMATS)
        if self.folder_layout not in FOLDER_LAYOUTS:
            raise LayoutError(f"folder layout {self.folder_layout!r} is none of {FOLDER_LAYOUTS}")
        _require_count("schema.num_classes", self.num_classes, minimum=1)
        _require_count("statistics.rows_in", self.rows_in)
        if len(self.class_names) != self.num_classes:
            raise LayoutError(
                f"schema.class_names has {len(self.class_names)} names for "
                f"schema.num_classes {self.num_classes}"
            )
        if self.label_column not in self.columns:
            raise LayoutError(f"schema.columns lack the label column {self.label_column!r}")
        if "train" not in self.splits:
            raise LayoutError("schema.splits has no train split")
        for name in self.splits:
            _require_choice("schema.splits", name, SPLIT_NAMES)
        if self.kind == "images":
            self._check_images()
        else:
            self._check_tabular()

    def _check_images(self) -> None:
        if self.image_shape is None:
            raise LayoutError("schema.image_shape is missing: an images layout has one")
        _require_image_shape("schema.image_shape", self.image_shape)
        if self.feature_columns is not None:
            raise LayoutError("schema.feature_columns is set: an images layout has none")
        if self.quarantine is not None:
            raise LayoutError("statistics.quarantine is set: an images layout has none")
        if self.label_column != IMAGE_LABEL_COLUMN:
            raise LayoutError(
                f"label_column is {self.label_column!r}: images are labelled in "
                f"{IMAGE_LABEL_COLUMN!r}"
            )
        if (self.format == "petastorm") != (self.unischema is not None):
            raise LayoutError("schema.unischema is recorded for petastorm output, and only then")
        channels = self.pixel_shape[-1]
        if len(self.normalization.mean) != channels:
            raise LayoutError(
                f"statistics.normalization.mean has {len(self.normalization.mean)} values, "
                f"expected one per channel ({channels})"
            )

    def _check_tabular(self) -> None:
        if self.feature_columns is None:
            raise LayoutError("schema.feature_columns is missing: a tabular layout has them")
        for name, value in (("image_shape", self.image_shape), ("unischema", self.unischema)):
            if value is not None:
                raise LayoutError(f"schema.{name} is set: a tabular layout has none")
        if self.format != "parquet":
            raise LayoutError(f"schema.format is {self.format!r}: tabular layouts are parquet")
        if self.quarantine is None:
            raise LayoutError("statistics.quarantine is missing: a tabular layout has one")
        unknown = [c for c in self.feature_columns if c not in self.columns]
        if unknown:
            raise LayoutError(f"schema.feature_columns {unknown} are not in schema.columns")
        if len(self.normalization.mean) != len(self.feature_columns):
            raise LayoutError(
                f"statistics.normalization.mean has {len(self.normalization.mean)} values, "
                f"expected one per feature column ({len(self.feature_columns)})"
            )

    @property
    def train(self) -> SplitLayout:
        """The training split, which ranks read row group by row group: equal groups (image
        sets), or groups of ``rows_per_group`` rows but each file's last (SDSS, policy
        "whole": every row kept, one file per raw piece)."""
        return self.splits["train"]

    @property
    def rows(self) -> int:
        """Rows written over every split (the manifest's ``rows``)."""
        return sum(split.rows for split in self.splits.values())

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        """(rows, cols, channels) of an image (one channel when ``image_shape`` has two
        dimensions); () for tables."""
        return pixel_shape(self.image_shape) if self.image_shape is not None else ()

    def folder(self, split: str) -> str:
        """The folder of ``split`` in the version (``split=train``; ``train`` in layout 1)."""
        return part_folder(split, self.folder_layout)

    def split_entries(self, manifest: Manifest, split: str) -> list[FileEntry]:
        """The manifest's Parquet files of ``split``'s folder (not its ``_common_metadata``),
        in path order: the order petastorm reads them in and the ranks' row groups follow."""
        prefix = f"{self.folder(split)}/"
        return sorted(
            (
                e
                for e in manifest.files
                if e.path.startswith(prefix)
                and e.path.endswith(".parquet")
                and "/" not in e.path[len(prefix) :]
            ),
            key=lambda e: e.path,
        )

    def to_manifest(self) -> ManifestFields:
        """The manifest's ``schema`` and ``statistics`` of this layout (the keys of every
        layout version 1 manifest, plus ``schema.layout_version``)."""
        schema: dict[str, Any] = {
            "layout_version": self.layout_version,
            "format": self.format,
            "kind": self.kind,
            "arrow_schema": self.arrow_schema,
            "columns": list(self.columns),
            "num_classes": self.num_classes,
            "class_names": list(self.class_names),
            "splits": {name: self.folder(name) for name in self.splits},
            "split_by": self.split_by,
            "split_fractions": self.split_fractions,
        }
        statistics: dict[str, Any] = {
            name: split.to_manifest() for name, split in self.splits.items()
        }
        statistics["normalization"] = self.normalization.to_manifest()
        statistics["rows_in"] = self.rows_in
        if self.image_shape is not None:
            schema["image_shape"] = list(self.image_shape)
        if self.unischema is not None:
            schema["unischema"] = self.unischema
        if self.feature_columns is not None:
            schema["feature_columns"] = list(self.feature_columns)
            schema["label_column"] = self.label_column
        if self.quarantine is not None:
            schema["quarantine"] = self.quarantine.contents
            statistics["quarantine"] = self.quarantine.to_statistics()
        if self.kind == "tabular":
            # Tabular manifests have always repeated the class names among the statistics.
            statistics["class_names"] = list(self.class_names)
        return {"schema": schema, "statistics": statistics}

    @classmethod
    def of(cls, manifest: Manifest) -> ProcessedLayout:
        """The layout of a processed version; :class:`LayoutError` naming the layout version
        and the first missing or garbled field."""
        if manifest.kind != "processed":
            raise LayoutError(f"{manifest.ref} is a {manifest.kind} version, not a processed one")
        version = _layout_version(manifest, "processed")
        where = f"{manifest.ref} (processed layout {version})"
        schema = _Fields(manifest.schema, "schema", where)
        statistics = _Fields(manifest.statistics, "statistics", where)
        kind = schema.text("kind")
        _require_choice_in(where, "schema.kind", kind, KINDS)
        folders = schema.text_map("splits")
        folder_layout = _folder_layout(where, folders)
        splits = {
            name: SplitLayout._read(statistics.child(name))
            for name in (*SPLIT_NAMES, *sorted(set(folders) - set(SPLIT_NAMES)))
            if name in folders
        }
        images = kind == "images"
        fmt = schema.text("format")
        quarantine = None
        if not images:
            counts = statistics.child("quarantine")
            quarantine = counts.build(
                Quarantine,
                rows=counts.integer("rows"),
                reasons=counts.integer_map("reasons"),
                files=counts.integer("files"),
                contents=schema.text("quarantine"),
            )
        return schema.build(
            cls,
            prefix="",
            layout_version=version,
            kind=cast(Kind, kind),
            format=cast(Format, fmt),
            arrow_schema=schema.text("arrow_schema"),
            columns=schema.texts("columns"),
            image_shape=schema.integers("image_shape") if images else None,
            unischema=schema.text("unischema") if images and fmt == "petastorm" else None,
            feature_columns=None if images else schema.texts("feature_columns"),
            label_column=IMAGE_LABEL_COLUMN if images else schema.text("label_column"),
            num_classes=schema.integer("num_classes"),
            class_names=schema.texts("class_names"),
            split_by=schema.text("split_by"),
            split_fractions=(
                schema.nested_number_map("split_fractions")
                if images
                else schema.number_map("split_fractions")
            ),
            splits=splits,
            normalization=Normalization._read(statistics.child("normalization")),
            quarantine=quarantine,
            rows_in=statistics.integer("rows_in"),
            folder_layout=folder_layout,
        )


def _folder_layout(where: str, folders: dict[str, str]) -> int:
    """The folder layout ``schema.splits`` records: every split in ``split=<name>`` (2) or
    every split in ``<name>`` (1)."""
    for layout in sorted(FOLDER_LAYOUTS, reverse=True):
        if all(folder == part_folder(name, layout) for name, folder in folders.items()):
            return layout
    name, folder = next((n, f) for n, f in folders.items() if f != part_folder(n))
    raise LayoutError(
        f"{where}: schema.splits.{name} is {folder!r}; a split's folder is split={name} "
        f"(or {name}, in versions written before), the same for every split"
    )


def pixel_shape(image_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(rows, cols, channels) of an image shape recorded as (rows, cols) or as that."""
    return (*image_shape, 1) if len(image_shape) == 2 else image_shape


# ---------------------------------------------------------------------------------------------
# Raw versions


@dataclass(frozen=True, kw_only=True)
class IdxLayout:
    """A raw image set as MNIST's four IDX files (preprocessing.sources.mnist)."""

    layout_version: int = LAYOUT_VERSION
    image_shape: tuple[int, ...]
    """(rows, cols) as the IDX header gives it."""
    num_classes: int
    class_names: tuple[str, ...]
    files: dict[str, str]
    """Each of :data:`IDX_STEMS`' stems -> its file in the version, as fetched (maybe gzipped)."""
    decompressed: dict[str, str]
    """Stem -> an uncompressed copy beside a gzipped file, where the ingest made one. Ingests
    before copies were made (November 2026) recorded no such field: read as none."""
    train_rows: int
    test_rows: int
    canonical_digests_checked: bool
    """Whether the files were checked against the published digests (the default sources)."""
    provenance: str
    """"real", or "synthetic" (made by ``shardflow synth``)."""
    synthetic: Any = None
    """Synthetic sets: their SYNTHETIC.json marker, as JSON (recorded for them only)."""

    def __post_init__(self) -> None:
        _check_layout_version(self.layout_version)
        _require_image_shape("schema.image_shape", self.image_shape)
        _check_classes(self.num_classes, self.class_names)
        missing = [stem for pair in IDX_STEMS.values() for stem in pair if stem not in self.files]
        if missing:
            raise LayoutError(f"schema.files lacks {', '.join(missing)}")
        _require_count("statistics.train_rows", self.train_rows)
        _require_count("statistics.test_rows", self.test_rows)
        _check_provenance(self.provenance, self.synthetic)

    @property
    def format(self) -> str:
        """``schema.format``."""
        return "idx"

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return pixel_shape(self.image_shape)

    def to_manifest(self) -> ManifestFields:
        statistics: dict[str, Any] = {
            "train_rows": self.train_rows,
            "test_rows": self.test_rows,
            "canonical_digests_checked": self.canonical_digests_checked,
            "provenance": self.provenance,
        }
        if self.provenance == "synthetic":
            statistics["synthetic"] = self.synthetic
        return {
            "schema": {
                "layout_version": self.layout_version,
                "format": self.format,
                "image_shape": list(self.image_shape),
                "num_classes": self.num_classes,
                "class_names": list(self.class_names),
                "files": dict(self.files),
                # The same data without gzip, beside the fetched bytes (which stay exact).
                "decompressed": dict(self.decompressed),
            },
            "statistics": statistics,
        }

    @classmethod
    def of(cls, manifest: Manifest) -> IdxLayout:
        version, schema, statistics = _raw_fields(manifest, "idx")
        provenance = statistics.text("provenance")
        return schema.build(
            cls,
            prefix="",
            layout_version=version,
            image_shape=schema.integers("image_shape"),
            num_classes=schema.integer("num_classes"),
            class_names=schema.texts("class_names"),
            files=schema.text_map("files"),
            decompressed=schema.text_map("decompressed") if schema.has("decompressed") else {},
            train_rows=statistics.integer("train_rows"),
            test_rows=statistics.integer("test_rows"),
            canonical_digests_checked=statistics.boolean("canonical_digests_checked"),
            provenance=provenance,
            synthetic=statistics.value("synthetic") if provenance == "synthetic" else None,
        )


@dataclass(frozen=True, kw_only=True)
class Cifar10Layout:
    """A raw image set as CIFAR-10's batch files (preprocessing.sources.cifar10)."""

    layout_version: int = LAYOUT_VERSION
    batch_format: str
    """One of :data:`CIFAR10_BATCH_FORMATS` (``schema.format`` is ``cifar10-<batch_format>``)."""
    image_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...]
    train_files: tuple[str, ...]
    """The training batches, in record order."""
    test_files: tuple[str, ...]
    train_rows: int
    test_rows: int
    class_counts: dict[str, tuple[int, ...]]
    """"train" and "test": images per class."""
    provenance: str

    def __post_init__(self) -> None:
        _check_layout_version(self.layout_version)
        _require_choice("schema.format", self.batch_format, CIFAR10_BATCH_FORMATS)
        _require_image_shape("schema.image_shape", self.image_shape)
        _check_classes(self.num_classes, self.class_names)
        _require_count("statistics.train_rows", self.train_rows)
        _require_count("statistics.test_rows", self.test_rows)
        _check_provenance(self.provenance, None)

    @property
    def format(self) -> str:
        """``schema.format``."""
        return f"cifar10-{self.batch_format}"

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return pixel_shape(self.image_shape)

    def to_manifest(self) -> ManifestFields:
        return {
            "schema": {
                "layout_version": self.layout_version,
                "format": self.format,
                "image_shape": list(self.image_shape),
                "num_classes": self.num_classes,
                "class_names": list(self.class_names),
                "train_files": list(self.train_files),
                "test_files": list(self.test_files),
            },
            "statistics": {
                "train_rows": self.train_rows,
                "test_rows": self.test_rows,
                "class_counts": {split: list(c) for split, c in self.class_counts.items()},
                "provenance": self.provenance,
            },
        }

    @classmethod
    def of(cls, manifest: Manifest) -> Cifar10Layout:
        version, schema, statistics = _raw_fields(manifest, "cifar10")
        counts = statistics.child("class_counts")
        return schema.build(
            cls,
            prefix="",
            layout_version=version,
            batch_format=schema.text("format").removeprefix("cifar10-"),
            image_shape=schema.integers("image_shape"),
            num_classes=schema.integer("num_classes"),
            class_names=schema.texts("class_names"),
            train_files=schema.texts("train_files"),
            test_files=schema.texts("test_files"),
            train_rows=statistics.integer("train_rows"),
            test_rows=statistics.integer("test_rows"),
            class_counts={split: counts.integers(split) for split in ("train", "test")},
            provenance=statistics.text("provenance"),
        )


@dataclass(frozen=True, kw_only=True)
class ExportsLayout:
    """Raw SDSS rows converted from CasJobs exports (CSV, FITS, VOTable) to Parquet
    (preprocessing.sources.exports); ``parameters.format`` is "casjobs-export"."""

    layout_version: int = LAYOUT_VERSION
    columns: dict[str, str]
    """Column -> its type name, every export has them."""
    optional: dict[str, str]
    """Columns an export may add (synth.py's provenance)."""
    rows: int
    num_files: int
    """Parquet files, one per export (``statistics.files``)."""
    synthetic_rows: int
    """Rows whose provenance column says synthetic."""

    def __post_init__(self) -> None:
        _check_layout_version(self.layout_version)
        _require_count("statistics.rows", self.rows)
        _require_count("statistics.files", self.num_files)
        _require_count("statistics.synthetic_rows", self.synthetic_rows)

    @property
    def format(self) -> str:
        """``schema.format``."""
        return "parquet"

    def to_manifest(self) -> ManifestFields:
        return {
            "schema": {
                "layout_version": self.layout_version,
                "format": self.format,
                "columns": dict(self.columns),
                "optional": dict(self.optional),
            },
            "statistics": {
                "rows": self.rows,
                "files": self.num_files,
                "synthetic_rows": self.synthetic_rows,
            },
        }

    @classmethod
    def of(cls, manifest: Manifest) -> ExportsLayout:
        version, schema, statistics = _raw_fields(manifest, "casjobs-export")
        return schema.build(
            cls,
            prefix="",
            layout_version=version,
            columns=schema.text_map("columns"),
            optional=schema.text_map("optional"),
            rows=statistics.integer("rows"),
            num_files=statistics.integer("files"),
            synthetic_rows=statistics.integer("synthetic_rows"),
        )


@dataclass(frozen=True, kw_only=True)
class SkyServerLayout:
    """Raw SDSS rows fetched from SkyServer's SQL service in pages
    (preprocessing.sources.sdss)."""

    layout_version: int = LAYOUT_VERSION
    columns: dict[str, str]
    """Column -> its type name."""
    rows: int
    num_pages: int
    """Parquet files, one per page (``statistics.pages``)."""
    count_reported: int
    """Rows SkyServer counted for the query before the pages were fetched."""

    def __post_init__(self) -> None:
        _check_layout_version(self.layout_version)
        _require_count("statistics.rows", self.rows)
        _require_count("statistics.pages", self.num_pages)
        _require_count("statistics.count_reported", self.count_reported)

    @property
    def format(self) -> str:
        """``schema.format``."""
        return "parquet"

    def to_manifest(self) -> ManifestFields:
        return {
            "schema": {
                "layout_version": self.layout_version,
                "format": self.format,
                "columns": dict(self.columns),
            },
            "statistics": {
                "rows": self.rows,
                "pages": self.num_pages,
                "count_reported": self.count_reported,
            },
        }

    @classmethod
    def of(cls, manifest: Manifest) -> SkyServerLayout:
        version, schema, statistics = _raw_fields(manifest, "skyserver")
        return schema.build(
            cls,
            prefix="",
            layout_version=version,
            columns=schema.text_map("columns"),
            rows=statistics.integer("rows"),
            num_pages=statistics.integer("pages"),
            count_reported=statistics.integer("count_reported"),
        )


RawLayout = IdxLayout | Cifar10Layout | ExportsLayout | SkyServerLayout
ImageSetLayout = IdxLayout | Cifar10Layout


def raw_layout(manifest: Manifest) -> RawLayout:
    """The layout of a raw version, whichever ingest wrote it (from ``schema.format``, and for
    Parquet from ``parameters.format``, part of the version's identity)."""
    return _RAW_PARSERS[_raw_source(manifest)](manifest)


def _raw_source(manifest: Manifest) -> str:
    if manifest.kind != "raw":
        raise LayoutError(f"{manifest.ref} is a {manifest.kind} version, not a raw one")
    version = _layout_version(manifest, "raw")
    fmt = _Fields(manifest.schema, "schema", f"{manifest.ref} (raw layout {version})").text(
        "format"
    )
    if fmt == "idx":
        return "idx"
    if fmt.startswith("cifar10-"):
        return "cifar10"
    if fmt == "parquet":
        # The two SDSS ingests write the same schema.format; their parameters tell them apart.
        exported = manifest.parameters.get("format") == "casjobs-export"
        return "casjobs-export" if exported else "skyserver"
    raise LayoutError(
        f"{manifest.ref} (raw layout {version}): schema.format {fmt!r} is not a raw format this "
        "shardflow knows (idx, cifar10-binary, cifar10-python, parquet)"
    )


_RAW_PARSERS: dict[str, Callable[[Manifest], RawLayout]] = {
    "idx": IdxLayout.of,
    "cifar10": Cifar10Layout.of,
    "casjobs-export": ExportsLayout.of,
    "skyserver": SkyServerLayout.of,
}


# ---------------------------------------------------------------------------------------------
# Reading and checking fields


class _Fields:
    """One JSON object of a manifest, read field by field. Every refusal is a
    :class:`LayoutError` naming the layout and the field's path (``statistics.train.rows``)."""

    def __init__(self, data: object, path: str, where: str) -> None:
        if not isinstance(data, dict):
            raise LayoutError(f"{where}: {path} is {_shown(data)}, expected an object")
        self._data: dict[str, Any] = data
        self._path = path
        self._where = where

    def name(self, key: str) -> str:
        return f"{self._path}.{key}"

    def has(self, key: str) -> bool:
        return key in self._data

    def _refuse(self, key: str, value: object, expected: str) -> LayoutError:
        return LayoutError(
            f"{self._where}: {self.name(key)} is {_shown(value)}, expected {expected}"
        )

    def value(self, key: str) -> Any:
        if key not in self._data:
            raise LayoutError(f"{self._where}: {self.name(key)} is missing")
        return self._data[key]

    def child(self, key: str) -> _Fields:
        return _Fields(self.value(key), self.name(key), self._where)

    def integer(self, key: str) -> int:
        value = self.value(key)
        if not _is_int(value):
            raise self._refuse(key, value, "a whole number")
        return int(value)

    def boolean(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            raise self._refuse(key, value, "true or false")
        return value

    def text(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise self._refuse(key, value, "a string")
        return value

    def _items(self, key: str, check: Callable[[object], bool], item: str) -> list[Any]:
        value = self.value(key)
        if not isinstance(value, list):
            raise self._refuse(key, value, f"a list of {item}s")
        for i, element in enumerate(value):
            if not check(element):
                raise self._refuse(f"{key}[{i}]", element, f"a {item}")
        return value

    def integers(self, key: str) -> tuple[int, ...]:
        return tuple(int(v) for v in self._items(key, _is_int, "whole number"))

    def numbers(self, key: str) -> tuple[float, ...]:
        return tuple(float(v) for v in self._items(key, _is_number, "number"))

    def texts(self, key: str) -> tuple[str, ...]:
        return tuple(self._items(key, lambda v: isinstance(v, str), "string"))

    def _map(self, key: str, check: Callable[[object], bool], expected: str) -> dict[str, Any]:
        fields = self.child(key)
        for name, item in fields._data.items():
            if not check(item):
                raise fields._refuse(name, item, expected)
        return dict(fields._data)

    def text_map(self, key: str) -> dict[str, str]:
        return self._map(key, lambda v: isinstance(v, str), "a string")

    def integer_map(self, key: str) -> dict[str, int]:
        return self._map(key, _is_int, "a whole number")

    def number_map(self, key: str) -> dict[str, float]:
        return {k: float(v) for k, v in self._map(key, _is_number, "a number").items()}

    def nested_number_map(self, key: str) -> dict[str, dict[str, float]]:
        fields = self.child(key)
        return {name: fields.number_map(name) for name in fields._data}

    def build(self, factory: Callable[..., T], *, prefix: str | None = None, **values: Any) -> T:
        """``factory(**values)``; a refusal of a value by its ``__post_init__`` names the
        layout and the field (under this object's path unless ``prefix`` is given: the
        top-level layouts name their fields' paths themselves)."""
        try:
            return factory(**values)
        except LayoutError as exc:
            path = f"{self._path}." if prefix is None else prefix
            raise LayoutError(f"{self._where}: {path}{exc}") from None


def _layout_version(manifest: Manifest, what: str) -> int:
    """``schema.layout_version``, or 1 for manifests written before it existed."""
    if "layout_version" not in manifest.schema:
        return 1
    version = manifest.schema["layout_version"]
    if version != LAYOUT_VERSION or not _is_int(version):
        raise LayoutError(
            f"{manifest.ref}: schema.layout_version is {_shown(version)}; this shardflow reads "
            f"{what} layout {LAYOUT_VERSION} (manifests without layout_version hold 1): "
            "upgrade shardflow"
        )
    return int(version)


def _raw_fields(manifest: Manifest, source: str) -> tuple[int, _Fields, _Fields]:
    """The layout version, schema and statistics of a raw manifest written by ``source``."""
    found = _raw_source(manifest)
    version = _layout_version(manifest, "raw")
    if found != source:
        raise LayoutError(
            f"{manifest.ref} (raw layout {version}) was written by the {found} ingest, "
            f"not the {source} one"
        )
    where = f"{manifest.ref} ({source} raw layout {version})"
    return (
        version,
        _Fields(manifest.schema, "schema", where),
        _Fields(manifest.statistics, "statistics", where),
    )


def _is_int(value: object) -> bool:
    # bool is an int subclass; a count of True rows is a garbled field, not 1 row.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(cast(float, value))


def _shown(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _require_count(name: str, value: int, *, minimum: int = 0) -> None:
    if not _is_int(value) or value < minimum:
        raise LayoutError(
            f"{name} is {_shown(value)}, expected a whole number of at least {minimum}"
        )


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LayoutError(f"{name} is {value!r}, expected one of {', '.join(choices)}")


def _require_choice_in(where: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    try:
        _require_choice(name, value, choices)
    except LayoutError as exc:
        raise LayoutError(f"{where}: {exc}") from None


def _require_image_shape(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) not in (2, 3) or any(d < 1 for d in shape):
        raise LayoutError(f"{name} is {list(shape)}, expected (rows, cols[, channels]) above 0")


def _check_layout_version(version: int) -> None:
    if version != LAYOUT_VERSION:
        raise LayoutError(
            f"schema.layout_version is {version!r}; this shardflow writes {LAYOUT_VERSION}"
        )


def _check_classes(num_classes: int, class_names: tuple[str, ...]) -> None:
    _require_count("schema.num_classes", num_classes, minimum=1)
    if len(class_names) != num_classes:
        raise LayoutError(
            f"schema.class_names has {len(class_names)} names for schema.num_classes {num_classes}"
        )


def _check_provenance(provenance: str, synthetic: Any) -> None:
    _require_choice("statistics.provenance", provenance, PROVENANCES)
    if synthetic is not None and provenance != "synthetic":
        raise LayoutError("statistics.synthetic is set for a real source")
