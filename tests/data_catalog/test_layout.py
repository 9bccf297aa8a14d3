"""The typed layouts: manifests written before layout_version existed read as version 1 and
written back key for key; a round trip through a catalog gives the same layout; a missing,
renamed or garbled field, or a newer layout version, is refused with the field named."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from data_catalog import FORMAT_VERSION, Catalog, Manifest
from data_catalog.layout import (
    Cifar10Layout,
    ExportsLayout,
    IdxLayout,
    LayoutError,
    ProcessedLayout,
    SkyServerLayout,
    raw_layout,
)

# Written by the ingests and jobs of commit 4d1aaa5, the last before layout_version.
V1 = json.loads((Path(__file__).with_name("layouts_v1.json")).read_text())["manifests"]
PROCESSED = sorted(tag for tag, m in V1.items() if m["kind"] == "processed")
RAW = sorted(tag for tag, m in V1.items() if m["kind"] == "raw")


def manifest(tag: str, edit: Callable[[dict[str, Any]], None] | None = None) -> Manifest:
    """The manifest of fixture ``tag``, its schema and statistics changed by ``edit``."""
    entry = copy.deepcopy(V1[tag])
    if edit is not None:
        edit(entry)
    return Manifest(
        format_version=FORMAT_VERSION,
        name=entry["name"],
        version=entry["version"],
        kind=entry["kind"],
        created="2026-11-26T00:00:00.000000+00:00",
        code_version="test-code",
        parameters=entry["parameters"],
        parents=(),
        sources=(),
        schema=entry["schema"],
        statistics=entry["statistics"],
        rows=entry["rows"],
        files=(),
        extra={},
    )


def layout_of(m: Manifest) -> Any:
    return ProcessedLayout.of(m) if m.kind == "processed" else raw_layout(m)


@pytest.mark.parametrize("tag", sorted(V1))
def test_a_manifest_without_layout_version_is_version_1_and_written_back_key_for_key(
    tag: str,
) -> None:
    layout = layout_of(manifest(tag))
    assert layout.layout_version == 1
    written = layout.to_manifest()
    assert written["schema"] == {**V1[tag]["schema"], "layout_version": 1}
    assert written["statistics"] == V1[tag]["statistics"]


@pytest.mark.parametrize("tag", sorted(V1))
def test_a_layout_committed_to_a_catalog_reads_back_equal(tag: str, tmp_path: Path) -> None:
    original = manifest(tag)
    layout = layout_of(original)
    catalog = Catalog(tmp_path / "catalog")
    with catalog.stage(original.name, kind=original.kind) as stage:
        (stage.path / "notes.txt").write_text("a file\n")
        committed = stage.commit(
            parameters=original.parameters,
            **layout.to_manifest(),
            rows=original.rows,
            code_version="test-code",
        )
    read = catalog.get(committed.name, committed.version)
    assert read.schema["layout_version"] == 1
    assert layout_of(read) == layout


def test_the_typed_fields_of_real_manifests() -> None:
    images = ProcessedLayout.of(manifest("fm-parquet"))
    assert (images.kind, images.format, images.image_shape) == ("images", "parquet", (28, 28))
    assert images.pixel_shape == (28, 28, 1)
    assert images.label_column == "label" and images.feature_columns is None
    assert images.quarantine is None and images.unischema is None
    assert list(images.splits) == ["train", "validation", "test"]
    assert images.train.policy == "drop" and images.train.equal_row_groups
    assert images.train.rows == images.train.rows_per_group * images.train.num_row_groups
    assert images.rows == V1["fm-parquet"]["rows"]
    assert len(images.normalization.mean) == 1

    petastorm = ProcessedLayout.of(manifest("fm-petastorm"))
    assert petastorm.format == "petastorm" and petastorm.unischema is not None

    table = ProcessedLayout.of(manifest("sdss-processed"))
    assert (table.kind, table.image_shape, table.pixel_shape) == ("tabular", None, ())
    assert table.feature_columns is not None and len(table.feature_columns) == 19
    assert table.class_names == ("STAR", "GALAXY", "QSO")
    assert table.train.policy == "pad" and table.splits["test"].policy == "whole"
    assert table.quarantine is not None
    kept = sum(split.source_rows for split in table.splits.values())
    assert table.rows_in == kept + table.quarantine.rows

    idx = raw_layout(manifest("mnist-synth-raw"))
    assert isinstance(idx, IdxLayout)
    assert idx.provenance == "synthetic" and idx.synthetic == {"pool": "test", "seed": 3}
    assert idx.pixel_shape == (28, 28, 1)
    assert isinstance(raw_layout(manifest("cifar-raw")), Cifar10Layout)
    exports = raw_layout(manifest("sdss-raw"))
    assert isinstance(exports, ExportsLayout)
    assert exports.rows == V1["sdss-raw"]["rows"] and exports.num_files == 2


def test_a_skyserver_layout_round_trips(tmp_path: Path) -> None:
    layout = SkyServerLayout(
        columns={"objid": "uint64", "u": "float64"}, rows=25, num_pages=3, count_reported=25
    )
    catalog = Catalog(tmp_path / "catalog")
    with catalog.stage("sdss", kind="raw") as stage:
        (stage.path / "page-00001.parquet.txt").write_text("stand-in\n")
        committed = stage.commit(
            parameters={"skyserver_url": "https://example.org"},
            **layout.to_manifest(),
            rows=25,
            code_version="test-code",
        )
    assert committed.statistics == {"rows": 25, "pages": 3, "count_reported": 25}
    assert raw_layout(catalog.get("sdss")) == layout


def test_idx_ingests_from_before_the_decompressed_copies_are_read() -> None:
    def without_copies(entry: dict[str, Any]) -> None:
        del entry["schema"]["decompressed"]

    layout = raw_layout(manifest("fm-raw", without_copies))
    assert isinstance(layout, IdxLayout) and layout.decompressed == {}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting (or, with ``...``, deleting) the field at the dotted ``path``."""

    def edit(entry: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = entry
        for key in parents:
            target = target[key]
        if value is ...:
            del target[last]
        else:
            target[last] = value

    return edit


def _rename(path: str, new: str) -> Callable[[dict[str, Any]], None]:
    def edit(entry: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = entry
        for key in parents:
            target = target[key]
        target[new] = target.pop(last)

    return edit


@pytest.mark.parametrize(
    ("tag", "edit", "message"),
    [
        (
            "fm-parquet",
            _set("statistics.train.rows_per_group", ...),
            "statistics.train.rows_per_group is missing",
        ),
        (
            "fm-parquet",
            _rename("statistics.train.num_row_groups", "row_groups"),
            "statistics.train.num_row_groups is missing",
        ),
        (
            "fm-parquet",
            _set("statistics.train.rows_per_group", "30"),
            "statistics.train.rows_per_group is '30' (str), expected a whole number",
        ),
        (
            "fm-parquet",
            _set("statistics.train.num_row_groups", True),
            "statistics.train.num_row_groups is True (bool), expected a whole number",
        ),
        (
            "fm-parquet",
            _set("statistics.train.policy", "keep"),
            "statistics.train.policy is 'keep', expected one of drop, pad, whole",
        ),
        (
            "fm-parquet",
            _set("statistics.validation.rows_per_group", 0),
            "statistics.validation.rows_per_group is 0 (int), expected a whole number of at "
            "least 1",
        ),
        ("fm-parquet", _set("schema.num_classes", ...), "schema.num_classes is missing"),
        (
            "fm-parquet",
            _set("statistics.normalization.mean", ["x"]),
            "statistics.normalization.mean[0] is 'x' (str), expected a number",
        ),
        (
            "fm-parquet",
            _set("statistics.normalization.mean", [0.1, 0.2]),
            "statistics.normalization.std has 1 values, mean 2",
        ),
        (
            "fm-parquet",
            _set("statistics.normalization.std", [0.1, 0.2]),
            "statistics.normalization.std has 2 values, mean 1",
        ),
        (
            "fm-parquet",
            _set("schema.kind", "video"),
            "schema.kind is 'video', expected one of images, tabular",
        ),
        (
            "fm-parquet",
            _set("schema.splits", {"train": "training"}),
            "schema.splits.train is 'training'; a split's folder is split=train (or train, in "
            "versions written before), the same for every split",
        ),
        ("fm-parquet", _set("statistics.train", ...), "statistics.train is missing"),
        (
            "fm-parquet",
            _set("statistics.train", [1, 2]),
            "statistics.train is [1, 2] (list), expected an object",
        ),
        ("fm-petastorm", _set("schema.unischema", ...), "schema.unischema is missing"),
        ("sdss-processed", _set("statistics.quarantine", ...), "statistics.quarantine is missing"),
        (
            "sdss-processed",
            _rename("schema.feature_columns", "features"),
            "schema.feature_columns is missing",
        ),
        (
            "sdss-processed",
            _set("schema.num_classes", 4),
            "schema.class_names has 3 names for schema.num_classes 4",
        ),
        (
            "sdss-processed",
            _set("statistics.quarantine.reasons", {"nan:u": -1}),
            "statistics.quarantine.reasons['nan:u'] is -1 (int), expected a whole number of at "
            "least 0",
        ),
        ("sdss-processed", _set("statistics.rows_in", ...), "statistics.rows_in is missing"),
    ],
)
def test_a_missing_or_garbled_processed_field_is_refused_by_name(
    tag: str, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    m = manifest(tag, edit)
    with pytest.raises(LayoutError) as refused:
        ProcessedLayout.of(m)
    assert str(refused.value) == f"{m.ref} (processed layout 1): {message}"


@pytest.mark.parametrize(
    ("tag", "edit", "message"),
    [
        (
            "cifar-raw",
            _set("statistics.class_counts", ...),
            "(cifar10 raw layout 1): statistics.class_counts is missing",
        ),
        (
            "fm-raw",
            _set("schema.files", {"train-images-idx3-ubyte": "x.gz"}),
            "(idx raw layout 1): schema.files lacks train-labels-idx1-ubyte, "
            "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte",
        ),
        (
            "fm-raw",
            _set("statistics.provenance", "borrowed"),
            "(idx raw layout 1): statistics.provenance is 'borrowed', expected one of real, "
            "synthetic",
        ),
        (
            "sdss-raw",
            _rename("statistics.synthetic_rows", "synthetic"),
            "(casjobs-export raw layout 1): statistics.synthetic_rows is missing",
        ),
        (
            "fm-raw",
            _set("schema.format", "tfrecord"),
            "(raw layout 1): schema.format 'tfrecord' is not a raw format this shardflow knows",
        ),
    ],
)
def test_a_missing_or_garbled_raw_field_is_refused_by_name(
    tag: str, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    m = manifest(tag, edit)
    with pytest.raises(LayoutError) as refused:
        raw_layout(m)
    assert str(refused.value).startswith(f"{m.ref} {message}")


@pytest.mark.parametrize("version", [2, "1", True, None])
def test_a_layout_version_this_code_does_not_read_is_refused(version: Any) -> None:
    for tag in ("fm-parquet", "fm-raw"):
        m = manifest(tag, _set("schema.layout_version", version))
        with pytest.raises(LayoutError) as refused:
            layout_of(m)
        message = str(refused.value)
        assert f"schema.layout_version is {version!r}" in message
        assert "layout 1" in message and message.endswith("upgrade shardflow")


def test_a_layout_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(LayoutError, match="is a raw version, not a processed one"):
        ProcessedLayout.of(manifest("fm-raw"))
    with pytest.raises(LayoutError, match="is a processed version, not a raw one"):
        raw_layout(manifest("fm-parquet"))
    with pytest.raises(LayoutError, match="written by the idx ingest, not the cifar10 one"):
        Cifar10Layout.of(manifest("fm-raw"))


def test_a_writer_cannot_build_an_inconsistent_layout() -> None:
    images = ProcessedLayout.of(manifest("fm-parquet"))
    table = ProcessedLayout.of(manifest("sdss-processed"))
    with pytest.raises(LayoutError, match=r"schema\.image_shape is missing"):
        dataclasses.replace(images, image_shape=None)
    with pytest.raises(LayoutError, match=r"statistics\.quarantine is set"):
        dataclasses.replace(images, quarantine=table.quarantine)
    with pytest.raises(LayoutError, match=r"schema\.unischema is recorded for petastorm"):
        dataclasses.replace(images, format="petastorm")
    with pytest.raises(LayoutError, match="tabular layouts are parquet"):
        dataclasses.replace(table, format="petastorm")
    with pytest.raises(LayoutError, match="no train split"):
        dataclasses.replace(images, splits={"test": images.splits["test"]})
    with pytest.raises(LayoutError, match="policy is 'keep'"):
        dataclasses.replace(images.train, policy="keep")
