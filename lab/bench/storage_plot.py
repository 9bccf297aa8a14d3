"""The plot of docs/training.md's "Feeding accelerators": ``python -m lab.bench.storage_plot
OUT.png RESULT.json...`` (each the last line of ``shardflow bench storage ... --json``).

Left: each run's AU against MLPerf Storage's 0.9; right: the most emulated accelerators the
host kept at AU ≥ 0.9, with what bound them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def label(result: dict[str, Any]) -> str:
    acc = result["accelerator"]
    shape = "x".join(map(str, result["sample_shape"]))
    state = "cold" if result["cold"] else "warm"
    return (
        f"{acc['model']} {shape}, {acc['accelerator']} b{acc['batch_size']}, "
        f"{result['num_ranks']} rank(s), {state}"
    )


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(r) for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.6 * len(results) + 1.6), sharey=True)
    rows = range(len(results))
    left.barh(rows, [r["au"] for r in results], color="tab:blue")
    left.axvline(0.9, color="tab:red", linestyle="--", label="MLPerf Storage's 0.9")
    left.set_xlim(0, 1.05)
    left.set_yticks(list(rows), names)
    left.set_xlabel("AU (lowest rank, best round)")
    left.legend(loc="lower right", fontsize=8)
    right.barh(rows, [r["max_accelerators"] for r in results], color="tab:green")
    for row, result in zip(rows, results, strict=True):
        capped = "+" if result.get("max_accelerators_capped") else ""
        right.text(
            result["max_accelerators"] + 0.05,
            row,
            f"{result['max_accelerators']}{capped} "
            f"({result.get('max_accelerators_bound', result['binding'])})",
            va="center",
            fontsize=8,
        )
    right.set_xlabel("emulated accelerators kept at AU ≥ 0.9 (what binds)")
    right.set_xlim(0, max(r["max_accelerators"] for r in results) + 2.5)
    fig.suptitle("shardflow's input feeding emulated accelerators on this 2-core host", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    out, *files = argv
    results = [json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in files]
    plot(results, Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
