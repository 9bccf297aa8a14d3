"""The stages' typed results: the JSON keys the CLI's --json and the flows' return values have
always had (scripts and the acceptance checks read them), read back whole, and their summary
lines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from data_catalog import Manifest
from data_catalog.layout import (
    IDX_STEMS,
    IdxLayout,
    Normalization,
    ProcessedLayout,
    Quarantine,
    SkyServerLayout,
    SplitLayout,
)
from data_catalog.manifest import FileEntry, ParentRef
from flows.results import (
    IngestResult,
    PipelineResult,
    PreprocessResult,
    TaskTally,
    TrainResult,
    ingest_result,
    preprocess_result,
    train_result,
)

TALLY = TaskTally(
    tasks={"write": {"tasks": 4, "reused": 1}},
    resources={"workers": 2, "peak_rss_bytes": [1, 2], "cpu_seconds": 3.0},
)


def manifest(name: str, kind: str, **fields: Any) -> Manifest:
    base: dict[str, Any] = {
        "format_version": 1,
        "name": name,
        "version": "0123456789abcdef",
        "kind": kind,
        "created": "2026-01-01T00:00:00.000000+00:00",
        "code_version": "test",
        "parameters": {},
        "parents": (),
        "sources": (),
        "schema": {},
        "statistics": {},
        "rows": 70_000,
        "files": (
            FileEntry(path="a", bytes=1, sha256="0" * 64, rows=None, row_groups=None),
            FileEntry(path="b", bytes=1, sha256="1" * 64, rows=None, row_groups=None),
        ),
        "extra": {},
    }
    return Manifest(**{**base, **fields})


def test_an_ingest_result_has_the_published_keys_and_only_the_counts_its_source_has() -> None:
    idx = IdxLayout(
        image_shape=(28, 28),
        num_classes=10,
        class_names=tuple(str(i) for i in range(10)),
        files={stem: stem for pair in IDX_STEMS.values() for stem in pair},
        decompressed={},
        train_rows=60_000,
        test_rows=10_000,
        canonical_digests_checked=True,
        provenance="real",
    )
    images = ingest_result(
        "mnist",
        manifest(
            "mnist",
            "raw",
            sources=({"url": "http://h/train.gz"}, {"file": "t10k.gz"}),
            **idx.to_manifest(),
        ),
        TALLY,
    )
    assert list(images.to_json()) == [
        "dataset", "version", "rows", "files", "sources", "train_rows", "test_rows", "tasks",
        "resources",
    ]  # fmt: skip
    assert images.to_json()["sources"] == ["http://h/train.gz", "t10k.gz"]
    assert images.summary() == (
        "mnist@0123456789abcdef: 70,000 rows (60,000 train + 10,000 test) in 2 files"
    )
    sky = SkyServerLayout(
        columns={"objid": "uint64"}, rows=70_000, num_pages=3, count_reported=70_000
    )
    skyserver = ingest_result(
        "sdss",
        manifest("sdss", "raw", parameters={"format": "skyserver"}, **sky.to_manifest()),
        TaskTally(tasks={}),
    )
    assert list(skyserver.to_json()) == [
        "dataset", "version", "rows", "files", "sources", "pages", "count_reported", "tasks",
    ]  # fmt: skip
    assert skyserver.summary() == "sdss@0123456789abcdef: 70,000 rows in 2 files"
    for result in (images, skyserver):
        assert IngestResult.from_json(result.to_json()) == result


def split(rows: int, groups: int, policy: str = "whole") -> SplitLayout:
    """A split of ``rows`` in ``groups`` row groups of 1,000, one shard, nothing dropped."""
    return SplitLayout(
        rows=rows,
        source_rows=rows,
        rows_per_group=1000,
        num_row_groups=groups,
        num_shards=1,
        dropped_rows=0,
        padded_rows=0,
        policy=policy,
    )


def test_a_preprocess_result_has_the_published_keys_and_says_what_was_quarantined() -> None:
    layout = ProcessedLayout(
        kind="tabular",
        format="parquet",
        arrow_schema="x: float, label: int64",
        columns=("x", "label"),
        feature_columns=("x",),
        label_column="label",
        num_classes=3,
        class_names=("STAR", "GALAXY", "QSO"),
        split_by="hash",
        split_fractions={"train": 0.9, "test": 0.1},
        splits={"train": split(60_000, 60, "whole"), "test": split(9_000, 9, "whole")},
        normalization=Normalization(mean=(0.5,), std=(1.0,), over="train"),
        quarantine=Quarantine(rows=1_000, reasons={"nan:u": 1_000}, files=1, contents="q"),
        rows_in=70_000,
    )
    result = preprocess_result(
        "sdss",
        manifest(
            "sdss-processed",
            "processed",
            parents=(ParentRef(name="sdss", version="fedcba9876543210"),),
            **layout.to_manifest(),
        ),
        TALLY,
    )
    assert list(result.to_json()) == [
        "dataset", "name", "version", "parent", "rows", "num_files", "format", "splits",
        "normalization", "quarantine", "rows_in", "tasks", "resources",
    ]  # fmt: skip
    assert result.parent == "sdss@fedcba9876543210"
    assert list(result.splits) == ["train", "test"]
    assert result.summary() == (
        "sdss-processed@0123456789abcdef: 60,000 train, 9,000 test rows in 2 files (parquet); "
        "1,000 rows quarantined"
    )
    assert PreprocessResult.from_json(result.to_json()) == result


METRICS: dict[str, Any] = {
    "num_ranks": 2,
    "epochs": 3,
    "steps_per_epoch": 10,
    "test_accuracy": 0.875,
    "test_rows": 1_000,
    "train_seconds": 12.34,
    "samples_per_second": 500.0,
    "history": {"loss": [1.0, 0.5, 0.25]},
    "backward_passes_per_step": 1,
    "compression": "none",
    "allreduce_bytes_per_epoch": 4_096,
    "resumed_after_epoch": 0,
}

TRAIN_KEYS = [
    "dataset", "model_name", "version", "dataset_version", "num_ranks", "epochs",
    "steps_per_epoch", "test_accuracy", "test_rows", "train_seconds", "epoch_seconds",
    "batch_size", "samples_per_second", "history", "backward_passes_per_step", "compression",
    "allreduce_bytes_per_epoch", "allreduce_bytes_by_epoch",
    "allreduce_bytes_per_epoch_computed", "wire_sent_by_rank", "input_by_rank",
    "input_summary", "resumed_after_epoch", "resumed_at", "run_dir",
]  # fmt: skip


def trained() -> TrainResult:
    return train_result(
        "sdss",
        manifest(
            "sdss-dnn",
            "model",
            parents=(ParentRef(name="sdss-processed", version="0011223344556677"),),
            parameters={"batch_size": 64},
            extra={"run_dir": "/runs/sdss-dnn"},
        ),
        METRICS,
    )


def test_a_train_result_keeps_every_key_and_adds_the_report_once_written() -> None:
    result = trained()
    assert list(result.to_json()) == TRAIN_KEYS
    assert result.to_json()["epoch_seconds"] is None  # absent from the metrics: null, as before
    assert result.batch_size == 64 and result.dataset_version == "sdss-processed@0011223344556677"
    reported = replace(result, report="/runs/sdss-dnn/report.html")
    assert list(reported.to_json()) == [*TRAIN_KEYS, "report"]
    assert TrainResult.from_json(reported.to_json()) == reported
    assert result.summary() == (
        "sdss-dnn@0123456789abcdef: test accuracy 0.8750 after 3 epochs on 2 ranks (12.3 s of "
        "training)"
    )


def test_the_pipeline_result_is_the_train_result_with_the_runs_versions_beside_it() -> None:
    result = PipelineResult(
        trained=trained(),
        raw_version="fedcba9876543210",
        processed_version="0011223344556677",
        rows=70_000,
        flow_run_id="run-id",
    )
    data = result.to_json()
    assert list(data) == [*TRAIN_KEYS, "raw_version", "processed_version", "rows", "flow_run_id"]
    assert PipelineResult.from_json(data) == result
    assert result.summary() == trained().summary()


def test_the_pipeline_summary_speaks_to_a_person() -> None:
    result = PipelineResult(
        trained=replace(trained(), report="/home/.demo-home/catalog/report.html"),
        raw_version="fedcba9876543210",
        processed_version="0011223344556677",
        rows=70_000,
        flow_run_id="1b2c",
    )
    lines = result.summary_lines("http://127.0.0.1:4300/api")
    assert lines[1:] == [
        "sdss: test accuracy 87.50% on 1,000 test rows, 3 epochs on 2 Horovod ranks "
        "(12 s of training)",
        "  raw        sdss@fedcba9876543210  (70,000 rows)",
        "  processed  sdss-processed@0011223344556677",
        "  model      sdss-dnn@0123456789abcdef",
        "  report     /home/.demo-home/catalog/report.html",
        "  Prefect    http://127.0.0.1:4300/runs/flow-run/1b2c",
        "  more       shardflow catalog lineage sdss-dnn@0123456789abcdef; --json for machines",
    ]
    # A server the command started is gone with it: the link is that of `shardflow server`.
    assert result.summary_lines(None)[-2] == (
        "  Prefect    http://127.0.0.1:4200/runs/flow-run/1b2c  (after `shardflow server`)"
    )
