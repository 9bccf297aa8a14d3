"""What every experiment is, what it is asked, and the pipeline it runs on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from data_catalog.errors import ConfigError
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

    def __post_init__(self) -> None:
        if self.epochs is not None and (
            not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1
        ):
            raise ConfigError("epochs", f"must be a whole number of at least 1, got {self.epochs}")


class Pipeline(Protocol):
    """shardflow's own stages, as an experiment drives them."""

    def prepare(
        self,
        dataset: str,
        *,
        sample: Sample | None,
        synthetic_rows: int,
        rank_multiple: int | None = None,
    ) -> dict[str, Any]:
        """Ingest and preprocess ``dataset`` (only ``sample`` of its source when given; a
        synthetic source of ``synthetic_rows`` where no real one can be had) into a number of
        equal row groups that is a multiple of ``rank_multiple`` (None: the planner's
        default, 64: for 1, 2, 4 ... ranks; 60 serves 1 to 6); returns
        {"source": what was read, "synthetic": bool, "raw": ingest result, "processed":
        preprocess result}. The processed version is the latest, the one training reads."""
        ...

    def train(
        self,
        dataset: str,
        config: TrainConfig,
        launch: LaunchConfig | None = None,
        *,
        on: RankHosts | None = None,
    ) -> dict[str, Any]:
        """Train on the latest processed version of ``dataset`` and commit the model version;
        returns the train stage's result (flows.results.train_result's shape). ``launch``:
        where and how the ranks run (None: LaunchConfig's defaults).

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
