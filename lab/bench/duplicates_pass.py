"""The SDSS duplicates pass alone, one bucket per task against buckets grouped per task (issue
#27): ``python -m lab.bench.duplicates_pass KEYS_FOLDER [--buckets N] [--rounds R]``.

KEYS_FOLDER holds a processed version's ``_state/keys/part-NNNNN.arrow``. Every task of each
side runs in turn on this process's main thread (so that the process's CPU time is the pass's),
into a fresh work folder; the sides alternate round by round, and their duplicates files must
be the same bytes. Prints one JSON line: each round's wall and CPU seconds, the ratios of the
medians, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from preprocessing import sdss


def _run(
    groups: list[tuple[int, int]], num_buckets: int, keys: tuple[tuple[int, str], ...]
) -> tuple[float, float, dict[int, bytes]]:
    work = tempfile.mkdtemp(prefix="duplicates-pass-")
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for group in groups:
            sdss.find_duplicates(group, num_buckets, keys, work)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        written = {
            bucket: sdss.duplicates_path(work, bucket).read_bytes() for bucket in range(num_buckets)
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return wall, cpu, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys_folder", type=Path)
    parser.add_argument("--buckets", type=int, default=256, help="a power of two")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    files = sorted(args.keys_folder.glob("part-*.arrow"))
    keys = tuple((int(path.stem.split("-")[1]), str(path)) for path in files)
    sides = {
        "one_bucket_per_task": [(b, b + 1) for b in range(args.buckets)],
        "grouped": sdss.duplicate_task_buckets(args.buckets),
    }
    load_before = os.getloadavg()
    rounds: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _round in range(args.rounds):
        outputs = []
        for side, groups in sides.items():
            wall, cpu, written = _run(groups, args.buckets, keys)
            rounds[side].append((round(wall, 3), round(cpu, 3)))
            outputs.append(written)
        assert outputs[0] == outputs[1], "the two sides wrote other duplicates files"
    median = {
        side: [statistics.median(r[i] for r in rounds[side]) for i in (0, 1)] for side in sides
    }
    base, grouped = median["one_bucket_per_task"], median["grouped"]
    print(
        json.dumps(
            {
                "keys_files": len(files),
                "buckets": args.buckets,
                "tasks": {side: len(groups) for side, groups in sides.items()},
                "rounds_wall_cpu_s": rounds,
                "grouped_vs_one_per_task": {
                    "wall": round(grouped[0] / base[0], 3),
                    "cpu": round(grouped[1] / base[1], 3),
                },
                "load_average": {"before": load_before, "after": os.getloadavg()},
            }
        )
    )


if __name__ == "__main__":
    main()
