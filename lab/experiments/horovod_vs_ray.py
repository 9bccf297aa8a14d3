"""Horovod vs Ray Train (seed: the DS256 report, whose authors could not get Ray Train to run).

The Fashion-MNIST CNN on 2 workers, the same processed version, epochs, batch and steps,
trained with ``shardflow train`` (horovodrun, Gloo) and with Ray Train's TensorflowTrainer on a
local Ray cluster (lab.ray_train): seconds per epoch, test accuracy, bytes over the loopback,
CPU-seconds. Each run is alone in fresh network and PID namespaces (lab.private_run), so its
loopback counters and CPU-seconds are its own on a shared machine, and nothing of it outlives it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError
from lab.experiments.base import Experiment, ExperimentRequest, Pipeline, Prepared, Sample
from lab.experiments.report import markdown_table, write_results
from lab.private_run import Metered, metered
from lab.ray_train import RayTrainConfig

NAME = "horovod-vs-ray"
DATASET = "fashion-mnist"
MODEL = "cnn"
NUM_WORKERS = 2
ENGINES = ("horovod", "ray")
EPOCHS = 5
QUICK_EPOCHS = 2
BATCH_SIZE = 64
LEARNING_RATE = 0.001
SEEDS = (0, 1, 2)
# What every run measures, summarised over the seeds.
MEASURES = (
    "seconds_per_epoch",
    "step_ms",
    "test_accuracy",
    "loopback_bytes",
    "cpu_seconds",
    "wall_seconds",
)
QUICK_SEEDS = (0,)
FULL_SAMPLE = Sample(train_rows=12_000, test_rows=10_000)
QUICK_SAMPLE = Sample(train_rows=512, test_rows=256)
# The seed's Horovod table (MobileNet + Fashion-MNIST, 1 and 2 GPUs of node 5); it has no Ray
# column: "could not get Ray Trainer to work" (its section V).
PAPER_ACCURACY = {1: 72.9, 2: 72.0}
PAPER_SECONDS = {1: 0.691, 2: 0.6409}


def _horovod(
    prepared: Prepared, epochs: int, seed: int, request: ExperimentRequest, pipeline: Pipeline
) -> tuple[dict[str, Any], Metered]:
    """``shardflow train`` in its own namespaces, as a user types it."""
    command = [
        str(Path(sys.executable).parent / "shardflow"), "train", DATASET,
        "--np", str(NUM_WORKERS), "--epochs", str(epochs), "--batch-size", str(BATCH_SIZE),
        "--model", MODEL, "--seed", str(seed), "--json",
    ]  # fmt: skip
    run = _metered(command, request, pipeline)
    trained: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    if trained["dataset_version"] != prepared.processed_version:
        raise ShardflowError(
            f"horovod trained on {trained['dataset_version']}, not {prepared.processed_version}"
        )
    return trained, run


def _ray(
    prepared: Prepared, epochs: int, seed: int, request: ExperimentRequest, pipeline: Pipeline
) -> tuple[dict[str, Any], Metered]:
    """lab.ray_train in its own namespaces, on the same version, its steps planned as
    ``shardflow train`` plans them."""
    home = Path(os.environ.get("SHARDFLOW_HOME") or "~/.shardflow").expanduser()
    config = RayTrainConfig(
        # The catalog the CLI uses (flows.settings.Settings.catalog_root).
        catalog_root=os.environ.get("SHARDFLOW_CATALOG") or str(home / "catalog"),
        dataset=prepared.processed.name,
        version=prepared.processed.version,
        num_workers=NUM_WORKERS,
        epochs=epochs,
        batch_size=BATCH_SIZE,
        steps_per_epoch=None,
        learning_rate=LEARNING_RATE,
        seed=seed,
        model=MODEL,
    )
    with tempfile.TemporaryDirectory(prefix="shardflow-ray-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config.__dict__))
        run = _metered([sys.executable, "-m", "lab.ray_train", str(path)], request, pipeline)
    return json.loads(run.stdout.strip().splitlines()[-1]), run


def _metered(command: list[str], request: ExperimentRequest, pipeline: Pipeline) -> Metered:
    request.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardflow-meter-") as folder:
        run = metered(command, env=os.environ, on_line=pipeline.progress, workdir=Path(folder))
    if run.returncode != 0:
        last = next((x for x in reversed(run.stderr_tail) if x.strip()), "no output")
        raise ShardflowError(f"{' '.join(command[1:3])} failed ({run.returncode}): {last}")
    return run


def _step_ms(seconds_by_epoch: list[float], steps_by_epoch: list[int]) -> float:
    """Mean milliseconds per training step after the first epoch (which traces the graph)."""
    later = slice(1, None) if len(steps_by_epoch) > 1 else slice(None)
    return 1000 * sum(seconds_by_epoch[later]) / max(1, sum(steps_by_epoch[later]))


def horovod_step_ms(trained: dict[str, Any]) -> float:
    """Rank 0's mean step time (its input meter, training.input_metrics), after epoch 1."""
    epochs = trained["input_by_rank"][0]["epochs"]
    return _step_ms([e["step_seconds"] for e in epochs], [e["timed_steps"] for e in epochs])


def _row(engine: str, seed: int, epoch_seconds: list[float], run: Metered) -> dict[str, Any]:
    # Epoch 1 also traces the graph and (Horovod) broadcasts the weights.
    steady = epoch_seconds[1:] or epoch_seconds
    return {
        "engine": engine,
        "seed": seed,
        "epoch_seconds": epoch_seconds,
        "seconds_per_epoch": sum(steady) / len(steady),
        "wall_seconds": run.wall_seconds,
        "cpu_seconds": run.cpu_seconds,
        "reaped_cpu_seconds": run.reaped_cpu_seconds,
        "loopback_bytes": run.loopback_bytes,
        "leftover_processes": run.leftover_processes,
        "load_average": list(os.getloadavg()),
    }


def check_can_run() -> None:
    """What the experiment needs beyond ``make setup``'s core, checked before any work."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("ray") is None:
        raise ShardflowError(
            f"{NAME} needs Ray Train: pip install -c requirements/lock.txt -e '.[ray]'"
        )
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise ShardflowError(
            f"{NAME} runs each engine in network and PID namespaces of its own: it needs root "
            "and unshare (util-linux)"
        )


def run(request: ExperimentRequest, pipeline: Pipeline) -> dict[str, Any]:
    """Both engines on every seed, alternating, then the report into ``request.out``."""
    check_can_run()
    epochs = request.epochs or (QUICK_EPOCHS if request.quick else EPOCHS)
    # Its own 3 seeds (1 when quick) unless --seeds asks for more than one.
    seeds = request.seed_list if request.seeds > 1 else QUICK_SEEDS if request.quick else SEEDS
    pipeline.progress(f"{NAME}: ingest and preprocess {DATASET}")
    prepared = pipeline.prepare(
        DATASET, sample=QUICK_SAMPLE if request.quick else FULL_SAMPLE, synthetic_rows=0
    )
    rows = []
    for number, seed in enumerate(seeds):
        # Alternate which engine goes first (H R, R H, ...): the machine's load drifts.
        for engine in ENGINES if number % 2 == 0 else ENGINES[::-1]:
            pipeline.progress(f"{NAME}: seed {seed}: {engine}, {NUM_WORKERS} workers")
            rows.append(_engine_row(engine, prepared, epochs, seed, request, pipeline))
    if len({r["steps_per_epoch"] for r in rows}) != 1:
        raise ShardflowError(f"the engines took different steps per epoch: {rows}")
    summary = summarise(rows)
    result = {
        "experiment": NAME,
        "quick": request.quick,
        "epochs": epochs,
        "batch_size": BATCH_SIZE,
        "num_workers": NUM_WORKERS,
        "seeds": list(seeds),
        "rows": rows,
        "engines": summary,
        "source": prepared.source,
        "raw_version": prepared.raw_version,
        "processed_version": prepared.processed_version,
        "train_rows": prepared.processed.splits["train"]["rows"],
        "cores": len(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
        "summary": [
            f"{s['engine']}: {s['seconds_per_epoch']['mean']:.2f} s/epoch, test accuracy "
            f"{s['test_accuracy']['mean']:.4f}, {s['loopback_bytes']['mean'] / 1e6:.1f} MB on "
            f"the loopback, {s['cpu_seconds']['mean']:.0f} CPU-s ({len(seeds)} seed(s))"
            for s in summary
        ],
    }
    result["plots"] = [str(p) for p in _plots(request.out, summary, rows)]
    return write_results(request.out, result, render(result))


def _engine_row(
    engine: str,
    prepared: Prepared,
    epochs: int,
    seed: int,
    request: ExperimentRequest,
    pipeline: Pipeline,
) -> dict[str, Any]:
    """One run of ``engine`` on ``seed``: a row of the table."""
    if engine == "horovod":
        trained, run = _horovod(prepared, epochs, seed, request, pipeline)
        return {
            **_row("horovod", seed, trained["epoch_seconds"], run),
            "step_ms": horovod_step_ms(trained),
            "test_accuracy": trained["test_accuracy"],
            "test_rows": trained["test_rows"],
            "steps_per_epoch": trained["steps_per_epoch"],
            "model_version": f"{trained['model_name']}@{trained['version']}",
        }
    ray, run = _ray(prepared, epochs, seed, request, pipeline)
    return {
        **_row("ray", seed, ray["epoch_seconds"], run),
        "step_ms": _step_ms(ray["step_seconds_by_epoch"], ray["steps_by_epoch"]),
        "test_accuracy": ray["test_accuracy"],
        "test_rows": ray["test_rows"],
        "steps_per_epoch": ray["steps_per_epoch"],
        "ray_version": ray["ray_version"],
        "seconds_with_cluster": ray["seconds_with_cluster"],
    }


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine: mean, min, max and sd over the seeds of each measure."""
    done = []
    for engine in ENGINES:
        mine = [r for r in rows if r["engine"] == engine]
        measures = {}
        for key in MEASURES:
            values = [float(r[key]) for r in mine]
            measures[key] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
        done.append({"engine": engine, "runs": len(mine), **measures})
    return done


def _plots(out: Path, summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("seconds_per_epoch", "seconds per epoch", 1.0),
        ("step_ms", "ms per training step", 1.0),
        ("test_accuracy", "test accuracy", 1.0),
        ("loopback_bytes", "MB over the loopback", 1e-6),
        ("cpu_seconds", "CPU-seconds (all processes)", 1.0),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(16, 3.6))
    for axis, (key, label, scale) in zip(axes, panels, strict=True):
        for x, engine in enumerate(ENGINES):
            mine = next(s for s in summary if s["engine"] == engine)[key]
            axis.bar(x, mine["mean"] * scale, 0.6, color=f"C{x}", alpha=0.6)
            values = [r[key] * scale for r in rows if r["engine"] == engine]
            axis.plot([x] * len(values), values, "k.", markersize=6)
        axis.set_xticks(range(len(ENGINES)), ["Horovod", "Ray Train"])
        axis.set_title(label, fontsize=9)
    figure.suptitle("Fashion-MNIST CNN, 2 workers: mean (bar) and each seed (dots)", fontsize=10)
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "horovod_vs_ray.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [path]


def _spread(measure: dict[str, float], digits: int, scale: float = 1.0) -> str:
    mean, low, high = (round(measure[k] * scale, digits) for k in ("mean", "min", "max"))
    return f"{mean} ({low} to {high})"


def _reading(result: dict[str, Any]) -> str:
    """Ray Train against Horovod: ratios of the means, the accuracy gap beside its spread."""
    horovod, ray = (next(s for s in result["engines"] if s["engine"] == e) for e in ENGINES)

    def ratio(key: str) -> str:
        return f"{ray[key]['mean'] / horovod[key]['mean']:.2f}"

    load = {
        e: statistics.fmean(r["load_average"][0] for r in result["rows"] if r["engine"] == e)
        for e in ENGINES
    }
    accuracy = ray["test_accuracy"]["mean"] - horovod["test_accuracy"]["mean"]
    widest = max(s["test_accuracy"]["max"] - s["test_accuracy"]["min"] for s in (horovod, ray))
    return f"""- Ray Train ÷ Horovod, means over the seeds: ms per step {ratio("step_ms")}, seconds
  per epoch {ratio("seconds_per_epoch")}, bytes over the loopback {ratio("loopback_bytes")},
  CPU-seconds {ratio("cpu_seconds")}, wall seconds of the whole run {ratio("wall_seconds")}.
  The machine is shared: the 1-minute load average at the end of the runs was
  {load["horovod"]:.1f} (Horovod's) and {load["ray"]:.1f} (Ray's), means over the seeds, on
  {result["cores"]} cores. Times move with it; bytes do not, and CPU-seconds less.
- Test accuracy: Ray minus Horovod {accuracy:+.4f}, beside a spread over the seeds of up to
  {widest:.4f} within one engine.
- Bytes: two workers exchanging the CNN's gradients (about 0.9 MB of float32) once a step; a
  ring allreduce of 2 ranks sends about one gradient per rank a step, for both engines. What
  is above that is each engine's own traffic (Horovod's rendezvous and control loop; Ray's
  GCS, raylet, object store and reports).
- Wall seconds hold each engine's start-up: Ray starts a head (GCS, raylet, agents), a Train
  controller and two workers, each importing TensorFlow, before the first step."""


def render(result: dict[str, Any]) -> str:
    """report.md: the two engines side by side, the paper's Horovod row beside them."""
    table = markdown_table(
        [
            "engine",
            "s/epoch",
            "ms/step",
            "test accuracy",
            "MB over loopback",
            "CPU-seconds",
            "wall seconds (run)",
            "seeds",
        ],
        [
            [
                {"horovod": "Horovod 0.28.1 (Gloo)", "ray": "Ray Train"}[s["engine"]],
                _spread(s["seconds_per_epoch"], 2),
                _spread(s["step_ms"], 1),
                _spread(s["test_accuracy"], 4),
                _spread(s["loopback_bytes"], 1, 1e-6),
                _spread(s["cpu_seconds"], 0),
                _spread(s["wall_seconds"], 0),
                s["runs"],
            ]
            for s in result["engines"]
        ],
    )
    runs = markdown_table(
        [
            "engine",
            "seed",
            "s/epoch",
            "ms/step",
            "test accuracy",
            "bytes over loopback",
            "CPU-s",
            "load average (1, 5, 15 min)",
        ],
        [
            [
                r["engine"],
                r["seed"],
                round(r["seconds_per_epoch"], 2),
                round(r["step_ms"], 1),
                round(r["test_accuracy"], 4),
                r["loopback_bytes"],
                round(r["cpu_seconds"], 1),
                " / ".join(f"{x:.2f}" for x in r["load_average"]),
            ]
            for r in result["rows"]
        ],
    )
    ray_version = next((r["ray_version"] for r in result["rows"] if r["engine"] == "ray"), "?")
    quick = (
        f"\n**Quick run** (`--quick`): {QUICK_SAMPLE.train_rows} training images, "
        f"{result['epochs']} epochs, one seed. It checks that both engines run; its figures say "
        "nothing about either engine's speed or the paper's.\n"
        if result["quick"]
        else ""
    )
    seeds = len(result["seeds"])
    return f"""# Horovod vs Ray Train (seed: DS256 report, 001)
{quick}
The Fashion-MNIST `{MODEL}` on {result["num_workers"]} workers, trained twice from the same
processed version `{result["processed_version"]}` ({result["train_rows"]} training images;
data: {result["source"]}): with `shardflow train --np 2` (horovodrun, Gloo allreduce) and with
Ray {ray_version} Train's `TensorflowTrainer` (MultiWorkerMirroredStrategy, gRPC collectives)
on a local Ray cluster (a head on 127.0.0.1 with one CPU per worker, no dashboard). Both:
{result["epochs"]} epochs, batch {result["batch_size"]} per worker, the same steps per epoch,
Adam at 0.001 x workers. Each figure is the mean over {seeds} seed(s), (min to max) beside it;
the engines ran alternately, which one first alternating from seed to seed.

{table}

![mean and each seed](horovod_vs_ray.png)

Every run:

{runs}

## How each figure was measured

- **s/epoch**: the mean of the epochs after the first (the first also traces the graph), timed
  by a Keras callback in the training processes (Horovod: rank 0's epoch times in the model
  version; Ray: worker 0's). Horovod's epoch also holds its epoch-end work, which the Ray loop
  does not do: validation on the version's validation split and rank 0's checkpoint.
- **ms/step**: the mean wall time of a training step (forward, backward, the gradients'
  allreduce, the update) after the first epoch, on rank 0 / worker 0: Horovod's from its input
  meter (`input_by_rank` of the model version), Ray's from a Keras batch callback. This is the
  figure that compares the engines' training loops.
- **Test accuracy**: the whole test split of the version ({result["rows"][0]["test_rows"]}
  images). Horovod: `shardflow train`'s own test; Ray: worker 0's model called on the same
  files.
- **Bytes over the loopback** and **CPU-seconds**: each run (a `shardflow train` command, or
  the Ray driver with its cluster) ran alone in fresh network and PID namespaces
  (`lab/private_run.py`): the bytes are what its loopback sent (`/proc/net/dev` of that
  namespace, read before and after), every process of the run included: Horovod's rendezvous
  and Gloo allreduce; Ray's GCS, raylet, object store transfers and gRPC collectives. The
  CPU-seconds are user + system time of every process of the run, start-up, data loading and
  testing included, as last seen by a scan of the namespace's processes every 0.2 s (the last
  0.2 s of each process are missed). The kernel's own count of reaped processes
  (`RUSAGE_CHILDREN` of the namespace's PID 1, `reaped_cpu_seconds` in results.json) is not
  used: Ray's raylet ignores SIGCHLD, so its workers' time is lost to it (12 against 32
  CPU-s for one Ray run, seen). Wall seconds are
  the whole run, start-up included.
- Ray's workers each hold their half of the training split in memory (every second row);
  Horovod's ranks stream their row groups with petastorm. Horovod warms the learning rate up
  over the first epochs; the Ray loop does not.

## Reading it

{_reading(result)}

## Beside the paper

The paper (001) trained MobileNet on Fashion-MNIST with Horovod on V100 GPUs: test accuracy
{PAPER_ACCURACY[1]} % on 1 GPU and {PAPER_ACCURACY[2]} % on 2 (node 5), training time
{PAPER_SECONDS[1]} s and {PAPER_SECONDS[2]} s as its Table I reports them; it gives no Ray Train
figures at all: its authors report that Ray Train would not run on their cluster because of
dependency conflicts. Here the model is the smaller CNN, on 2 CPU cores, on
{result["train_rows"]} of the 60,000 training images: no figure above compares with the
paper's, and none is claimed above or below it. What this report adds is the column the paper
could not fill: Ray Train beside Horovod on the same model, data and budget.

Ray: the newest release whose Train still trains TensorFlow/Keras 2 here is pinned in the
optional `ray` extra (docs/STACK.md says which and why).

Load average at the end: {" / ".join(f"{x:.2f}" for x in result["load_average"])} on
{result["cores"]} cores (a shared machine: absolute times mean little).

```
shardflow experiment horovod-vs-ray --out docs/results/horovod-vs-ray
```
"""


EXPERIMENT = Experiment(
    name=NAME,
    seed="DS256 report (001): Horovod table; its Ray Train column could not be run",
    measures="the Fashion-MNIST CNN on 2 workers with Horovod and with Ray Train: seconds per "
    "epoch, test accuracy, bytes over the loopback, CPU-seconds (3 seeds)",
    full_duration="about 10 minutes on 2 cores (needs root and `pip install .[ray]`); "
    "--quick about 2",
    datasets=(DATASET,),
    run=run,
)
