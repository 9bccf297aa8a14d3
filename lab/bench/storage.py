"""``shardflow bench storage``: can this host keep accelerators fed? MLPerf Storage's method
(emulated accelerators, AU = compute ÷ wall, AU ≥ 0.9) on shardflow's own per-rank input.

```
bench (this process)                          N rank processes (storage_rank.py), in a memory
  │ memory cgroup of --memory-limit (v1 or v2)  cgroup when --memory-limit: page cache charged
  │ drop_caches before every phase (cold)       there, the data set ≥ 5x the limit
  │                                            ┌──────────────────────────────────────────────┐
  ├─ dd iflag=direct of the split's files  ──► │ device: sequential read, no page cache       │
  ├─ phase read_table ───────────────────────► │ pq read_row_groups → numpy (the baseline)    │
  ├─ phase reader ───────────────────────────► │ the rank's input, as fast as it goes         │
  └─ phase emulate ──────────────────────────► │ the rank's input feeding an emulated GPU     │
     rounds alternate the phases; then a       └──────────────────────────────────────────────┘
     search over N for the most ranks at AU ≥ 0.9
```

What binds the host's supply (the ``reader`` phase, each rank's input as fast as it goes):
``disk`` when the ranks read the files at 0.8x or more of the device's direct sequential read
(cold runs), ``cpu`` when the host's cores were 90 % busy (this bench and whatever else runs),
``decode`` when a rank's input kept a core busy on its own, else ``reader`` (the rank's input
waited on nothing the host lacked: shardflow itself is the limit).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_catalog import Catalog, processed_name
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from lab.bench.accelerators import Accelerator, lookup
from lab.bench.storage_rank import PHASES, RankPlan
from training.input import InputSpec, as_url, plan_steps
from training.row_groups import own_memory_cgroup, split_files

Progress = Callable[[str], None]

AU_GOAL = 0.9
"""MLPerf Storage's bar: an accelerator kept busy 90 % of the time."""
COLD_FACTOR = 5
"""MLPerf Storage's rule: the data set at least 5x the memory that could cache it."""
DISK_BOUND = 0.8
CPU_BOUND = 0.9
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@dataclass(frozen=True, kw_only=True)
class StorageRequest:
    """One ``bench storage`` run."""

    dataset: str
    accelerator: str
    num_ranks: int = 1
    memory_limit: int | None = None
    """Bytes: run the ranks in a memory cgroup this large, cold cache before every phase."""
    batch_size: int | None = None
    model: str | None = None
    """None: the dataset's kind's small model (cnn, dnn), resnet50 at ImageNet size."""
    rounds: int = 3
    seconds: float = 6.0
    """Emulated compute per rank per phase: sets the epochs (or steps) a phase reads."""
    shuffle_buffer: int = 4096
    grow_rows: int = 0
    """Rows of a grown training split to read instead of the version's (0: the version's)."""
    image_size: int | None = None
    grown_dir: Path | None = None
    search: bool = True
    max_ranks: int = 8
    quick: bool = False


def parse_size(text: str) -> int:
    """Bytes of "512M", "2G", "1.5GiB", "1000000"."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (cleaned[:-1], cleaned[-1]) if cleaned[-1:].isalpha() else (cleaned, "")
    try:
        value = float(number) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a size (512M, 2G, ...)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a size is positive")
    return int(value)


# --- the host: cgroup, page cache, device ------------------------------------------------------


@contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup of ``limit`` bytes (page cache charged to it), below this process's own;
    yields its ``cgroup.procs`` (a process writing "0" there joins it). cgroup v2 where the host
    has it (``memory.max``), else v1's memory controller (``memory.limit_in_bytes``)."""
    own = own_memory_cgroup()
    if own is None or not own[0].is_dir():
        raise ShardflowError("--memory-limit needs a memory cgroup (v1 or v2); none here")
    parent, limit_file = own
    group = parent / f"shardflow-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError as error:
        raise ShardflowError(
            f"--memory-limit: cannot make {group}: {error} (run as root)"
        ) from None
    try:
        yield group / "cgroup.procs"
    finally:
        for attempt in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                if attempt == 50:
                    # Processes still in it (ranks exiting slowly): back to the bench's group.
                    for pid in (group / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            (group.parent / "cgroup.procs").write_text(pid)
                time.sleep(0.1)  # its last processes are still exiting


def drop_caches() -> None:
    """Write back and drop the page cache (root only): the next reads come from the device."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as error:
        raise ShardflowError(f"cold cache needs root: {DROP_CACHES}: {error}") from None


DEVICE_READ_BYTES = 2**30
"""What the device read reads of a split each round: its first whole files up to 1 GiB."""
DIRECT_CHUNK = 8 * 2**20
DIRECT_IN_FLIGHT = 8
"""Requests under way in the deep direct read: a network-attached disk serves one request at a
time (``dd``'s) at a fraction of its throughput, and the ranks' readers keep several under way."""


def _first_files(paths: list[str], limit: int) -> list[str]:
    chosen: list[str] = []
    total = 0
    for path in paths:
        if chosen and total >= limit:
            break
        chosen.append(path)
        total += os.path.getsize(path)
    return chosen


def device_read(
    paths: list[str], procs: Path | None, limit: int = DEVICE_READ_BYTES
) -> dict[str, Any]:
    """The split's first files (up to ``limit`` bytes) read in order at the device, bypassing
    the page cache (direct I/O), twice: with ``dd iflag=direct`` (one request at a time, in the
    cgroup when given) and with :data:`DIRECT_IN_FLIGHT` requests under way
    (:func:`direct_read`). ``mb_s`` is the faster: what the device gives a sequential reader;
    or why not (a file system without direct I/O)."""
    paths = _first_files(paths, limit)
    total = sum(os.path.getsize(p) for p in paths)
    before = os.times()
    started = time.perf_counter()
    for path in paths:
        done = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"],
            capture_output=True,
            text=True,
            preexec_fn=_joiner(procs),
        )
        if done.returncode != 0:
            return {"mb_s": None, "error": done.stderr.strip().splitlines()[-1]}
    wall = time.perf_counter() - started
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    dd_mb_s = total / wall / 1e6
    deep = direct_read(paths)
    return {
        "mb_s": max(dd_mb_s, deep["mb_s"]),
        "dd_mb_s": dd_mb_s,
        "deep_mb_s": deep["mb_s"],
        "in_flight": DIRECT_IN_FLIGHT,
        "bytes": total,
        "wall": wall,
        "cpu": cpu,
    }


def direct_read(paths: list[str], in_flight: int = DIRECT_IN_FLIGHT) -> dict[str, float]:
    """``paths`` read in order, :data:`DIRECT_CHUNK` at a time, ``in_flight`` requests under
    way (threads; ``os.preadv`` releases the GIL), with O_DIRECT into page-aligned buffers."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    chunks = [
        (path, offset) for path in paths for offset in range(0, os.path.getsize(path), DIRECT_CHUNK)
    ]
    descriptors = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in paths}
    buffers = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(in_flight)]

    def read(worker: int) -> int:
        done = 0
        for path, offset in chunks[worker::in_flight]:
            done += os.preadv(descriptors[path], [buffers[worker]], offset)
        return done

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            total = sum(pool.map(read, range(in_flight)))
        wall = time.perf_counter() - started
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
        for buffer in buffers:
            buffer.close()
    return {"mb_s": total / wall / 1e6, "bytes": float(total), "wall": wall}


def _joiner(procs: Path | None) -> Callable[[], None] | None:
    if procs is None:
        return None

    def join() -> None:
        procs.write_text("0")

    return join


def _host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core so far (/proc/stat)."""
    fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


# --- the ranks ---------------------------------------------------------------------------------


class Ranks:
    """N rank processes (lab.bench.storage_rank), each waiting for phases on its stdin."""

    def __init__(self, plans: list[RankPlan], scratch: Path, procs: Path | None) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        for plan in plans:
            path = scratch / f"rank-{plan.rank}-of-{plan.num_ranks}.json"
            path.write_text(json.dumps(asdict(plan)))
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lab.bench.storage_rank", str(path)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=environment,
                    preexec_fn=_joiner(procs),
                )
            )
        for process in self.processes:
            self._answer(process)
        self.run("warmup", 0)

    def _answer(self, process: subprocess.Popen[str]) -> dict[str, Any]:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            code = process.wait()
            raise ShardflowError(
                f"bench storage: a rank process ended (exit code {code}); with --memory-limit, "
                "the limit may be too small for its ranks (each holds TensorFlow)"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, phase: str, first_epoch: int) -> dict[str, Any]:
        """Every rank through ``phase`` at once: their answers, and the host's cores' busy
        share over the phase."""
        busy_before, total_before = _host_busy()
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(json.dumps({"phase": phase, "first_epoch": first_epoch}) + "\n")
            process.stdin.flush()
        ranks = [self._answer(p) for p in self.processes]
        busy_after, total_after = _host_busy()
        busy = (busy_after - busy_before) / max(1.0, total_after - total_before)
        return {"ranks": ranks, "host_busy": busy}

    def close(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- what is read ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Split:
    url: str
    spec: InputSpec
    group_rows: list[int]
    paths: list[str]
    version: str
    grown: bool

    @property
    def file_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's input as the ranks hand it over (uint8 pixels, float features)."""
        size = 1
        for n in self.spec.input_shape:
            size *= n
        return size * (1 if self.spec.kind == "images" else 4)


def _split(catalog: Catalog, request: StorageRequest, scratch: Path, progress: Progress) -> Split:
    manifest = catalog.get(processed_name(request.dataset))
    if not catalog.is_local:
        raise ShardflowError("bench storage reads a local catalog's files (the device is local)")
    layout = ProcessedLayout.of(manifest)
    directory = catalog.split_dir(manifest, "train")
    spec = InputSpec.of(layout)
    url: str = as_url(directory)  # type: ignore[assignment]
    grown = bool(request.grow_rows or request.image_size)
    if grown:
        from lab.bench.grow import grow_split

        out = request.grown_dir or scratch / "grown"
        rows = request.grow_rows or layout.train.rows
        progress(f"bench storage: growing {rows:,} rows from {manifest.name} into {out}")
        url, spec = grow_split(
            directory,
            spec,
            out,
            rows=rows,
            rows_per_group=layout.train.rows_per_group if not request.image_size else 128,
            image_size=request.image_size,
        )
    files = split_files(url)
    return Split(
        url=url,
        spec=spec,
        group_rows=[g.rows for g in files.groups],
        paths=sorted({g.path for g in files.groups}),
        version=f"{manifest.name}@{manifest.version}",
        grown=grown,
    )


def _workload(request: StorageRequest, split: Split) -> Accelerator:
    shape = tuple(split.spec.image_shape) if split.spec.kind == "images" else ()
    model = request.model or (
        "dnn" if split.spec.kind == "tabular" else "resnet50" if shape == (224, 224, 3) else "cnn"
    )
    return lookup(request.accelerator, model, shape, request.batch_size)


def _plans(
    request: StorageRequest, split: Split, workload: Accelerator, num_ranks: int
) -> list[RankPlan]:
    batch = workload.batch_size
    per_epoch = plan_steps(split.group_rows, num_ranks, batch)
    seconds = 1.0 if request.quick else request.seconds
    wanted = max(1, math.ceil(seconds / workload.step_seconds))
    steps, epochs = (
        (per_epoch, math.ceil(wanted / per_epoch)) if wanted > per_epoch else (wanted, 1)
    )
    return [
        RankPlan(
            url=split.url,
            spec=asdict(split.spec),
            rank=rank,
            num_ranks=num_ranks,
            batch_size=batch,
            steps=steps,
            epochs=min(epochs, 200),
            seed=0,
            shuffle_buffer=request.shuffle_buffer,
            step_seconds=workload.step_seconds,
        )
        for rank in range(num_ranks)
    ]


@contextmanager
def _confined(limit: int | None) -> Iterator[Path | None]:
    if limit is None:
        yield None
        return
    with memory_cgroup(limit) as procs:
        yield procs


# --- the run -----------------------------------------------------------------------------------


def _rounds(
    request: StorageRequest, split: Split, ranks: Ranks, procs: Path | None, progress: Progress
) -> list[dict[str, Any]]:
    cold = request.memory_limit is not None
    rounds: list[dict[str, Any]] = []
    if not cold:
        ranks.run("read_table", 0)  # warm the page cache: the warm run's reads are memory's
    for number in range(1 if request.quick else request.rounds):
        first = number * 1000
        measured: dict[str, Any] = {}
        if cold:
            drop_caches()
        measured["device"] = device_read(split.paths, procs)
        for phase in PHASES:
            if cold:
                drop_caches()
            measured[phase] = ranks.run(phase, first)
        rounds.append(measured)
        aus = ", ".join(f"{r['au']:.3f}" for r in measured["emulate"]["ranks"])
        rates = {p: sum(_rate(r) for r in measured[p]["ranks"]) for p in PHASES[:3]}
        progress(
            f"bench storage: round {number + 1}: AU {aus}; rows/s: pq → numpy "
            f"{rates['read_table']:,.0f}, reader {rates['reader']:,.0f}, into TensorFlow "
            f"{rates['input']:,.0f}"
        )
    return rounds


def _binding(reader: dict[str, Any], device_ratio: float | None, cold: bool) -> str:
    if cold and device_ratio is not None and device_ratio >= DISK_BOUND:
        return "disk"
    if reader["host_busy"] >= CPU_BOUND:
        return "cpu"
    if max(r["cpu"] / r["wall"] for r in reader["ranks"]) >= CPU_BOUND:
        return "decode"
    return "reader"


def _best(
    rounds: list[dict[str, Any]], phase: str, rank: int, key: Callable[[dict[str, Any]], float]
) -> dict[str, Any]:
    return max((r[phase]["ranks"][rank] for r in rounds), key=key)


def _cpu_per_row(
    rounds: list[dict[str, Any]], phase: str, rank: int, pick: Callable[[list[float]], float]
) -> float:
    """``pick`` (min, statistics.median) of a rank's CPU-seconds per row in a phase's rounds."""
    return float(
        pick([r[phase]["ranks"][rank]["cpu"] / r[phase]["ranks"][rank]["rows"] for r in rounds])
    )


def _median_rate(rounds: list[dict[str, Any]], phase: str, rank: int) -> float:
    return float(statistics.median(_rate(r[phase]["ranks"][rank]) for r in rounds))


def _rate(r: dict[str, Any]) -> float:
    return float(r["rows"] / r["wall"]) if r["wall"] > 0 else 0.0


def summarize(
    request: StorageRequest,
    split: Split,
    workload: Accelerator,
    rounds: list[dict[str, Any]],
    num_ranks: int,
) -> dict[str, Any]:
    """The figures of the rounds: each side's best round, per rank and in total."""
    cold = request.memory_limit is not None
    per_rank = []
    for rank in range(num_ranks):
        emulate = _best(rounds, "emulate", rank, lambda r: r["au"])
        reader = _best(rounds, "reader", rank, _rate)
        table = _best(rounds, "read_table", rank, _rate)
        fed = _best(rounds, "input", rank, _rate)
        per_rank.append(
            {
                "rank": rank,
                "au": emulate["au"],
                "samples_per_second": _rate(emulate),
                "delivered_mb_s": emulate["bytes"] / emulate["wall"] / 1e6,
                "cpu_seconds_per_gb": emulate["cpu"] / (emulate["bytes"] / 1e9),
                "reader_rows_per_second": _rate(reader),
                "reader_cpu_seconds_per_gb": reader["cpu"] / (reader["bytes"] / 1e9),
                "input_rows_per_second": _rate(fed),
                "input_cpu_seconds_per_gb": fed["cpu"] / (fed["bytes"] / 1e9),
                "read_table_rows_per_second": _rate(table),
                "read_table_cpu_seconds_per_gb": table["cpu"] / (table["bytes"] / 1e9),
                "read_table_ratio": _rate(reader) / _rate(table),
                # CPU-seconds are less moved by a busy host than wall time, but still moved
                # (caches, contention): each side's least per row over the rounds, and each
                # side's median (one lucky round moves the first, not the second).
                "cpu_per_row_ratio": _cpu_per_row(rounds, "reader", rank, min)
                / _cpu_per_row(rounds, "read_table", rank, min),
                "cpu_per_row_ratio_median": _cpu_per_row(rounds, "reader", rank, statistics.median)
                / _cpu_per_row(rounds, "read_table", rank, statistics.median),
                "read_table_ratio_median": _median_rate(rounds, "reader", rank)
                / _median_rate(rounds, "read_table", rank),
            }
        )
    best_input = max(rounds, key=lambda r: sum(_rate(x) for x in r["input"]["ranks"]))["input"]
    best_emulate = max(rounds, key=lambda r: min(x["au"] for x in r["emulate"]["ranks"]))["emulate"]
    devices = [r["device"]["mb_s"] for r in rounds if r["device"]["mb_s"]]
    device_mb_s = max(devices) if devices else None
    dd = [r["device"]["dd_mb_s"] for r in rounds if r["device"].get("dd_mb_s")]
    file_bytes_per_row = split.file_bytes / sum(split.group_rows)
    supply_rows = sum(_rate(x) for x in best_input["ranks"])
    supply_file_mb_s = supply_rows * file_bytes_per_row / 1e6
    best_reader = max(rounds, key=lambda r: sum(_rate(x) for x in r["reader"]["ranks"]))
    reader_rows = sum(_rate(x) for x in best_reader["reader"]["ranks"])
    reader_file_mb_s = reader_rows * file_bytes_per_row / 1e6
    device_ratio = reader_file_mb_s / device_mb_s if device_mb_s else None
    supply_ratio = supply_file_mb_s / device_mb_s if device_mb_s else None
    emulate_wall = max(x["wall"] for x in best_emulate["ranks"])
    delivered = sum(x["bytes"] for x in best_emulate["ranks"]) / emulate_wall / 1e6
    au = min(x["au"] for x in best_emulate["ranks"])
    return {
        "au": au,
        "au_mean": sum(x["au"] for x in best_emulate["ranks"]) / num_ranks,
        "au_rounds": [min(x["au"] for x in r["emulate"]["ranks"]) for r in rounds],
        "samples_per_second": sum(x["rows"] for x in best_emulate["ranks"]) / emulate_wall,
        "delivered_mb_s": delivered,
        "cpu_seconds_per_gb": sum(x["cpu"] for x in best_emulate["ranks"])
        / (sum(x["bytes"] for x in best_emulate["ranks"]) / 1e9),
        "supply_rows_per_second": supply_rows,
        "supply_mb_s": supply_rows * split.row_bytes / 1e6,
        "supply_file_mb_s": supply_file_mb_s,
        "reader_rows_per_second": reader_rows,
        "reader_mb_s": reader_rows * split.row_bytes / 1e6,
        "reader_file_mb_s": reader_file_mb_s,
        "device_read_mb_s": device_mb_s,
        "device_read_dd_mb_s": max(dd) if dd else None,
        "device_ratio": device_ratio,
        "device_error": next(
            (r["device"].get("error") for r in rounds if r["device"].get("error")), None
        ),
        "read_table_ratio": min(r["read_table_ratio"] for r in per_rank),
        "cpu_per_row_ratio": max(r["cpu_per_row_ratio"] for r in per_rank),
        "read_table_ratio_median": min(r["read_table_ratio_median"] for r in per_rank),
        "cpu_per_row_ratio_median": max(r["cpu_per_row_ratio_median"] for r in per_rank),
        "host_busy": {
            p: max(r[p]["host_busy"] for r in rounds) for p in ("read_table", "reader", "emulate")
        },
        "binding": _binding(best_input, supply_ratio, cold),
        "reader_binding": _binding(best_reader["reader"], device_ratio, cold),
        "per_rank": per_rank,
    }


def _trial(
    request: StorageRequest,
    split: Split,
    workload: Accelerator,
    num_ranks: int,
    scratch: Path,
    procs: Path | None,
) -> float:
    """The lowest AU of ``num_ranks`` emulated accelerators fed at once (one emulate phase);
    0 when a rank process ended (killed: with --memory-limit, the ranks did not fit in it)."""
    try:
        ranks = Ranks(_plans(request, split, workload, num_ranks), scratch, procs)
    except ShardflowError:
        return 0.0
    try:
        if request.memory_limit is not None:
            drop_caches()
        else:
            ranks.run("read_table", 0)
        result = ranks.run("emulate", 0)
    except ShardflowError:
        return 0.0
    finally:
        ranks.close()
    return float(min(r["au"] for r in result["ranks"]))


def search_accelerators(
    request: StorageRequest,
    split: Split,
    workload: Accelerator,
    predicted: int,
    scratch: Path,
    procs: Path | None,
    progress: Progress,
    known_au: float | None = None,
) -> tuple[int, dict[str, float]]:
    """The most emulated accelerators this host keeps at AU ≥ 0.9 (at most ``max_ranks``): a
    bisection that starts at the prediction, doubles while it passes and halves the gap when
    it fails; (that number, the lowest AU by count tried)."""
    tried: dict[int, float] = {}
    passed, failed = 0, request.max_ranks + 1
    if known_au is not None:
        # The rounds' own count: passed or failed already.
        if known_au >= AU_GOAL:
            passed = min(request.num_ranks, request.max_ranks)
        else:
            failed = request.num_ranks
    n = min(max(passed + 1, predicted), request.max_ranks, failed - 1)
    if failed - passed <= 1:
        return passed, {}
    while failed - passed > 1:
        tried[n] = _trial(request, split, workload, n, scratch, procs)
        progress(
            f"bench storage: {n} emulated {workload.accelerator}(s): "
            + (f"AU {tried[n]:.3f}" if tried[n] else "a rank process ended (memory?)")
        )
        if tried[n] >= AU_GOAL:
            passed = n
            n = min(2 * n, failed - 1) if failed > request.max_ranks else (n + failed) // 2
        else:
            failed = n
            n = (passed + n) // 2
        n = max(n, passed + 1) if n < failed else n
        if n >= failed or n <= passed:
            break
    return passed, {str(k): v for k, v in sorted(tried.items())}


def bench_storage(
    catalog: Catalog, request: StorageRequest, *, progress: Progress = lambda _m: None
) -> dict[str, Any]:
    """MLPerf-Storage-style: ``request.num_ranks`` ranks' real input feeding emulated
    accelerators, beside the device's direct read and pq → numpy of the same row groups."""
    load_before = os.getloadavg()
    scratch_root = Path(tempfile.mkdtemp(prefix="shardflow-bench-storage-"))
    try:
        split = _split(catalog, request, scratch_root, progress)
        workload = _workload(request, split)
        limit = request.memory_limit
        ratio = split.file_bytes / limit if limit else None
        if ratio is not None and ratio < COLD_FACTOR:
            progress(
                f"bench storage: the files ({split.file_bytes / 2**30:.2f} GiB) are {ratio:.1f}x "
                f"the memory limit, under MLPerf Storage's {COLD_FACTOR}x: grow them "
                "(--grow-rows) for a cold run"
            )
        with _confined(limit) as procs:
            ranks = Ranks(_plans(request, split, workload, request.num_ranks), scratch_root, procs)
            try:
                rounds = _rounds(request, split, ranks, procs, progress)
            finally:
                ranks.close()
            figures = summarize(request, split, workload, rounds, request.num_ranks)
            demand = workload.samples_per_second
            predicted = int(figures["supply_rows_per_second"] / (AU_GOAL * demand))
            if request.search and not request.quick:
                most, tried = search_accelerators(
                    request,
                    split,
                    workload,
                    predicted,
                    scratch_root,
                    procs,
                    progress,
                    known_au=figures["au"],
                )
            else:
                most, tried = min(predicted, request.max_ranks), {}
    finally:
        # A grown split under --grown-dir stays for the next run; the scratch folder does not.
        shutil.rmtree(scratch_root, ignore_errors=True)
    return {
        "benchmark": "storage",
        "dataset": split.version,
        "grown": split.grown,
        "sample_shape": list(split.spec.input_shape),
        "accelerator": asdict(workload),
        "num_ranks": request.num_ranks,
        "batch_size": workload.batch_size,
        "memory_limit": limit,
        "cold": limit is not None,
        "files_bytes": split.file_bytes,
        "files_to_memory": ratio,
        "rows": sum(split.group_rows),
        **figures,
        "max_accelerators": most,
        "max_accelerators_searched": bool(tried),
        "max_accelerators_capped": most >= request.max_ranks,
        # What stopped one more: its ranks did not fit in the memory limit (a rank process
        # ended), the --max-ranks cap, or the input's binding resource.
        "max_accelerators_bound": (
            "memory"
            if tried.get(str(most + 1)) == 0.0
            else "max-ranks"
            if most >= request.max_ranks
            else figures["binding"]
        ),
        "max_accelerators_predicted": predicted,
        "search": tried,
        "rounds": len(rounds),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "cores": len(os.sched_getaffinity(0)),
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``bench storage`` prints without --json."""
    acc = result["accelerator"]
    load = result["load_average"]
    device = result["device_read_mb_s"]
    lines = [
        f"{result['num_ranks']} emulated {acc['accelerator']} ({acc['model']}, batch "
        f"{acc['batch_size']}, {acc['us_per_sample']:g} µs/sample = "
        f"{1e6 / acc['us_per_sample']:,.0f} samples/s each) on {result['dataset']}"
        + (" (grown)" if result["grown"] else "")
        + (
            f", cold, memory limit {result['memory_limit'] / 2**30:.2f} GiB "
            f"(files {result['files_to_memory']:.1f}x)"
            if result["cold"]
            else ", warm"
        ),
        f"AU {result['au']:.3f} (lowest rank; mean {result['au_mean']:.3f}), "
        f"{result['samples_per_second']:,.0f} samples/s, {result['delivered_mb_s']:,.1f} MB/s "
        f"delivered, {result['cpu_seconds_per_gb']:.2f} CPU-s/GB",
        f"as fast as they go: the ranks' readers {result['reader_rows_per_second']:,.0f} "
        f"rows/s ({result['reader_file_mb_s']:,.1f} MB/s of files), into TensorFlow "
        f"{result['supply_rows_per_second']:,.0f} rows/s; device direct read "
        + (
            f"{device:,.1f} MB/s (readers ÷ device {result['device_ratio']:.2f})"
            if device
            else f"unavailable: {result['device_error']}"
        ),
        f"rows/s per rank ÷ pq read → numpy: {result['read_table_ratio']:.3f}; CPU-s per row "
        f"÷ its: {result['cpu_per_row_ratio']:.3f} (best rounds; median rounds "
        f"{result['read_table_ratio_median']:.3f} and {result['cpu_per_row_ratio_median']:.3f}); "
        f"binding: {result['binding']} (the readers alone: {result['reader_binding']})",
        f"most emulated {acc['accelerator']}s at AU ≥ {AU_GOAL}: {result['max_accelerators']}"
        + (
            f" (one more: {result['max_accelerators_bound']})"
            if result["max_accelerators_searched"]
            else " (predicted, not searched)"
        ),
        f"load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after; "
        f"{result['cores']} cores",
    ]
    return lines
