"""What each stage returns: one JSON-ready shape per stage, and its one-line summary.

The CLI prints these (``--json`` prints the dict), the Prefect flows return them; both get
them from here.
"""

from __future__ import annotations

from typing import Any

from data_catalog import Manifest
from data_catalog.layout import (
    Cifar10Layout,
    IdxLayout,
    ProcessedLayout,
    SkyServerLayout,
    raw_layout,
)


def ingest_result(dataset: str, manifest: Manifest) -> dict[str, Any]:
    result = {
        "dataset": dataset,
        "version": manifest.version,
        "rows": manifest.rows,
        "files": len(manifest.files),
        "sources": [s.get("uri") or s.get("url") or s.get("file") for s in manifest.sources],
    }
    layout = raw_layout(manifest)
    if isinstance(layout, IdxLayout | Cifar10Layout):
        result.update(train_rows=layout.train_rows, test_rows=layout.test_rows)
    elif isinstance(layout, SkyServerLayout):
        result.update(pages=layout.num_pages, count_reported=layout.count_reported)
    else:  # CasJobs exports
        result.update(synthetic_rows=layout.synthetic_rows)
    return result


def ingest_summary(result: dict[str, Any]) -> str:
    split = (
        f" ({result['train_rows']:,} train + {result['test_rows']:,} test)"
        if "train_rows" in result
        else ""
    )
    return (
        f"{result['dataset']}@{result['version']}: {result['rows']:,} rows{split} "
        f"in {result['files']} files"
    )


def preprocess_result(dataset: str, manifest: Manifest) -> dict[str, Any]:
    layout = ProcessedLayout.of(manifest)
    return {
        "dataset": dataset,
        "name": manifest.name,
        "version": manifest.version,
        "parent": str(manifest.parents[0]),
        "rows": manifest.rows,
        "num_files": len(manifest.files),
        "format": layout.format,
        "splits": {name: split.to_manifest() for name, split in layout.splits.items()},
        "normalization": layout.normalization.to_manifest(),
        **({"quarantine": layout.quarantine.to_statistics()} if layout.quarantine else {}),
        "rows_in": layout.rows_in,
    }


def preprocess_summary(result: dict[str, Any]) -> str:
    splits = ", ".join(
        f"{int(stats['rows']):,} {split}" for split, stats in result["splits"].items()
    )
    quarantined = result.get("quarantine", {}).get("rows")
    return (
        f"{result['name']}@{result['version']}: {splits} rows in {result['num_files']} files "
        f"({result['format']})"
        + (f"; {quarantined:,} rows quarantined" if quarantined is not None else "")
    )


def train_result(dataset: str, manifest: Manifest, metrics: dict[str, Any]) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "model_name": manifest.name,
        "version": manifest.version,
        "dataset_version": str(manifest.parents[0]),
        "num_ranks": metrics["num_ranks"],
        "epochs": metrics["epochs"],
        "steps_per_epoch": metrics["steps_per_epoch"],
        "test_accuracy": metrics["test_accuracy"],
        "test_rows": metrics["test_rows"],
        "train_seconds": metrics["train_seconds"],
        "epoch_seconds": metrics.get("epoch_seconds"),
        "batch_size": manifest.parameters.get("batch_size"),
        "samples_per_second": metrics["samples_per_second"],
        "history": metrics["history"],
        "backward_passes_per_step": metrics["backward_passes_per_step"],
        "compression": metrics["compression"],
        "allreduce_bytes_per_epoch": metrics["allreduce_bytes_per_epoch"],
        "allreduce_bytes_by_epoch": metrics.get("allreduce_bytes_by_epoch"),
        "allreduce_bytes_per_epoch_computed": metrics.get("allreduce_bytes_per_epoch_computed"),
        # Bytes each rank sent on --network-interface, per epoch (absent without it).
        "wire_sent_by_rank": metrics.get("wire_sent_by_rank"),
        # Each rank's input and step times, and the flags drawn from them (absent before them).
        "input_by_rank": metrics.get("input_by_rank"),
        "input_summary": metrics.get("input_summary"),
        "resumed_after_epoch": metrics["resumed_after_epoch"],
        # A mid-epoch resume's epoch (from 1), step and what it did (absent or None otherwise).
        "resumed_at": metrics.get("resumed_at"),
        "run_dir": manifest.extra.get("run_dir"),
    }


def train_summary(result: dict[str, Any]) -> str:
    return (
        f"{result['model_name']}@{result['version']}: test accuracy "
        f"{result['test_accuracy']:.4f} after {result['epochs']} epochs on "
        f"{result['num_ranks']} ranks ({result['train_seconds']:.1f} s of training)"
    )
