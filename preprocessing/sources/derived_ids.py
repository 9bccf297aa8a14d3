"""SDSS exports without usable ids: (objid, specobjid) rebuilt from the columns that hold them.

The widely copied DR14 sample (SkyServer's SQL search, then a spreadsheet) has no ``objid``
and a ``specobjid`` mangled to a float (``3.72E+18``); it keeps what the ids are made of:

    specobjid = plate << 50 | fiberid << 38 | (mjd - 50000) << 24 | run2d << 10 | line
    objid     = skyVersion << 59 | rerun << 48 | run << 32 | camcol << 29 | firstField << 28
                | field << 16 | obj

header matched (:func:`variant_of`) ── the CSV read with :data:`READ` types (ids' parts exact
    │  uint64, the mangled specobjid kept as its text)
    ▼  :func:`derive`, per batch
rows of :data:`COLUMNS`: objid and specobjid *derived* (run2d, line, firstField and obj are not
in the file: 0; skyVersion 2, as every DR8+ objID), the parts and the exported text kept beside
them; the Parquet schema's metadata names the derived columns and how (:data:`DERIVED`), and
the ingest copies that into the raw version's sources

(plate, mjd, fiberid) names one spectrum, so the derived specobjid is unique wherever the
originals were; the derived objid names the photometric field only (many objects share it):
the pair is a key, objid alone is not, and neither is SDSS's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from preprocessing.sources.errors import SourceError
from preprocessing.sources.sdss import FLOAT64, STRING, UINT64

__all__ = ["COLUMNS", "DERIVED", "METADATA_KEY", "READ", "derive", "derived_of", "variant_of"]

_BANDS = ("u", "g", "r", "i", "z")
_PARTS = ("run", "rerun", "camcol", "field", "plate", "mjd", "fiberid")

# The sample's columns as the file names them, and the types they are read with.
READ: dict[str, str] = {
    "ra": FLOAT64,
    "dec": FLOAT64,
    **{b: FLOAT64 for b in _BANDS},
    **{p: UINT64 for p in _PARTS},
    "specobjid": STRING,
    "class": STRING,
    "redshift": FLOAT64,
}

# The raw file's columns: the ids first, as in every other raw SDSS file; the mangled export
# text kept (raw data is kept as it came), renamed so that nothing takes it for an id.
COLUMNS: dict[str, str] = {
    "objid": UINT64,
    "ra": FLOAT64,
    "dec": FLOAT64,
    **{b: FLOAT64 for b in _BANDS},
    "specobjid": UINT64,
    "class": STRING,
    "redshift": FLOAT64,
    **{p: UINT64 for p in _PARTS},
    "specobjid_exported": STRING,
}

DERIVED: dict[str, str] = {
    "objid": "derived, not SDSS's objID: 2 << 59 | rerun << 48 | run << 32 | camcol << 29 | "
    "field << 16 (firstField and obj are not in the export: 0); names the photometric field, "
    "shared by the objects in it",
    "specobjid": "derived: plate << 50 | fiberid << 38 | (mjd - 50000) << 24 (run2d and line "
    "are not in the export: 0); unique per (plate, mjd, fiberid); the export's own value is "
    "kept as text in specobjid_exported",
}

# Where the Parquet file's Arrow schema says which columns are derived (JSON of DERIVED).
METADATA_KEY = b"shardflow.derived"

_SKY_VERSION = 2
_MJD_ZERO = 50_000


@dataclass(frozen=True)
class Variant:
    """An export whose ids are rebuilt: its columns as named in the file, read as ``READ``."""

    names: tuple[str, ...]
    """The file's header, in order."""

    @property
    def read_kinds(self) -> dict[str, str]:
        """Canonical name -> type, in the file's order (names matched case-insensitively)."""
        return {name.lower(): READ[name.lower()] for name in self.names}

    @property
    def schema(self) -> pa.Schema:
        fields = [pa.field(name, _ARROW[kind], nullable=False) for name, kind in COLUMNS.items()]
        return pa.schema(fields, metadata={METADATA_KEY: json.dumps(DERIVED, sort_keys=True)})


_ARROW = {UINT64: pa.uint64(), FLOAT64: pa.float64(), STRING: pa.string()}


def variant_of(names: Sequence[str]) -> Variant | None:
    """The variant when ``names`` are exactly the sample's columns (in any order and letter
    case), else None (the export is matched against the full schema as usual)."""
    lowered = [n.strip().lower() for n in names]
    if len(set(lowered)) != len(lowered) or set(lowered) != set(READ):
        return None
    return Variant(names=tuple(lowered))


def _shifted(column: pa.Array, bits: int, limit: int, name: str, at: tuple[str, int]) -> pa.Array:
    """``column << bits``, refusing a value that would not fit its field of the id; ``at`` is
    (the file, the number of the batch's first row) for the message."""
    too_big = pc.greater_equal(column, pa.scalar(limit, pa.uint64()))
    if pc.any(too_big).as_py():
        index = pc.index(too_big, True).as_py()
        raise SourceError(
            f"{at[0]}: {name} in row {at[1] + index} is {column[index].as_py()}, too large for "
            f"its field of the SDSS id (below {limit:,}); cannot derive the ids"
        )
    return pc.shift_left(column, pa.scalar(bits, pa.uint64()))


def derive(batch: pa.RecordBatch, schema: pa.Schema, where: str, first_row: int) -> pa.RecordBatch:
    """A batch of the sample (in ``READ`` types) as rows of ``schema`` (:data:`COLUMNS`), the
    ids derived; a part of an id out of its field's range is refused naming the row."""
    col = {name: batch.column(name) for name in batch.schema.names}
    mjd = col["mjd"]
    early = pc.less(mjd, pa.scalar(_MJD_ZERO, pa.uint64()))
    if pc.any(early).as_py():
        row = first_row + pc.index(early, True).as_py()
        raise SourceError(f"{where}: mjd in row {row} is before 50000; cannot derive specobjid")
    at = (where, first_row)
    days = pc.subtract(mjd, pa.scalar(_MJD_ZERO, pa.uint64()))
    spec_parts = [
        _shifted(col["plate"], 50, 1 << 14, "plate", at),
        _shifted(col["fiberid"], 38, 1 << 12, "fiberid", at),
        _shifted(days, 24, 1 << 14, "mjd - 50000", at),
    ]
    obj_parts = [
        pa.array([_SKY_VERSION << 59] * batch.num_rows, pa.uint64()),
        _shifted(col["rerun"], 48, 1 << 11, "rerun", at),
        _shifted(col["run"], 32, 1 << 16, "run", at),
        _shifted(col["camcol"], 29, 1 << 3, "camcol", at),
        _shifted(col["field"], 16, 1 << 12, "field", at),
    ]
    ids = {"specobjid": _or(spec_parts), "objid": _or(obj_parts)}
    arrays = []
    for name in schema.names:
        if name in ids:
            arrays.append(ids[name])
        elif name == "specobjid_exported":
            arrays.append(col["specobjid"])
        else:
            arrays.append(col[name])
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _or(parts: Sequence[Any]) -> pa.Array:
    total = parts[0]
    for part in parts[1:]:
        total = pc.bit_wise_or(total, part)
    return total


def derived_of(schema: pa.Schema) -> dict[str, str]:
    """The derived columns a raw file's schema names, and how each was made ({} for none)."""
    metadata: Mapping[bytes, bytes] = schema.metadata or {}
    text = metadata.get(METADATA_KEY)
    if text is None:
        return {}
    found: dict[str, str] = json.loads(text)
    return found
