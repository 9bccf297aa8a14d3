"""What each stage returns: one frozen, typed result per stage, its JSON shape and its one-line
summary.

    Manifest + TaskTally ─▶ ingest_result      ─▶ IngestResult     ─┐
    Manifest + TaskTally ─▶ preprocess_result  ─▶ PreprocessResult ─┼─ .to_json(): the CLI's --json,
    Manifest + metrics   ─▶ train_result       ─▶ TrainResult      ─┤  the flows' return values
    the three flow runs' results               ─▶ PipelineResult   ─┘  .from_json(): read back

Callers read attributes; only ``to_json`` and ``from_json`` know the keys, which are the
published shape (tests and scripts read them): a key that is absent today stays absent.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from data_catalog import Manifest
from data_catalog.layout import (
    Cifar10Layout,
    IdxLayout,
    ProcessedLayout,
    SkyServerLayout,
    raw_layout,
)


@dataclass(frozen=True, kw_only=True)
class TaskTally:
    """What the driver's passes did: each pass's task count and how many of its tasks found
    their output already there (an interrupted run's), and what the processes used."""

    tasks: dict[str, dict[str, int]]
    """{pass: {"tasks": n, "reused": k}}."""
    resources: dict[str, Any] | None = None
    """Peak RSS and CPU seconds of the workers and the driver; None when no cluster ran (the
    version was already in the catalog)."""

    def to_json(self) -> dict[str, Any]:
        return {"tasks": self.tasks, **({"resources": self.resources} if self.resources else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskTally:
        return cls(tasks=data["tasks"], resources=data.get("resources"))


def _json(result: Any, optional: frozenset[str]) -> dict[str, Any]:
    """``result``'s fields by name, in declaration order; an ``optional`` field only when set."""
    return {
        f.name: getattr(result, f.name)
        for f in fields(result)
        if f.name != "tally" and not (f.name in optional and getattr(result, f.name) is None)
    }


def _fields_from(cls: Any, data: dict[str, Any], optional: frozenset[str]) -> dict[str, Any]:
    return {
        f.name: data.get(f.name) if f.name in optional else data[f.name]
        for f in fields(cls)
        if f.name != "tally"
    }


# --- ingest --------------------------------------------------------------------------------

# Counts of a raw version's statistics some sources have (image sets: the official split;
# SkyServer: pages and the count it reported; exports: rows marked synthetic).
_INGEST_COUNTS = ("train_rows", "test_rows", "pages", "count_reported", "synthetic_rows")


@dataclass(frozen=True, kw_only=True)
class IngestResult:
    dataset: str
    version: str
    rows: int
    files: int
    sources: list[str | None]
    """Each raw file's origin: its URI, URL or file name."""
    train_rows: int | None = None
    test_rows: int | None = None
    pages: int | None = None
    count_reported: int | None = None
    synthetic_rows: int | None = None
    tally: TaskTally

    _OPTIONAL = frozenset(_INGEST_COUNTS)

    def to_json(self) -> dict[str, Any]:
        return {**_json(self, self._OPTIONAL), **self.tally.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IngestResult:
        return cls(**_fields_from(cls, data, cls._OPTIONAL), tally=TaskTally.from_json(data))

    def summary(self) -> str:
        split = (
            f" ({self.train_rows:,} train + {self.test_rows:,} test)"
            if self.train_rows is not None and self.test_rows is not None
            else ""
        )
        return f"{self.dataset}@{self.version}: {self.rows:,} rows{split} in {self.files} files"


def ingest_result(dataset: str, manifest: Manifest, tally: TaskTally) -> IngestResult:
    return IngestResult(
        dataset=dataset,
        version=manifest.version,
        rows=manifest.rows,
        files=len(manifest.files),
        sources=[s.get("uri") or s.get("url") or s.get("file") for s in manifest.sources],
        **_ingest_counts(manifest),
        tally=tally,
    )


def _ingest_counts(manifest: Manifest) -> dict[str, int]:
    layout = raw_layout(manifest)
    if isinstance(layout, IdxLayout | Cifar10Layout):
        return {"train_rows": layout.train_rows, "test_rows": layout.test_rows}
    if isinstance(layout, SkyServerLayout):
        return {"pages": layout.num_pages, "count_reported": layout.count_reported}
    return {"synthetic_rows": layout.synthetic_rows}  # CasJobs exports


# --- preprocess ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PreprocessResult:
    dataset: str
    name: str
    """The processed dataset's catalog name ("<dataset>-processed")."""
    version: str
    parent: str
    """The raw version it was made from ("<dataset>@<version>")."""
    rows: int
    num_files: int
    format: str
    splits: dict[str, dict[str, Any]]
    """The statistics of each split present (train, validation, test)."""
    normalization: dict[str, Any] | None = None
    quarantine: dict[str, Any] | None = None
    rows_in: int | None = None
    tally: TaskTally

    _OPTIONAL = frozenset({"normalization", "quarantine", "rows_in"})

    def to_json(self) -> dict[str, Any]:
        return {**_json(self, self._OPTIONAL), **self.tally.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreprocessResult:
        return cls(**_fields_from(cls, data, cls._OPTIONAL), tally=TaskTally.from_json(data))

    def summary(self) -> str:
        splits = ", ".join(
            f"{int(stats['rows']):,} {split}" for split, stats in self.splits.items()
        )
        quarantined = self.quarantine.get("rows") if self.quarantine else None
        return (
            f"{self.name}@{self.version}: {splits} rows in {self.num_files} files "
            f"({self.format})"
            + (f"; {quarantined:,} rows quarantined" if quarantined is not None else "")
        )


def preprocess_result(dataset: str, manifest: Manifest, tally: TaskTally) -> PreprocessResult:
    layout = ProcessedLayout.of(manifest)
    return PreprocessResult(
        dataset=dataset,
        name=manifest.name,
        version=manifest.version,
        parent=str(manifest.parents[0]),
        rows=manifest.rows,
        num_files=len(manifest.files),
        format=layout.format,
        splits={name: split.to_manifest() for name, split in layout.splits.items()},
        normalization=layout.normalization.to_manifest(),
        quarantine=layout.quarantine.to_statistics() if layout.quarantine else None,
        rows_in=layout.rows_in,
        tally=tally,
    )


# --- train ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    dataset: str
    model_name: str
    version: str
    dataset_version: str
    """The processed version it was trained on ("<name>@<version>")."""
    num_ranks: int
    epochs: int
    steps_per_epoch: int
    test_accuracy: float
    test_rows: int
    train_seconds: float
    epoch_seconds: list[float] | None
    batch_size: int | None
    samples_per_second: float
    history: dict[str, list[float]]
    """Rank 0's per-epoch metrics by name (loss, accuracy, val_...)."""
    backward_passes_per_step: int
    compression: str
    allreduce_bytes_per_epoch: int
    allreduce_bytes_by_epoch: list[int] | None
    allreduce_bytes_per_epoch_computed: int | None
    wire_sent_by_rank: list[dict[str, Any]] | None
    """Bytes each rank sent on --network-interface, per epoch (None without it)."""
    input_by_rank: list[dict[str, Any]] | None
    """Each rank's input and step times (training.input_metrics)."""
    input_summary: dict[str, Any] | None
    """The flags drawn from them, by rank."""
    resumed_after_epoch: int
    resumed_at: dict[str, Any] | None
    """A mid-epoch resume's epoch (from 1), step and what it did."""
    run_dir: str | None
    report: str | None = None
    """The model version's HTML report, once written."""

    _OPTIONAL = frozenset({"report"})

    def to_json(self) -> dict[str, Any]:
        return _json(self, self._OPTIONAL)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainResult:
        return cls(**_fields_from(cls, data, cls._OPTIONAL))

    @property
    def model_version(self) -> str:
        return f"{self.model_name}@{self.version}"

    def summary(self) -> str:
        return (
            f"{self.model_name}@{self.version}: test accuracy {self.test_accuracy:.4f} after "
            f"{self.epochs} epochs on {self.num_ranks} ranks ({self.train_seconds:.1f} s of "
            "training)"
        )


def train_result(dataset: str, manifest: Manifest, metrics: dict[str, Any]) -> TrainResult:
    return TrainResult(
        dataset=dataset,
        model_name=manifest.name,
        version=manifest.version,
        dataset_version=str(manifest.parents[0]),
        num_ranks=metrics["num_ranks"],
        epochs=metrics["epochs"],
        steps_per_epoch=metrics["steps_per_epoch"],
        test_accuracy=metrics["test_accuracy"],
        test_rows=metrics["test_rows"],
        train_seconds=metrics["train_seconds"],
        epoch_seconds=metrics.get("epoch_seconds"),
        batch_size=manifest.parameters.get("batch_size"),
        samples_per_second=metrics["samples_per_second"],
        history=metrics["history"],
        backward_passes_per_step=metrics["backward_passes_per_step"],
        compression=metrics["compression"],
        allreduce_bytes_per_epoch=metrics["allreduce_bytes_per_epoch"],
        allreduce_bytes_by_epoch=metrics.get("allreduce_bytes_by_epoch"),
        allreduce_bytes_per_epoch_computed=metrics.get("allreduce_bytes_per_epoch_computed"),
        wire_sent_by_rank=metrics.get("wire_sent_by_rank"),
        input_by_rank=metrics.get("input_by_rank"),
        input_summary=metrics.get("input_summary"),
        resumed_after_epoch=metrics["resumed_after_epoch"],
        resumed_at=metrics.get("resumed_at"),
        run_dir=manifest.extra.get("run_dir"),
    )


# --- the pipeline --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PipelineResult:
    """The pipeline flow's result: the train stage's, with the versions the run made before it
    (one flat JSON object, as ``shardflow run --json`` prints it)."""

    trained: TrainResult
    raw_version: str
    processed_version: str
    rows: int
    """Rows of the raw version."""
    flow_run_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            **self.trained.to_json(),
            "raw_version": self.raw_version,
            "processed_version": self.processed_version,
            "rows": self.rows,
            "flow_run_id": self.flow_run_id,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PipelineResult:
        return cls(
            trained=TrainResult.from_json(data),
            raw_version=data["raw_version"],
            processed_version=data["processed_version"],
            rows=data["rows"],
            flow_run_id=data["flow_run_id"],
        )

    def summary(self) -> str:
        return self.trained.summary()

    def summary_lines(self, api_url: str | None) -> list[str]:
        """What a person reads at the end of `shardflow run`: the accuracy, the three versions,
        the report and where the flow run is in the Prefect UI (``api_url``: the Prefect API
        the run used, if it outlives the command; else the UI of `shardflow server`)."""
        trained = self.trained
        flow_run = f"runs/flow-run/{self.flow_run_id}"
        if api_url:
            ui = f"{api_url.rstrip('/').removesuffix('/api')}/{flow_run}"
        else:
            ui = f"http://127.0.0.1:4200/{flow_run}  (after `shardflow server`)"
        lines = [
            "",
            f"{trained.dataset}: test accuracy {trained.test_accuracy:.2%} on "
            f"{trained.test_rows:,} test rows, {trained.epochs} epochs on "
            f"{trained.num_ranks} Horovod ranks ({trained.train_seconds:.0f} s of training)",
            f"  raw        {trained.dataset}@{self.raw_version}  ({self.rows:,} rows)",
            f"  processed  {trained.dataset_version}",
            f"  model      {trained.model_version}",
        ]
        if trained.report:
            lines.append(f"  report     {trained.report}")
        lines += [
            f"  Prefect    {ui}",
            f"  more       shardflow catalog lineage {trained.model_version}; --json for machines",
        ]
        return lines
