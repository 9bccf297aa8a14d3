"""One rank's reader with and without direct I/O, cold, in a memory cgroup, side by side.

    python -m lab.bench.direct_io DIR [--memory-limit 2.7G] [--rounds 4] [--steps 150]

DIR holds training rows of 224x224x3 images and labels (a split grown by ``shardflow bench
storage --grow-rows R --image-size 224 --grown-dir DIR``). Each round reads it twice through
the per-rank reader ``training.input.epoch_batches`` (the epoch's order, the reader threads, a
shuffle window of 512 rows, batches of 256): through the page cache (``direct=False``) and with
``O_DIRECT`` (``direct=True``, training.row_groups), the order alternating, each in a process of
its own inside a memory cgroup of ``--memory-limit`` (page cache charged to it, as in ``bench
storage``) after ``sync`` and ``drop_caches`` (root). Prints rows/s, MB/s of files and of
decoded pixels, CPU-seconds per decoded GB and the load average, per round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from lab.bench.image_encodings import read_cold, round_line
from lab.bench.storage import _joiner, memory_cgroup, parse_size

SIDES = {"buffered": False, "direct": True}


def _one(folder: Path, steps: int, direct: bool) -> int:
    print(json.dumps(read_cold(folder, steps, direct=direct)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--memory-limit", type=parse_size, default=parse_size("2.7G"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--one", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(args.folder, args.steps, SIDES[args.one])
    with memory_cgroup(args.memory_limit) as procs:
        for number in range(args.rounds):
            for name in SIDES if number % 2 == 0 else reversed(list(SIDES)):
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "lab.bench.direct_io",
                        str(args.folder),
                        "--steps",
                        str(args.steps),
                        "--one",
                        name,
                    ],
                    capture_output=True,
                    text=True,
                    preexec_fn=_joiner(procs),
                    check=False,
                )
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                got = json.loads(done.stdout.strip().splitlines()[-1])
                print(round_line(number, name, got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
