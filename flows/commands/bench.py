"""`shardflow bench ingest | preprocess | prefect | prefect-ui | reader | scaling | storage |
callbacks | aggregation DATASET`: ratios measured side by side in one run (docs/preprocessing.md,
docs/training.md and docs/prefect.md say how to read them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_catalog.errors import ConfigError
from flows.console import Context
from flows.options import count, whole_number
from preprocessing import datasets


def _side_lines(result: dict[str, Any]) -> list[str]:
    cpu = result["cpu_seconds_per_million_rows"]
    load = result["load_average"]
    return [
        "best round: "
        + ", ".join(
            f"{side} {result['rows_per_second'][side]:,.0f} rows/s, {cpu[side]:.2f} CPU-s per "
            "1M rows"
            for side in result["rows_per_second"]
        ),
        "peak RSS per worker: "
        + ", ".join(f"{b / 2**20:.0f} MiB" for b in result["peak_rss_bytes_per_worker"])
        + f"; load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after",
    ]


def _against(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """``--against``: the stage's whole command against DuckDB's and Polars' scripts."""
    from lab.bench.against import bench_against, parse_peers

    if args.dataset != "sdss":
        raise ConfigError("dataset", "--against runs the SDSS stages: use sdss")
    quick = args.quick  # for tests: 20,000 rows in 2 files, one round
    result = bench_against(
        args.benchmark,
        rows=args.rows or (20_000 if quick else 1_000_000),
        files=args.files or (2 if quick else 8),
        rounds=args.rounds or (1 if quick else 5),
        peers=parse_peers(args.against),
        progress=ctx.progress,
    )
    ours, load = result["shardflow"], result["load_average"]
    lines = [
        f"shardflow's speed ÷ {result['faster_peer']}'s (the faster peer), medians of "
        f"{result['rounds']} alternated rounds: wall {result['peer_ratio_wall']:.2f}, CPU-s "
        f"{result['peer_ratio_cpu']:.2f}; outputs agree: {result['outputs_agree']}",
    ]
    for side, medians in [("shardflow", ours), *result["peers"].items()]:
        lines.append(
            f"{side}: {medians['seconds']:.2f} s, {medians['cpu_seconds']:.2f} CPU-s, peak RSS "
            f"{medians['peak_rss_bytes'] / 2**20:.0f} MiB (largest process)"
        )
    lines.append(
        "shardflow peak RSS per worker: "
        + ", ".join(f"{b / 2**20:.0f} MiB" for b in result["peak_rss_bytes_per_worker"])
        + f"; load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"
    )
    return result, lines


def _preprocess(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench.preprocessing import bench_preprocess

    if args.against:
        return _against(ctx, args)

    result = bench_preprocess(
        ctx.settings.catalog(),
        datasets.dataset(args.dataset),
        rounds=args.rounds or 3,
        progress=ctx.progress,
    )
    return result, [
        f"rows/s, 2 Dask workers ÷ single-process baseline: {result['ratio']:.3f}",
        *_side_lines(result),
    ]


def _ingest(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench.preprocessing import bench_ingest

    if args.against:
        return _against(ctx, args)

    result = bench_ingest(
        args.dataset,
        rows=args.rows or 1_000_000,
        files=args.files or 8,
        rounds=args.rounds or 3,
        progress=ctx.progress,
    )
    return result, [
        f"rows/s, shardflow ingest ({result['workers']} workers) ÷ pyarrow read_csv + "
        f"write_table: {result['ratio']:.3f}",
        *_side_lines(result),
    ]


def _prefect(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench.prefect import bench_prefect

    quick = {"rows": 2_000, "files": 20, "rounds": 1, "epochs": 1}
    given = {"rows": args.rows, "files": args.files, "rounds": args.rounds, "epochs": args.epochs}
    sizes = {
        name: value if value is not None else (quick[name] if args.quick else default)
        for (name, value), default in zip(given.items(), (2_000_000, 2_000, 2, 1), strict=True)
    }
    result = bench_prefect(
        args.dataset, source=args.source, split=args.split, progress=ctx.progress, **sizes
    )
    ratio, load = result["ratio"], result["load_average"]
    run = result["prefect_database"]["per_flow_run"]
    after, empty = result["prefect_database"]["after"], result["prefect_database"]["empty"]
    return result, [
        f"flow ÷ plain, best round of each: wall {ratio['wall']:.3f}, CPU-seconds of all "
        f"processes (the Prefect server's included) {ratio['cpu']:.3f}",
        f"flow ÷ plain, median round of each: wall {result['ratio_median']['wall']:.3f}, "
        f"CPU {result['ratio_median']['cpu']:.3f}",
        *_paired_lines(result["ratio_paired"]),
        "best: "
        + ", ".join(
            f"{side} {result['seconds'][side]:.1f} s, {result['cpu_seconds'][side]:.1f} CPU-s"
            for side in result["seconds"]
        )
        + f"; load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after",
        *_split_lines(result),
        *(
            [
                "one flow run in the Prefect database: "
                + ", ".join(f"{v:,} {k}" for k, v in run.items() if not k.startswith("bytes"))
                + f"; {run['bytes'] / 1e6:.2f} MB",
                f"the Prefect database after {_flow_runs(result)} flow runs: "
                f"{after['bytes'] / 1e6:.2f} MB in use ({empty['bytes'] / 1e6:.2f} MB empty), "
                f"{after['bytes_on_disk'] / 1e6:.2f} MB on disk",
            ]
            if run
            else []
        ),
    ]


def _paired_lines(paired: dict[str, dict[str, float]]) -> list[str]:
    if not paired:
        return []
    wall, cpu = paired["wall"], paired["cpu"]
    return [
        f"flow ÷ plain within each turn, median (least-most): wall {wall['median']:.3f} "
        f"({wall['min']:.2f}-{wall['max']:.2f}), CPU {cpu['median']:.3f} "
        f"({cpu['min']:.2f}-{cpu['max']:.2f})"
    ]


def _flow_runs(result: dict[str, Any]) -> int:
    return sum(r["side"] == "flow" for r in result["rounds"])


def _split_lines(result: dict[str, Any]) -> list[str]:
    """With --split: the flow's extra cost at the medians, Prefect's import and the flow run."""
    if "split" not in result:
        return []
    imported, run = result["split"]["prefect_import"], result["split"]["flow_run"]
    ratio = result["ratio_median_import"]
    return [
        f"of the flow's extra at the medians: Prefect's import {imported['wall']:+.2f} s, "
        f"{imported['cpu']:+.2f} CPU-s (the plain command in a process that imported it ÷ "
        f"plain: wall {ratio['wall']:.3f}, CPU {ratio['cpu']:.3f}); the flow run on top "
        f"{run['wall']:+.2f} s, {run['cpu']:+.2f} CPU-s (the server's share included)"
    ]


def _prefect_ui(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from pathlib import Path

    from lab.bench.prefect_ui import bench_prefect_ui

    if args.dataset != "sdss":
        raise ConfigError("dataset", "bench prefect-ui runs the ingest of sdss exports: use sdss")
    files = args.files or 20_000
    result = bench_prefect_ui(
        files=files,
        rows=args.rows or 200 * files,
        preprocess=args.preprocess,
        screenshots=Path(args.screenshots or ctx.settings.home / "prefect-ui").resolve(),
        progress=ctx.progress,
    )
    lines = []
    for label, run in result["runs"].items():
        db = run["database"]
        lines.append(
            f"{label}: {sum(run['dask_tasks'].values()):,} Dask tasks in "
            f"{db['task_run']} task runs; {db['events']:,} events, {db['artifact']} artifact "
            f"versions, {db['log']} log lines, {db['bytes'] / 1e6:.2f} MB of database"
        )
        for page, load in run["pages"].items():
            each = ", ".join(
                f"{s:.2f}" if s is not None else "never" for s in load["usable_seconds_each"]
            )
            lines.append(
                f"  {page}: usable after {each} s (of 120 s at most)"
                + (
                    f", {load['usable_vs_small']:.2f}x the small run's"
                    if "usable_vs_small" in load
                    else ""
                )
                + "; the fastest load's "
                f"longest freeze {load['longest_task_ms']:.0f} ms, "
                f"{load['received_bytes'] / 1e6:.1f} MB downloaded, JS heap "
                f"{load['js_heap_bytes'] / 1e6:.0f} MB, browser "
                f"{load['browser_pss_bytes'] / 1e6:.0f} MB (PSS)"
            )
    return result, lines


def _aggregation(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench import training as bench

    result = bench.bench_aggregation(
        ctx.settings.catalog(),
        args.dataset,
        runs_dir=ctx.settings.runs_dir,
        epochs=args.epochs or 3,
        progress=ctx.progress,
    )
    return result, ["ranks  passes/step  allreduce MB/epoch  test accuracy"] + [
        f"{r['num_ranks']:5}  {r['backward_passes_per_step']:11}  "
        f"{r['allreduce_bytes_per_epoch'] / 1e6:18.1f}  {r['test_accuracy']:13.4f}"
        for r in result["rows"]
    ]


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {
        k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size)) if v is not None
    }


def _reader(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench import training as bench

    result = bench.bench_reader(
        ctx.settings.catalog(), args.dataset, progress=ctx.progress, **_sizes(args)
    )
    return result, [f"streaming ÷ in-memory epoch time: {result['ratio']:.3f}"]


def _scaling(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench import training as bench

    result = bench.bench_scaling(
        ctx.settings.catalog(), args.dataset, progress=ctx.progress, **_sizes(args)
    )
    return result, [f"samples/s, 2 ranks ÷ 1 rank (1 thread each): {result['ratio']:.3f}"]


def _storage(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench import storage

    request = storage.StorageRequest(
        dataset=args.dataset,
        accelerator=args.accelerator,
        num_ranks=args.ranks,
        memory_limit=args.memory_limit,
        batch_size=args.batch_size,
        model=args.model,
        rounds=args.rounds or 3,
        grow_rows=args.grow_rows,
        image_size=args.image_size,
        grown_dir=args.grown_dir,
        search=not args.no_search,
        max_ranks=args.max_ranks,
        quick=args.quick,
        **({"shuffle_buffer": args.shuffle_buffer} if args.shuffle_buffer else {}),
    )
    result = storage.bench_storage(ctx.settings.catalog(), request, progress=ctx.progress)
    return result, storage.summary_lines(result)


def _callbacks(ctx: Context, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from lab.bench.callbacks import bench_callbacks

    result = bench_callbacks(
        ctx.settings.catalog(), args.dataset, progress=ctx.progress, **_sizes(args)
    )
    steps = result["step_seconds"]
    return result, [
        f"step time with shardflow's callbacks ÷ without: {result['ratio']:.4f} (medians: "
        f"{result['ratio_median']:.4f}) "
        f"({steps['with'] * 1e3:.2f} ms, {steps['without'] * 1e3:.2f} ms per step); time in "
        f"their hooks: {result['hook_share']:.2%} of the steps with them; their CPU time: "
        f"{result['hook_cpu_seconds_per_step'] * 1e6:.0f} µs a step, "
        f"{result['hook_cpu_share']:.2%} of the fastest step without them; CPU-seconds with ÷ "
        f"without (medians): {result['cpu_ratio_median']:.4f}",
        "Keras's slow-callback warning: "
        + ("; ".join(result["keras_slow_callback_warnings"]) or "none"),
    ]


BENCHMARKS = {
    "ingest": (
        _ingest,
        "sdss: rows/s of the ingest of --rows synthetic rows in --files CSV exports ÷ "
        "pyarrow's multithreaded read_csv + write_table of the same files",
    ),
    "preprocess": (_preprocess, "rows/s with 2 Dask workers ÷ a single-process baseline"),
    "prefect": (
        _prefect,
        "wall and CPU seconds (the Prefect server's included) of the Prefect flow ÷ the plain "
        "command against a Prefect server: sdss ingest of --files exports (default 2000 of "
        "1000 rows), or the fashion-mnist pipeline (--epochs, default 1); --quick for a test",
    ),
    "prefect-ui": (
        _prefect_ui,
        "sdss: the ingest flow of --files exports (default 20000 of 200 rows; --preprocess "
        "then the preprocess flow) watched in Prefect's V1 and V2 UIs in headless Chromium: "
        "time to a usable page, freezes, bytes, memory, screenshots (--screenshots DIR)",
    ),
    "reader": (_reader, "streaming ÷ in-memory epoch time"),
    "scaling": (_scaling, "samples/s on 2 ranks ÷ 1 rank, one thread per rank"),
    "storage": (
        _storage,
        "MLPerf-Storage-style: the ranks' input feeding emulated accelerators (AU), beside the "
        "device's direct read and pq → numpy of the same row groups",
    ),
    "callbacks": (_callbacks, "step time with shardflow's Keras callbacks ÷ without them"),
    "aggregation": (
        _aggregation,
        "ranks x backward passes per step -> allreduce bytes, test accuracy",
    ),
}


def cmd_bench(ctx: Context, args: argparse.Namespace) -> int:
    measure, _help = BENCHMARKS[args.benchmark]
    result, lines = measure(ctx, args)
    ctx.emit(result, lines)
    return 0


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    bench = commands.add_parser(
        "bench", parents=[common], help="benchmarks: ratios measured side by side in one run"
    )
    bench.add_argument(
        "benchmark",
        choices=tuple(BENCHMARKS),
        help="; ".join(f"{name}: {text}" for name, (_fn, text) in BENCHMARKS.items()),
    )
    bench.add_argument(
        "dataset", choices=datasets.NAMES, metavar="DATASET", help=", ".join(datasets.NAMES)
    )
    bench.add_argument(
        "--steps", type=count, help="steps timed per run (default: reader 300, scaling 100)"
    )
    bench.add_argument(
        "--batch-size", type=count, help="per rank (default: reader 32, scaling 128)"
    )
    bench.add_argument(
        "--epochs",
        type=count,
        help="aggregation: epochs per run (default: 3); prefect fashion-mnist (default: 1)",
    )
    bench.add_argument(
        "--rows",
        type=count,
        help="ingest, prefect sdss: synthetic rows (default: 1000000; prefect 2000000)",
    )
    bench.add_argument(
        "--files",
        type=count,
        help="ingest, prefect sdss: CSV files (default: 8; prefect 2000)",
    )
    bench.add_argument(
        "--rounds",
        type=count,
        help="ingest, preprocess, prefect, storage: alternated rounds of each side; the best of "
        "each is compared (default: 3; prefect 2)",
    )
    bench.add_argument(
        "--against",
        metavar="PEERS",
        help="ingest, preprocess sdss: the whole command against the same work in DuckDB and "
        "Polars (comma-separated: duckdb,polars; the optional `bench` extra), medians of "
        "--rounds (default 5) alternated rounds",
    )
    bench.add_argument(
        "--source", help="prefect fashion-mnist: the IDX files (default: the dataset's own)"
    )
    bench.add_argument(
        "--split",
        action="store_true",
        help="prefect sdss: a third side, the plain ingest in a process that imported Prefect "
        "as a flow process does, to split the flow's extra cost into Prefect's import and the "
        "flow run",
    )
    bench.add_argument(
        "--preprocess",
        action="store_true",
        help="prefect-ui: the preprocess flow of the ingested version too",
    )
    bench.add_argument(
        "--screenshots",
        help="prefect-ui: where the pages' screenshots go (default: $SHARDFLOW_HOME/prefect-ui)",
    )
    _storage_flags(bench)
    bench.set_defaults(handler=cmd_bench)


def _storage_flags(bench: argparse.ArgumentParser) -> None:
    from lab.bench.accelerators import NAMES
    from lab.bench.storage import parse_size

    def size(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    group = bench.add_argument_group("storage")
    group.add_argument(
        "--accelerator", choices=NAMES, default="a100", help="emulated (default: a100)"
    )
    group.add_argument(
        "--ranks", type=count, default=1, help="ranks, one emulated accelerator each"
    )
    group.add_argument(
        "--memory-limit",
        type=size,
        metavar="SIZE",
        help="run the ranks in a memory cgroup this large, cold cache before every phase (root)",
    )
    group.add_argument(
        "--model", help="the emulated model (default: cnn, dnn; resnet50 at 224x224x3)"
    )
    group.add_argument(
        "--grow-rows",
        type=whole_number,
        default=0,
        help="read a training split grown to this many rows from the version's real images",
    )
    group.add_argument(
        "--image-size", type=count, help="grown images at SIZExSIZEx3 (224: ImageNet-size)"
    )
    group.add_argument(
        "--grown-dir", type=Path, help="keep the grown split here, reused when it matches"
    )
    group.add_argument("--shuffle-buffer", type=count, help="rows (default: training's, 4096)")
    group.add_argument(
        "--max-ranks",
        type=count,
        default=8,
        help="the search for the most accelerators stops here (default: 8)",
    )
    group.add_argument(
        "--no-search", action="store_true", help="predict the most accelerators, do not search"
    )
    group.add_argument(
        "--quick",
        action="store_true",
        help="for tests: storage, one short round and no search; prefect, 20 sdss exports of "
        "100 rows, one round of each side; --against, 20,000 rows in 2 files, one round",
    )
