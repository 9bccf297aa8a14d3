"""Normalisation statistics from partial sums: each shard (or piece) sums what it wrote, the
commit combines the sums in a fixed order, so the figures are exact and the same on every run
however the work was split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from data_catalog.layout import Normalization


def combine_sums(sums: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Mean and standard deviation per channel (or feature) from partial sums
    (``{"count", "sum", "sumsq"}``), combined in the given order (fixed by the caller)."""
    count = sum(int(s["count"]) for s in sums)
    total = np.sum([s["sum"] for s in sums], axis=0)
    total_sq = np.sum([s["sumsq"] for s in sums], axis=0)
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - np.square(mean), 0.0))
    return {"mean": [float(m) for m in mean], "std": [float(s) for s in std]}


def normalization_of(sums: Sequence[dict[str, Any]], over: str) -> Normalization:
    """The layout's normalisation statistics from the training split's partial sums."""
    combined = combine_sums(sums)
    return Normalization(mean=tuple(combined["mean"]), std=tuple(combined["std"]), over=over)
