"""The constants both peers share with shardflow's SDSS stage: the columns, the checks in the
order a row's first failure is reported, the split boundaries, the hash (SplitMix64). Plain
Python: each peer expresses the computation in its own engine."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

BANDS = ("u", "g", "r", "i", "z")
MAGNITUDES = (*BANDS, *(f"petroMag_{b}" for b in BANDS))
RADII = tuple(f"petroRad_{b}" for b in BANDS)
CLASSES = ("STAR", "GALAXY", "QSO")
COLOURS = ("u_g", "g_r", "r_i", "i_z")
FEATURES = (*BANDS, *COLOURS, *(f"petroMag_{b}" for b in BANDS), *RADII)
MAGNITUDE_RANGE = (0.0, 40.0)  # outside: an SDSS sentinel (-9999 ...)
RADIUS_RANGE = (0.0, 1_000.0)
DUPLICATE = "duplicate (objid, specobjid)"
# A raw file's row groups (ingest writes 100,000 rows each) are shardflow's pieces: a repeat of a
# key is quarantined if an earlier row of its piece has the key (good or bad), or a good row of a
# lower piece that is the first of its piece with the key.
PIECE_ROWS = 100_000
# SplitMix64's finaliser (preprocessing/splits.py); the split hash is mix(mix(objid) ^ specobjid).
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Splits cut the hash range in the order train, validation, test at these integers.
TRAIN_BELOW = round(0.8 * 2**64)
VALIDATION_BELOW = TRAIN_BELOW + round(0.1 * 2**64)
SPLITS = ("train", "validation", "test")
ROW_GROUP_ROWS = 100_000  # ingest's Parquet row groups


def checks() -> list[tuple[str, str, str]]:
    """(column, kind, reason) in the order shardflow reports a row's first failure; kind is
    nan, infinite (not finite: NaN too), sentinel (outside the column's range), or unknown
    (class)."""
    out = []
    for name in (*MAGNITUDES, *RADII):
        out += [(name, kind, f"{kind}:{name}") for kind in ("nan", "infinite", "sentinel")]
    # Any redshift that is not finite (NaN or infinite) is reported as "nan:redshift".
    return [*out, ("redshift", "infinite", "nan:redshift"), ("class", "unknown", "unknown class")]


def value_range(name: str) -> tuple[float, float]:
    return MAGNITUDE_RANGE if name in MAGNITUDES else RADIUS_RANGE


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM: ``ru_maxrss`` would start at the bench's size)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def report(result: dict[str, Any], out: Path) -> None:
    """The one JSON line a peer prints: its counts and the digests of what it wrote."""
    result["files"] = {p.name: sha256(p) for p in sorted(out.glob("*.parquet"))}
    result["peak_rss_bytes"] = peak_rss_bytes()
    json.dump(result, sys.stdout)
    print()
