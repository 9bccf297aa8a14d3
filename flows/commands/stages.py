"""`shardflow ingest | preprocess | train | run | synth`."""

from __future__ import annotations

import argparse
import glob
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from data_catalog.errors import ConfigError
from flows import options, results
from flows.console import Context
from preprocessing import datasets


def _dataset_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dataset",
        choices=datasets.NAMES,
        metavar="DATASET",
        help=f"one of: {', '.join(datasets.NAMES)}",
    )


def _ingest_request(args: argparse.Namespace) -> Any:
    from preprocessing.datasets import IngestRequest, SkyServerOptions

    skyserver = options.build(SkyServerOptions, args, "skyserver")
    return options.build(IngestRequest, args, "ingest", skyserver=skyserver)


def _job_options(args: argparse.Namespace) -> Any:
    from preprocessing.config import JobOptions
    from preprocessing.plan import PlanConfig

    return options.build(JobOptions, args, "job", plan=options.build(PlanConfig, args, "plan"))


def _cluster(args: argparse.Namespace) -> Any:
    from preprocessing.config import ClusterConfig

    return options.build(ClusterConfig, args, "cluster")


def _train_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """(TrainConfig, LaunchConfig) of the flags, checked together."""
    from training.config import LaunchConfig, TrainConfig, check_launch

    train = options.build(TrainConfig, args, "train")
    launch = options.build(LaunchConfig, args, "launch")
    check_launch(train, launch)
    return train, launch


def _quiet_libraries(ctx: Context) -> None:
    """Without --verbose, stderr holds nothing but a failure's one line: keep the libraries'
    warnings (astropy on a damaged FITS file, in the Dask workers too) and TensorFlow's
    start-up lines off it. The workers of a LocalCluster inherit this environment."""
    if ctx.verbose:
        return
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    warnings.simplefilter("ignore")


def cmd_ingest(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    _quiet_libraries(ctx)
    request, cluster = _ingest_request(args), _cluster(args)
    with ctx.pass_progress() as on_progress:
        result = stages.ingest(
            ctx.settings,
            ctx.settings.catalog(),
            datasets.dataset(args.dataset),
            request,
            runner=stages.dask_runners(cluster, ctx.progress),
            progress=ctx.progress,
            on_progress=on_progress,
        )
    ctx.emit(result.to_json(), [result.summary()])
    return 0


def cmd_preprocess(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    _quiet_libraries(ctx)
    options, cluster = _job_options(args), _cluster(args)
    with ctx.pass_progress() as on_progress:
        result = stages.preprocess(
            ctx.settings,
            ctx.settings.catalog(),
            datasets.dataset(args.dataset),
            options=options,
            runner=stages.dask_runners(cluster, ctx.progress),
            progress=ctx.progress,
            on_progress=on_progress,
        )
    ctx.emit(result.to_json(), [result.summary()])
    return 0


def cmd_train(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    _quiet_libraries(ctx)
    train, launch = _train_configs(args)
    result = stages.train(
        ctx.settings,
        ctx.settings.catalog(),
        datasets.dataset(args.dataset),
        train,
        launch,
        progress=ctx.progress,
    )
    ctx.emit(result.to_json(), [result.summary()])
    return 0


def cmd_run(ctx: Context, args: argparse.Namespace) -> int:
    from flows.prefect_server import api_for_this_command

    # Every option is checked before any stage runs (or any server starts).
    request, job, cluster, (train, launch) = (
        _ingest_request(args),
        _job_options(args),
        _cluster(args),
        _train_configs(args),
    )
    if cluster.cluster != "local":
        raise ConfigError(
            "cluster",
            f"`run` drives its stages on a LocalCluster or --scheduler, not {cluster.cluster!r}: "
            "run ingest, preprocess --cluster slurm and train --launcher slurm one by one "
            "(deploy/slurm/pipeline.sbatch)",
        )
    # The options first, then the filesystem.
    source = request.source
    if source and "://" not in source:
        # A mistyped path is said now, not after the Prefect server started (15-25 s).
        local = os.path.expanduser(source)
        if not os.path.exists(local) and not glob.glob(local):
            raise ConfigError("source", f"{source}: no such directory or file, and no glob match")
    _quiet_libraries(ctx)
    if not ctx.verbose:
        # Prefect's console log stays quiet (the flow run's logs still reach its API and UI).
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    if ctx.debug:
        os.environ["SHARDFLOW_DEBUG"] = "1"
    # A server this command starts stops with it: the UI link then points at `shardflow server`.
    configured_api = bool(os.environ.get("PREFECT_API_URL"))
    with api_for_this_command(ctx.settings.home / "logs", ctx.progress):
        from flows.pipeline import pipeline

        result = pipeline(
            dataset=args.dataset,
            home=str(ctx.settings.home),
            source=request.source,
            skyserver=request.skyserver,
            cluster=cluster,
            options=job,
            train=train,
            launch=launch,
            train_timeout_seconds=args.train_timeout,
        )
    api_url = os.environ.get("PREFECT_API_URL") if configured_api else None
    ctx.emit(result, results.PipelineResult.from_json(result).summary_lines(api_url))
    return 0


def cmd_synth(ctx: Context, args: argparse.Namespace) -> int:
    from preprocessing.datasets import SynthRequest

    request = options.build(SynthRequest, args, "synth")
    request = replace(request, out=_writable_folder(Path(request.out).expanduser().resolve()))
    paths = datasets.dataset(args.dataset).synth(request)
    ctx.emit(
        {
            "dataset": args.dataset,
            "synthetic": True,
            "rows": request.rows,
            "files": [str(p) for p in paths],
        },
        [
            f"wrote {request.rows:,} synthetic {args.dataset} rows in {len(paths)} files under "
            f"{request.out}"
        ],
    )
    return 0


def _writable_folder(out: Path) -> Path:
    """``out`` if it is a folder, or can be made one, that this process may write into;
    nothing is created here (a request refused later leaves nothing behind)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} is a file: give a folder (it is made if missing)")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("out", f"{out} cannot be made: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("out", f"{out} cannot be written: {existing} is not writable")
    return out


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add the stage commands to the ``commands`` subparsers."""
    ingest = commands.add_parser(
        "ingest", parents=[common], help="fetch raw data into a new raw version"
    )
    _dataset_argument(ingest)
    for group in ("ingest", "skyserver", "cluster"):
        options.add_flags(ingest, group)
    ingest.set_defaults(handler=cmd_ingest)

    preprocess = commands.add_parser(
        "preprocess",
        parents=[common],
        help="latest raw version → Parquet or Petastorm shards on Dask",
    )
    _dataset_argument(preprocess)
    for group in ("plan", "job", "cluster"):
        options.add_flags(preprocess, group)
    preprocess.set_defaults(handler=cmd_preprocess)

    train = commands.add_parser(
        "train", parents=[common], help="train with horovodrun on the processed shards"
    )
    _dataset_argument(train)
    for group in ("train", "launch"):
        options.add_flags(train, group)
    train.set_defaults(handler=cmd_train)

    run = commands.add_parser(
        "run", parents=[common], help="ingest, preprocess and train as one Prefect flow run"
    )
    _dataset_argument(run)
    for group in ("ingest", "skyserver", "plan", "job", "cluster", "train", "launch"):
        options.add_flags(run, group)
    run.add_argument(
        "--train-timeout",
        type=options.positive_seconds,
        default=None,
        metavar="SECONDS",
        help="fail training that runs longer, horovodrun and its ranks stopped; default: none",
    )
    run.set_defaults(handler=cmd_run)

    synth = commands.add_parser(
        "synth",
        parents=[common],
        help="write synthetic data marked synthetic: calibrated SDSS exports (CasJobs style), "
        "or image sets made from real images",
    )
    _dataset_argument(synth)
    options.add_flags(synth, "synth")
    synth.set_defaults(handler=cmd_synth)
