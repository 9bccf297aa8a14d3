"""What every experiment is, what it is asked, and the pipeline it runs on."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from data_catalog.errors import ConfigError, ShardflowError
from lab.netns import RankHosts
from training.config import LaunchConfig, TrainConfig


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A small, class-spread subset of a dataset's source, for ``--quick`` runs."""

    train_rows: int
    test_rows: int


@dataclass(frozen=True, kw_only=True)
class ExperimentRequest:
    """What a user chooses about an experiment run."""

    out: Path
    """The results folder: report.md, results.json and the plots (made if missing)."""
    quick: bool = False
    """Tiny subsets and one epoch: the code paths, not the paper's numbers."""
    epochs: int | None = None
    """Epochs of every training run; None: the experiment's own choice (1 when ``quick``)."""
    seeds: int = 1
    """Each row trained with seeds 0 .. seeds-1 and reported as the mean with its spread
    (:func:`lab.experiments.report.folded`); experiments with seeds of their own (horovod-vs-ray)
    keep theirs."""

    def __post_init__(self) -> None:
        for name in ("epochs", "seeds"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(name, f"must be a whole number of at least 1, got {value}")

    @property
    def seed_list(self) -> list[int]:
        """The seeds every row is trained with."""
        return list(range(self.seeds))


# What an experiment reads of the stages' results. The flows layer defines the results
# (flows.results: IngestResult, PreprocessResult, TrainResult) and hands them in; these
# protocols name the attributes the experiments read, so that the lab needs no flows import.


class RawVersion(Protocol):
    """The ingest stage's result."""

    @property
    def dataset(self) -> str: ...

    @property
    def version(self) -> str: ...


class ProcessedVersion(Protocol):
    """The preprocess stage's result."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def splits(self) -> Mapping[str, Mapping[str, Any]]:
        """Each split's statistics (``rows`` among them)."""
        ...


class TrainedModel(Protocol):
    """The train stage's result."""

    @property
    def model_name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def model_version(self) -> str:
        """ "<model_name>@<version>"."""
        ...

    @property
    def dataset_version(self) -> str: ...

    @property
    def num_ranks(self) -> int: ...

    @property
    def epochs(self) -> int: ...

    @property
    def steps_per_epoch(self) -> int: ...

    @property
    def batch_size(self) -> int | None: ...

    @property
    def test_accuracy(self) -> float: ...

    @property
    def test_rows(self) -> int: ...

    @property
    def train_seconds(self) -> float: ...

    @property
    def epoch_seconds(self) -> list[float] | None: ...

    @property
    def samples_per_second(self) -> float: ...

    @property
    def allreduce_bytes_by_epoch(self) -> list[int] | None: ...

    @property
    def wire_sent_by_rank(self) -> list[dict[str, Any]] | None: ...

    @property
    def run_dir(self) -> str | None: ...


def run_metrics(trained: TrainedModel) -> dict[str, Any]:
    """Everything rank 0 measured in the training run (its run folder's metrics.json), beyond
    what the stage's result carries."""
    if trained.run_dir is None:
        raise ShardflowError(f"{trained.model_version} names no run folder to read metrics from")
    metrics: dict[str, Any] = json.loads((Path(trained.run_dir) / "metrics.json").read_text())
    return metrics


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A dataset ingested and preprocessed for an experiment."""

    source: str
    """What was read, in words, for the report."""
    synthetic: bool
    raw: RawVersion
    processed: ProcessedVersion
    """The latest processed version: the one training reads."""

    @property
    def raw_version(self) -> str:
        return f"{self.raw.dataset}@{self.raw.version}"

    @property
    def processed_version(self) -> str:
        return f"{self.processed.name}@{self.processed.version}"


class Pipeline(Protocol):
    """shardflow's own stages, as an experiment drives them."""

    def prepare(
        self,
        dataset: str,
        *,
        sample: Sample | None,
        synthetic_rows: int,
        rank_multiple: int | None = None,
    ) -> Prepared:
        """Ingest and preprocess ``dataset`` (only ``sample`` of its source when given; a
        synthetic source of ``synthetic_rows`` where no real one can be had) into a number of
        equal row groups that is a multiple of ``rank_multiple`` (None: the planner's
        default, 64: for 1, 2, 4 ... ranks; 60 serves 1 to 6)."""
        ...

    def train(
        self,
        dataset: str,
        config: TrainConfig,
        launch: LaunchConfig | None = None,
        *,
        on: RankHosts | None = None,
    ) -> TrainedModel:
        """Train on the latest processed version of ``dataset`` and commit the model version;
        returns the train stage's result. ``launch``: where and how the ranks run (None:
        LaunchConfig's defaults).

        ``on``: namespaced hosts (lab.netns.rank_hosts): horovodrun runs in their head
        and reaches the ranks by ssh (``launch`` names the rank hosts:
        :meth:`RankHosts.launch_config`); None: horovodrun here, ranks on this host."""
        ...

    def progress(self, message: str) -> None:
        """Show progress of long work."""
        ...


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One experiment of issue #16: what it measures and how to run it."""

    name: str
    seed: str
    """The paper or report whose experiment this reproduces."""
    measures: str
    """One line for --help: what is compared, what is measured."""
    full_duration: str
    """How long the full run takes on this machine (2 CPU cores), for --help."""
    datasets: tuple[str, ...]
    """Datasets it reads; each gets a ``--<dataset>-source`` flag."""
    run: Callable[[ExperimentRequest, Pipeline], dict[str, Any]]
    """Runs it and writes the report; returns the JSON-ready result: its own keys, and
    ``summary`` (lines the command prints without --json), ``report`` (report.md's path),
    ``plots`` (the PNGs' paths)."""
