"""Images stored plain or in a dictionary, read cold by one rank's reader, side by side.

    python -m lab.bench.image_encodings PLAIN_DIR DICT_DIR [--rounds 3] [--steps 150]
        [--names plain,dictionary] [--direct]

Both folders hold the same training rows (224x224x3 images and labels in row groups of 128):
PLAIN_DIR as the processed writer stores them since images writer 3 (``shard_files.encodings``:
the image column plain), DICT_DIR rewritten with pyarrow's defaults (a dictionary for every
column, images writer 2). Each round reads both, the order alternating, through the per-rank
reader ``training.input.epoch_batches`` (the epoch's order, the reader threads, a shuffle
window of 512 rows, batches of 256), after ``sync`` and ``drop_caches`` (root): rows/s, MB/s of
files and of decoded pixels, CPU-seconds per decoded GB, and the load average. Read both
folders once before (``cat DIR/* > /dev/null``) where the disk's host may cache what was read
recently, so that neither side starts with an advantage the guest cannot drop. Any two such
folders compare alike (``--names``: images writer 4's uncompressed pixels against snappy's,
``--direct``: both read with ``O_DIRECT``, as a split larger than memory is).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from training.input import InputSpec, as_url, epoch_batches
from training.input_metrics import EpochInput

SPEC = InputSpec(kind="images", format="parquet", image_shape=[224, 224, 3])
ROW_BYTES = 224 * 224 * 3


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_cold(folder: Path, steps: int, direct: bool | None = None) -> dict[str, float]:
    """One cold epoch of ``steps`` batches of 256 from ``folder``; its rates. ``direct``: the
    reader's direct I/O (None: its own choice)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    files = sorted(folder.glob("*.parquet"))
    file_bytes = sum(f.stat().st_size for f in files)
    record = EpochInput(epoch=0)
    cpu, started = _cpu(), time.perf_counter()
    batches = epoch_batches(
        as_url(folder),
        SPEC,
        rank=0,
        num_ranks=1,
        seed=0,
        epoch=0,
        batch_size=256,
        steps=steps,
        shuffle_buffer=512,
        record=record,
        direct=direct,
    )
    for _batch in batches:
        pass
    wall, cpu = time.perf_counter() - started, _cpu() - cpu
    rows = record.bytes_read // (ROW_BYTES + 8)
    total_rows = _rows(files)
    decoded = rows * ROW_BYTES
    return {
        "rows_per_second": rows / wall,
        "file_mb_s": rows / total_rows * file_bytes / wall / 1e6,
        "decoded_mb_s": decoded / wall / 1e6,
        "cpu_seconds_per_decoded_gb": cpu / (decoded / 1e9),
        "load": os.getloadavg()[0],
    }


def round_line(number: int, name: str, got: dict[str, float]) -> str:
    """One side's figures of round ``number`` (from 0) as :func:`read_cold` measured them."""
    return (
        f"round {number + 1} {name:10s} rows/s {got['rows_per_second']:7,.0f}  "
        f"files {got['file_mb_s']:5.0f} MB/s  decoded {got['decoded_mb_s']:5.0f} MB/s  "
        f"{got['cpu_seconds_per_decoded_gb']:.2f} CPU-s/GB  load {got['load']:.1f}"
    )


def _rows(files: list[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(f).num_rows for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plain", type=Path)
    parser.add_argument("dictionary", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--names", default="plain,dictionary", help="the two folders' names in the output"
    )
    parser.add_argument(
        "--direct", action="store_true", help="both sides read with direct I/O (O_DIRECT)"
    )
    args = parser.parse_args(argv)
    first, second = args.names.split(",")
    sides = {first: args.plain, second: args.dictionary}
    for number in range(args.rounds):
        for name in sides if number % 2 == 0 else reversed(sides):
            got = read_cold(sides[name], args.steps, direct=True if args.direct else None)
            print(round_line(number, name, got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
