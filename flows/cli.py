"""The ``shardflow`` command: each stage on its own, or all three as one Prefect flow run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

IMAGE_DATASETS = ("mnist", "fashion-mnist")
# Every dataset can be ingested, preprocessed and trained on; `run` (one Prefect flow from
# ingest to model) takes the image sets that need no --source.
SOURCES = (*IMAGE_DATASETS, "cifar10", "sdss")
DEFAULT_HOME = "~/.shardflow"

EPILOG = """\
examples:
  shardflow run fashion-mnist --np 2 --epochs 3       ingest, preprocess, train (a Prefect flow)
  shardflow ingest mnist --source http://host/mnist/  fetch the four IDX files into the catalog
  shardflow preprocess mnist                          shards on a Dask LocalCluster
  shardflow train mnist --np 2 --epochs 5             horovodrun -np 2 on localhost (Gloo)
  shardflow synth sdss --rows 200000 --out exports/   calibrated synthetic CasJobs exports
  shardflow run sdss --source exports/ --np 2         the same pipeline for SDSS (model dnn)
  shardflow bench scaling fashion-mnist --json        samples/s on 2 ranks / 1 rank
  shardflow catalog lineage fashion-mnist-cnn         a model back to its raw files

Data and catalog live under $SHARDFLOW_HOME (default ~/.shardflow): catalog/ holds every
dataset and model version, runs/ the training runs' checkpoints and logs.
Design notes: docs/preprocessing.md, docs/training.md, docs/prefect.md in the repository.
"""


@dataclass(frozen=True, kw_only=True)
class Context:
    """What every command needs from the process edge."""

    home: Path
    as_json: bool
    verbose: bool
    debug: bool
    catalog_location: str | None = None
    """$SHARDFLOW_CATALOG: a path or an fsspec URL (s3://bucket/prefix); default
    $SHARDFLOW_HOME/catalog."""

    @property
    def catalog_root(self) -> str:
        return self.catalog_location or str(self.home / "catalog")

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def work_dir(self) -> Path:
        """Downloads and shards of unfinished work, kept so that a rerun resumes."""
        return self.home / "work"

    def catalog(self) -> Any:
        from data_catalog import Catalog

        return Catalog(self.catalog_root, index_url=os.environ.get("SHARDFLOW_CATALOG_URL"))

    def progress(self, message: str) -> None:
        """Progress of long work, on stderr: shown on a terminal or with --verbose, so that
        scripts reading stderr see nothing but a failure's one-line error."""
        if self.verbose:
            print(message, file=sys.stderr, flush=True)


def emit(ctx: Context, result: dict[str, Any], human: Sequence[str]) -> None:
    """Print the result: readable lines, or with --json one JSON object as the last line."""
    if ctx.as_json:
        print(json.dumps(result, sort_keys=True, default=str), flush=True)
    else:
        for line in human:
            print(line, flush=True)


# --- stages -------------------------------------------------------------------------------


def cmd_ingest(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    result = stages.ingest(
        ctx.catalog(),
        args.dataset,
        source=args.source,
        progress=ctx.progress,
        work_dir=ctx.work_dir,
        skyserver=_skyserver_options(args),
    )
    split = (
        f" ({result['train_rows']:,} train + {result['test_rows']:,} test)"
        if "train_rows" in result
        else ""
    )
    emit(
        ctx,
        result,
        [
            f"{args.dataset}@{result['version']}: {result['rows']:,} rows{split} "
            f"in {result['files']} files"
        ],
    )
    return 0


def cmd_synth(ctx: Context, args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser().resolve()
    if args.dataset == "sdss":
        from preprocessing.sources.synth import write_sdss_exports

        paths = write_sdss_exports(
            out, rows=args.rows, files=args.files, fmt=args.format, seed=args.seed
        )
        what = f"{args.rows:,} synthetic SDSS rows in {len(paths)} {args.format} files"
    elif args.dataset == "cifar10":
        from preprocessing.sources.synth_images import write_cifar10_set

        if args.source is None:
            raise ShardflowError("synth cifar10 needs --source: real CIFAR-10 batches to draw on")
        test_rows = args.test_rows or max(1, args.rows // 5)
        paths = write_cifar10_set(
            args.source, out, train_rows=args.rows, test_rows=test_rows, seed=args.seed
        )
        what = f"{args.rows:,} + {test_rows:,} synthetic cifar10 images from {args.source}"
    else:
        from preprocessing.sources.mnist import DEBIAN_FASHION_MNIST
        from preprocessing.sources.synth_images import write_image_set

        pool = args.source or (DEBIAN_FASHION_MNIST if args.dataset == "fashion-mnist" else None)
        if pool is None:
            raise ShardflowError(f"synth {args.dataset} needs --source: a folder of real IDX files")
        test_rows = args.test_rows or max(1, args.rows // 6)
        paths = write_image_set(
            args.dataset, Path(pool), out, train_rows=args.rows, test_rows=test_rows, seed=args.seed
        )
        what = f"{args.rows:,} + {test_rows:,} synthetic {args.dataset} images from {pool}"
    emit(
        ctx,
        {
            "dataset": args.dataset,
            "synthetic": True,
            "rows": args.rows,
            "files": [str(p) for p in paths],
        },
        [f"wrote {what} under {out}"],
    )
    return 0


def cmd_preprocess(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    result = stages.preprocess(
        ctx.catalog(),
        args.dataset,
        workers=args.workers,
        scheduler=args.scheduler,
        memory_limit=args.memory_limit,
        work_dir=ctx.work_dir,
        options=_job_options(args),
        progress=ctx.progress,
    )
    splits = ", ".join(f"{n:,} {split}" for split, n in _split_rows(result).items())
    quarantined = result.get("quarantine", {}).get("rows")
    emit(
        ctx,
        result,
        [
            f"{result['name']}@{result['version']}: {splits} rows in {result['num_files']} "
            f"files ({result['format']})"
            + (f"; {quarantined:,} rows quarantined" if quarantined is not None else "")
        ],
    )
    return 0


def cmd_train(ctx: Context, args: argparse.Namespace) -> int:
    from flows import stages

    result = stages.train(
        ctx.catalog(),
        args.dataset,
        runs_dir=ctx.runs_dir,
        progress=ctx.progress,
        **_train_options(args),
    )
    emit(ctx, result, _train_summary(result))
    return 0


def cmd_run(ctx: Context, args: argparse.Namespace) -> int:
    if not ctx.verbose:
        # Prefect's console log stays quiet (the flow run's logs still reach its API and UI).
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    if ctx.debug:
        os.environ["SHARDFLOW_DEBUG"] = "1"
    from flows.pipeline import pipeline
    from preprocessing.engine import ClusterConfig
    from training.launcher import TrainConfig

    # Refuse a bad cluster option now, not after the ingest stage has run.
    ClusterConfig(workers=args.workers, memory_limit=args.memory_limit)
    result = pipeline(
        dataset=args.dataset,
        home=str(ctx.home),
        source=args.source,
        skyserver=_skyserver_options(args),
        workers=args.workers,
        scheduler=args.scheduler,
        memory_limit=args.memory_limit,
        options=_job_options(args),
        train=TrainConfig(**_train_options(args)),
    )
    emit(ctx, result, _train_summary(result))
    return 0


def _split_rows(result: dict[str, Any]) -> dict[str, int]:
    return {split: int(stats["rows"]) for split, stats in result["splits"].items()}


def _job_options(args: argparse.Namespace) -> Any:
    from preprocessing.engine import JobOptions
    from preprocessing.plan import PlanConfig

    try:
        plan = PlanConfig(
            rank_multiple=args.rank_multiple,
            remainder=args.remainder,
            target_rows_per_group=args.rows_per_group,
        )
    except ValueError as exc:
        raise ShardflowError(str(exc)) from exc
    return JobOptions(
        plan=plan,
        format=args.format,
        validation_fraction=args.validation_fraction,
        test_fraction=args.test_fraction,
    )


def _train_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_ranks": args.np,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "model": args.model or ("dnn" if args.dataset == "sdss" else "cnn"),
        "learning_rate": args.lr,
        "seed": args.seed,
        "hosts": args.hosts,
        "hostfile": args.hostfile,
        "controller": args.controller,
        "backward_passes_per_step": args.backward_passes_per_step,
        "compression": args.compression,
        "resume": args.resume,
        "timeline": args.timeline,
        "augment": args.augment,
    }


def _train_summary(result: dict[str, Any]) -> list[str]:
    return [
        f"{result['model_name']}@{result['version']}: test accuracy "
        f"{result['test_accuracy']:.4f} after {result['epochs']} epochs on "
        f"{result['num_ranks']} ranks ({result['train_seconds']:.1f} s of training)"
    ]


POOL = "shardflow-process"


def _repository() -> Path:
    """The checkout the flows are loaded from (deployments point workers at it)."""
    import flows

    root = Path(flows.__file__).resolve().parent.parent
    if not (root / "deploy" / "prefect.yaml").exists():
        raise ShardflowError(
            f"{root} has no deploy/prefect.yaml: deploy from a checkout (pip install -e .)"
        )
    return root


def _prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "prefect"), "--no-prompt", *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=_repository())
    if check and proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
        raise ShardflowError(f"`prefect {' '.join(args)}` failed: {' '.join(last)}")
    return proc


def cmd_server(ctx: Context, args: argparse.Namespace) -> int:
    """Run a local Prefect server (API + UI) in the foreground."""
    url = f"http://{args.host}:{args.port}"
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The UI asks this URL for its data; Prefect's default assumes port 4200.
        "PREFECT_UI_API_URL": f"{url}/api",
    }
    print(
        f"Prefect UI {url} ; in other shells: export PREFECT_API_URL={url}/api",
        file=sys.stderr,
        flush=True,
    )
    command = [
        str(Path(sys.executable).parent / "prefect"),
        "server",
        "start",
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 0


def cmd_deploy(ctx: Context, args: argparse.Namespace) -> int:
    """Create the process work pool and register deploy/prefect.yaml's deployments."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ShardflowError(
            "PREFECT_API_URL is not set: start a server (`shardflow server`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api, or point it at a shared server"
        )
    existing = _prefect("work-pool", "inspect", POOL, check=False)
    if existing.returncode != 0:
        _prefect("work-pool", "create", POOL, "--type", "process")
        ctx.progress(f"created work pool {POOL}")
    _prefect("deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_names = {f.id: f.name for f in client.read_flows()}
        names = sorted(
            f"{flow_names[d.flow_id]}/{d.name}"
            for d in client.read_deployments()
            if flow_names.get(d.flow_id, "").startswith("shardflow-")
        )
    emit(
        ctx,
        {"work_pool": POOL, "deployments": names},
        [f"deployed {name}" for name in names]
        + [f"start a worker: prefect worker start --pool {POOL}"],
    )
    return 0


def cmd_bench(ctx: Context, args: argparse.Namespace) -> int:
    from training import bench

    catalog = ctx.catalog()
    if args.benchmark == "preprocess":
        from preprocessing.bench import bench_preprocess

        result = bench_preprocess(catalog, args.dataset, progress=ctx.progress)
        emit(
            ctx,
            result,
            [
                f"rows/s, 2 Dask workers ÷ single-process pyarrow: {result['ratio']:.3f}",
                "peak RSS per worker: "
                + ", ".join(f"{b / 2**20:.0f} MiB" for b in result["peak_rss_bytes_per_worker"]),
            ],
        )
        return 0
    if args.benchmark == "aggregation":
        result = bench.bench_aggregation(
            catalog,
            args.dataset,
            runs_dir=ctx.runs_dir,
            epochs=args.epochs,
            progress=ctx.progress,
        )
        lines = ["ranks  passes/step  allreduce MB/epoch  test accuracy"] + [
            f"{r['num_ranks']:5}  {r['backward_passes_per_step']:11}  "
            f"{r['allreduce_bytes_per_epoch'] / 1e6:18.1f}  {r['test_accuracy']:13.4f}"
            for r in result["rows"]
        ]
        emit(ctx, result, lines)
        return 0
    sizes = {
        k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size)) if v is not None
    }
    if args.benchmark == "reader":
        result = bench.bench_reader(catalog, args.dataset, progress=ctx.progress, **sizes)
        human = f"streaming ÷ in-memory epoch time: {result['ratio']:.3f}"
    else:
        result = bench.bench_scaling(catalog, args.dataset, progress=ctx.progress, **sizes)
        human = f"samples/s, 2 ranks ÷ 1 rank (1 thread each): {result['ratio']:.3f}"
    emit(ctx, result, [human])
    return 0


# --- catalog -------------------------------------------------------------------------------


def _split_ref(ref: str) -> tuple[str, str | None]:
    name, _, version = ref.partition("@")
    return name, version or None


def manifest_json(catalog: Any, manifest: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(manifest.to_json())
    data["files"] = [
        {**entry, "path": catalog.file_url(manifest, file)}
        for entry, file in zip(data["files"], manifest.files, strict=True)
    ]
    data["directory"] = catalog.version_url(manifest.name, manifest.version)
    return data


def cmd_catalog_list(ctx: Context, args: argparse.Namespace) -> int:
    catalog = ctx.catalog()
    rows = []
    for name in catalog.names():
        versions = catalog.versions(name)
        latest = versions[-1]
        rows.append(
            {
                "name": name,
                "kind": latest.kind,
                "latest": latest.version,
                "versions": len(versions),
                "rows": latest.rows,
                "created": latest.created,
            }
        )
    lines = [f"{'NAME':32} {'KIND':10} {'LATEST':17} {'VERSIONS':>8} {'ROWS':>12}"]
    lines += [
        f"{r['name']:32} {r['kind']:10} {r['latest']:17} {r['versions']:>8} {r['rows']:>12,}"
        for r in rows
    ]
    if not rows:
        lines = [f"the catalog at {ctx.catalog_root} is empty; start with `shardflow ingest`"]
    emit(ctx, {"datasets": rows, "root": str(ctx.catalog_root)}, lines)
    return 0


def cmd_catalog_show(ctx: Context, args: argparse.Namespace) -> int:
    catalog = ctx.catalog()
    name, version = _split_ref(args.ref)
    manifest = catalog.get(name, version)
    data = manifest_json(catalog, manifest)
    lines = [
        f"{manifest.name}@{manifest.version} ({manifest.kind}), {manifest.rows:,} rows, "
        f"created {manifest.created}, code {manifest.code_version}"
    ]
    lines += [f"  parent {p.name}@{p.version}" for p in manifest.parents]
    lines += [f"  source {s.get('uri', s)}" for s in manifest.sources]
    lines += [f"  {f['path']}  rows={f['rows']}  sha256={f['sha256'][:12]}…" for f in data["files"]]
    emit(ctx, data, lines)
    return 0


def cmd_catalog_verify(ctx: Context, args: argparse.Namespace) -> int:
    catalog = ctx.catalog()
    name, version = _split_ref(args.ref) if args.ref else (None, None)
    if name is not None:
        catalog.get(name, version)  # an unknown name is an error, not a clean bill of health
    problems = catalog.verify(name, version)
    result = {
        "ok": not problems,
        "problems": [{"path": p.path, "reason": p.reason} for p in problems],
    }
    lines = [f"BAD {p.path}: {p.reason}" for p in problems] or ["all files match their manifests"]
    emit(ctx, result, lines)
    if problems:
        for p in problems:
            print(f"shardflow: verify: {p.path}: {p.reason}", file=sys.stderr)
        return 1
    return 0


def cmd_catalog_lineage(ctx: Context, args: argparse.Namespace) -> int:
    name, version = _split_ref(args.ref)
    tree = ctx.catalog().lineage(name, version)

    def render(node: dict[str, Any], depth: int) -> list[str]:
        label = f"{node['name']}@{node['version']}"
        if node.get("missing"):
            label += " (missing from catalog)"
        else:
            label += f" ({node.get('kind')})"
        out = ["  " * depth + label]
        out += ["  " * (depth + 1) + f"source {s.get('uri', s)}" for s in node.get("sources", [])]
        for parent in node.get("parents", []):
            out += render(parent, depth + 1)
        return out

    emit(ctx, tree, render(tree, 0))
    return 0


def cmd_catalog_gc(ctx: Context, args: argparse.Namespace) -> int:
    catalog = ctx.catalog()
    removed = catalog.gc() if catalog.is_local else catalog.gc_urls()
    emit(
        ctx,
        {"removed": [str(p) for p in removed]},
        [f"removed {p}" for p in removed] or ["nothing to remove"],
    )
    return 0


def cmd_catalog_reindex(ctx: Context, args: argparse.Namespace) -> int:
    count = ctx.catalog().reindex()
    emit(ctx, {"versions": count}, [f"indexed {count} versions"])
    return 0


# --- parser --------------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on the last line of stdout",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show progress on stderr even when it is not a terminal",
    )


def _add_dataset(parser: argparse.ArgumentParser, choices: tuple[str, ...] = SOURCES) -> None:
    parser.add_argument(
        "dataset",
        choices=choices,
        metavar="DATASET",
        help=f"one of: {', '.join(choices)}",
    )


def _add_ingest_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        metavar="URI",
        help="sdss: a directory or glob of CasJobs exports (CSV, FITS, VOTable); cifar10: a "
        "directory of batches, a .tar.gz or its URL; mnist, fashion-mnist: directory or URL "
        "(file://, http(s)://, s3://...) holding train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each raw "
        "or .gz (default: fashion-mnist from Debian's dataset-fashion-mnist, else upstream; "
        "mnist from the upstream mirrors, digests checked)",
    )
    parser.add_argument(
        "--skyserver-url",
        default="https://skyserver.sdss.org",
        metavar="URL",
        help="sdss without --source: SkyServer base URL, for mirrors "
        "(default: https://skyserver.sdss.org)",
    )
    parser.add_argument(
        "--data-release",
        type=_positive,
        default=17,
        metavar="N",
        help="sdss without --source: data release (default: 17)",
    )
    parser.add_argument(
        "--limit",
        type=_positive,
        metavar="N",
        help="sdss without --source: fetch at most N rows (default: all that match)",
    )


def _skyserver_options(args: argparse.Namespace) -> Any:
    from preprocessing.sources.sdss import SkyServerOptions

    return SkyServerOptions(
        url=args.skyserver_url, data_release=args.data_release, limit=args.limit
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _add_preprocess_options(parser: argparse.ArgumentParser) -> None:
    from preprocessing.engine import DEFAULT_MEMORY_LIMIT, usable_cores

    parser.add_argument(
        "--rank-multiple",
        type=_positive,
        default=64,
        metavar="M",
        help="training row groups are equal and their count a multiple of M, so that up to M "
        "ranks (any divisor of M) get equal, whole row groups (default: 64)",
    )
    parser.add_argument(
        "--remainder",
        choices=("drop", "pad"),
        default="drop",
        help="training rows that do not fill equal row groups: drop them (every sample read "
        "once per epoch) or pad by repeating the first rows; counted in the manifest "
        "(default: drop)",
    )
    parser.add_argument(
        "--rows-per-group",
        type=_positive,
        default=1000,
        metavar="N",
        help="target rows per row group, the unit a rank reads (default: 1000)",
    )
    parser.add_argument(
        "--format",
        choices=("parquet", "petastorm"),
        help="parquet (petastorm make_batch_reader) or a Petastorm dataset with a Unischema "
        "(make_reader); default: petastorm for cifar10, parquet for the others",
    )
    parser.add_argument(
        "--validation-fraction",
        type=_fraction,
        metavar="F",
        help="share of the training source hashed (by sample id) into the validation split "
        "(default: 0.05 for images, 0.1 for sdss)",
    )
    parser.add_argument(
        "--test-fraction",
        type=_fraction,
        metavar="F",
        help="share hashed into the test split, for sources without an official one "
        "(sdss; default 0.1)",
    )
    parser.add_argument(
        "--workers",
        type=_positive,
        default=usable_cores(),
        metavar="N",
        help="Dask LocalCluster worker processes, one thread each "
        f"(default: one per usable core, here {usable_cores()})",
    )
    parser.add_argument(
        "--memory-limit",
        default=DEFAULT_MEMORY_LIMIT,
        metavar="SIZE",
        help="memory limit of each LocalCluster worker; Dask pauses a worker at 80%% of it "
        f"and restarts it at 95%% (default: {DEFAULT_MEMORY_LIMIT})",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="use an existing Dask scheduler (tcp://host:8786) instead of a "
        "LocalCluster; its workers must see $SHARDFLOW_HOME",
    )


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    from training import models

    parser.add_argument(
        "--np", type=_positive, default=2, help="Horovod ranks (horovodrun -np; default: 2)"
    )
    parser.add_argument("--epochs", type=_positive, default=3, help="default: 3")
    parser.add_argument(
        "--batch-size",
        type=_positive,
        default=32,
        help="per rank; the global batch is this times --np (default: 32)",
    )
    parser.add_argument(
        "--model",
        choices=models.MODELS,
        help="images: cnn (default), mobilenetv2, resnet50 (Keras applications, random init); "
        "sdss: dnn (default)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.001,
        help="learning rate for one rank, scaled by --np (default: 0.001)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    parser.add_argument(
        "--hosts", metavar="HOST:SLOTS,...", help="horovodrun -H (default: localhost:NP)"
    )
    parser.add_argument(
        "--hostfile",
        metavar="FILE",
        help="horovodrun --hostfile: one 'HOST slots=N' per line, instead of --hosts",
    )
    parser.add_argument(
        "--controller",
        choices=("gloo", "mpi"),
        default="gloo",
        help="Horovod's controller: gloo (always built) or mpi (needs Horovod built with MPI; "
        "default: gloo)",
    )
    parser.add_argument(
        "--backward-passes-per-step",
        type=_positive,
        default=1,
        metavar="K",
        help="sum gradients of K local batches before each allreduce: K times less traffic "
        "(default: 1)",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "fp16"),
        default="none",
        help="compress gradients for allreduce (default: none)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same configuration from its last checkpoint",
    )
    parser.add_argument(
        "--augment",
        action="store_true",
        help="random shifts of up to 2 pixels while training, for small training sets",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="record Horovod's timeline (chrome://tracing JSON) in the run directory",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Raw data to a trained model: ingest → Dask preprocessing → Parquet shards "
        "→ Horovod data-parallel training, every step a catalog version.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ingest = commands.add_parser("ingest", help="fetch raw data into a new raw version")
    ingest.add_argument(
        "dataset", choices=SOURCES, metavar="DATASET", help=f"one of: {', '.join(SOURCES)}"
    )
    _add_ingest_options(ingest)
    ingest.set_defaults(handler=cmd_ingest)

    preprocess = commands.add_parser(
        "preprocess", help="latest raw version → Parquet or Petastorm shards on Dask"
    )
    _add_dataset(preprocess)
    _add_preprocess_options(preprocess)
    preprocess.set_defaults(handler=cmd_preprocess)

    train = commands.add_parser("train", help="train with horovodrun on the processed shards")
    _add_dataset(train)
    _add_train_options(train)
    train.set_defaults(handler=cmd_train)

    run = commands.add_parser("run", help="ingest, preprocess and train as one Prefect flow run")
    _add_dataset(run)
    _add_ingest_options(run)
    _add_preprocess_options(run)
    _add_train_options(run)
    run.set_defaults(handler=cmd_run)

    bench = commands.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bench.add_argument(
        "benchmark",
        choices=("preprocess", "reader", "scaling", "aggregation"),
        help="preprocess: rows/s with 2 Dask workers ÷ a single-process baseline; "
        "reader: streaming ÷ in-memory epoch time; "
        "scaling: samples/s on 2 ranks ÷ 1 rank, one thread per rank; "
        "aggregation: ranks x backward passes per step -> allreduce bytes, test accuracy",
    )
    _add_dataset(bench)
    bench.add_argument(
        "--steps", type=_positive, help="steps timed per run (default: reader 300, scaling 100)"
    )
    bench.add_argument(
        "--batch-size", type=_positive, help="per rank (default: reader 32, scaling 128)"
    )
    bench.add_argument(
        "--epochs", type=_positive, default=3, help="aggregation: epochs per run (default: 3)"
    )
    _add_common(bench)
    bench.set_defaults(handler=cmd_bench)

    server = commands.add_parser(
        "server", help="run a local Prefect server and UI (loopback, analytics off)"
    )
    server.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    server.add_argument("--port", type=_positive, default=4200, help="default: 4200")
    _add_common(server)
    server.set_defaults(handler=cmd_server)

    deploy = commands.add_parser(
        "deploy", help="register the Prefect deployments of deploy/prefect.yaml"
    )
    _add_common(deploy)
    deploy.set_defaults(handler=cmd_deploy)

    synth = commands.add_parser(
        "synth",
        help="write synthetic data marked synthetic: calibrated SDSS exports (CasJobs style), "
        "or image sets made from real images",
    )
    synth.add_argument(
        "dataset",
        choices=("sdss", *IMAGE_DATASETS, "cifar10"),
        metavar="DATASET",
        help=f"one of: sdss, {', '.join(IMAGE_DATASETS)}, cifar10",
    )
    synth.add_argument(
        "--rows", type=_positive, required=True, help="rows in all (images: training rows)"
    )
    synth.add_argument("--test-rows", type=_positive, help="images: test rows (default: rows / 6)")
    synth.add_argument(
        "--source",
        metavar="DIR",
        help="images: the pool of real IDX files (default for fashion-mnist: "
        "Debian's dataset-fashion-mnist)",
    )
    synth.add_argument("--files", type=_positive, default=1, help="sdss: files (default: 1)")
    synth.add_argument("--format", choices=("csv", "fits"), default="csv", help="default: csv")
    synth.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    synth.add_argument("--seed", type=int, default=0, help="default: 0")
    _add_common(synth)
    synth.set_defaults(handler=cmd_synth)

    catalog = commands.add_parser("catalog", help="list, show, verify dataset and model versions")
    actions = catalog.add_subparsers(dest="action", required=True, metavar="ACTION")
    handlers: dict[str, tuple[Callable[[Context, argparse.Namespace], int], str, str | None]] = {
        "list": (cmd_catalog_list, "every dataset and model with its latest version", None),
        "show": (
            cmd_catalog_show,
            "one version's manifest (default: the latest)",
            "NAME[@VERSION]",
        ),
        "verify": (
            cmd_catalog_verify,
            "recompute every file's digest; non-zero exit on damage",
            "[NAME[@VERSION]]",
        ),
        "lineage": (
            cmd_catalog_lineage,
            "the tree of parents back to the raw sources",
            "NAME[@VERSION]",
        ),
        "gc": (cmd_catalog_gc, "remove leftover staging and uncommitted files", None),
        "reindex": (cmd_catalog_reindex, "rebuild the index from the manifests", None),
    }
    for action, (handler, help_text, ref) in handlers.items():
        sub = actions.add_parser(action, help=help_text)
        if ref is not None:
            sub.add_argument("ref", metavar=ref, nargs="?" if ref.startswith("[") else None)
        _add_common(sub)
        sub.set_defaults(handler=handler)

    for sub in (ingest, preprocess, train, run):
        _add_common(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ctx = Context(
        home=Path(os.environ.get("SHARDFLOW_HOME", DEFAULT_HOME)).expanduser().resolve(),
        as_json=args.json,
        verbose=args.verbose or sys.stderr.isatty(),
        debug=args.debug,
        catalog_location=os.environ.get("SHARDFLOW_CATALOG") or None,
    )
    try:
        return int(args.handler(ctx, args))
    except ShardflowError as exc:
        if args.debug:
            raise
        print(f"shardflow: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardflow: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"shardflow: internal error: {type(exc).__name__}: {message} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
