"""Which split a sample belongs to, from a hash of its stable id alone.

A sample's split depends on nothing but its id and the fractions: not on the order of the
input, on which shard or worker sees it, or on the other samples. Adding data never moves a
sample from test into train.

The hash is SplitMix64's finaliser, vectorised in numpy: fast enough to run inside every shard
task over millions of ids, and fixed forever (changing it would reshuffle every split).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

SPLITS = ("train", "validation", "test")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64 of each value (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def sample_hash(*id_parts: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """One 64-bit hash per sample of an id made of one or more uint64 columns."""
    if not id_parts:
        raise ValueError("a sample id needs at least one column")
    h = mix64(np.asarray(id_parts[0], dtype=np.uint64))
    for part in id_parts[1:]:
        h = mix64(h ^ np.asarray(part, dtype=np.uint64))
    return h


def validate_fractions(fractions: Mapping[str, float]) -> None:
    unknown = set(fractions) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; known: {', '.join(SPLITS)}")
    if any(f < 0 for f in fractions.values()):
        raise ValueError("split fractions cannot be negative")
    if abs(sum(fractions.values()) - 1.0) > 1e-9:
        raise ValueError(f"split fractions must add up to 1, got {sum(fractions.values())}")


def assign(hashes: npt.NDArray[np.uint64], fractions: Mapping[str, float]) -> npt.NDArray[np.int8]:
    """The split of each hash as an index into :data:`SPLITS`.

    The hash range is cut in the fixed order train, validation, test, at boundaries computed
    in integers, so the same fractions always cut at the same places.
    """
    validate_fractions(fractions)
    out = np.full(hashes.shape, SPLITS.index("test"), dtype=np.int8)
    upper = 0
    done = np.zeros(hashes.shape, dtype=bool)
    for code, split in enumerate(SPLITS):
        share = fractions.get(split, 0.0)
        upper = min(2**64, upper + round(share * 2**64))
        below = hashes < np.uint64(upper) if upper < 2**64 else np.ones(hashes.shape, bool)
        take = below & ~done
        out[take] = code
        done |= take
    return out


def select(
    hashes: npt.NDArray[np.uint64], fractions: Mapping[str, float], split: str
) -> npt.NDArray[np.bool_]:
    """Mask of the samples that fall in ``split``."""
    mask: npt.NDArray[np.bool_] = assign(hashes, fractions) == SPLITS.index(split)
    return mask
