"""Synthetic SDSS exports, in the CasJobs shapes ``sdss.ingest_exports`` reads (CSV, FITS).

No registry holds a real SDSS class table, so volume is made here, and says so: every row carries
``provenance = "synthetic"``, and FITS headers ``SYNTHETC = T``.

Per-class draws are calibrated on a real DR14 sample of 10,000 spectroscopic objects with the
query's cuts (u < 19.6, g < 20): class shares, r percentiles (p5 / p50 / p95, as a split normal),
colour means and spreads (u-g correlated with g-r), redshift percentiles. Petrosian magnitudes and
radii were not in that sample: they are MODELLED (point sources petroRad_r near 1.5", galaxies
4-6"). Colours of rows outside the cuts are redrawn. A few rows carry SDSS's -9999 "missing"
sentinel.

Files are written one at a time, each in chunks: memory does not grow with ``rows``.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from preprocessing.sources.errors import SourceError
from preprocessing.sources.sdss import COLUMNS

__all__ = ["CALIBRATION", "write_sdss_exports"]

SENTINEL = -9999.0
_CHUNK = 50_000
_BANDS = ("u", "g", "r", "i", "z")

# The real layout of specObjID: plate (14 bits) | fiber (12) | mjd - 50000 (14) | run2d (14).
_PLATES = range(266, 12_001)  # plates >= 8192 put specObjID above 2^63
_FIBERS = 1_000
_SLOTS = len(_PLATES) * _FIBERS
_STRIDE = 7_654_321  # coprime with _SLOTS: k -> k * _STRIDE mod _SLOTS is a bijection
_FIRST_OBJID = 1_237_645_876_861_272_064


@dataclass(frozen=True)
class ClassModel:
    share: float
    r: tuple[float, float, float]  # p5, p50, p95
    colours: tuple[tuple[float, float], ...]  # (mean, sd) of u-g, g-r, r-i, i-z
    ug_gr_correlation: float
    redshift: tuple[float, float, float]  # p5, p50, p95
    petro_rad_r: tuple[float, float]  # mean, sd (MODELLED)
    petro_offset: tuple[float, float]  # petroMag - mag: mean, sd (MODELLED)


CALIBRATION: dict[str, ClassModel] = {
    "STAR": ClassModel(
        share=0.415,
        r=(14.88, 16.79, 18.30),
        colours=((1.20, 0.42), (0.40, 0.29), (0.14, 0.30), (0.06, 0.29)),
        ug_gr_correlation=0.76,
        redshift=(-0.0006, 0.0000, 0.0007),
        petro_rad_r=(1.5, 0.2),
        petro_offset=(0.02, 0.05),
    ),
    "GALAXY": ClassModel(
        share=0.500,
        r=(15.10, 16.74, 17.72),
        colours=((1.45, 0.37), (0.70, 0.24), (0.38, 0.11), (0.25, 0.13)),
        ug_gr_correlation=0.82,
        redshift=(0.024, 0.077, 0.145),
        petro_rad_r=(5.0, 0.6),
        petro_offset=(0.05, 0.15),
    ),
    "QSO": ClassModel(
        share=0.085,
        r=(17.17, 18.66, 19.29),
        colours=((0.26, 0.27), (0.18, 0.21), (0.14, 0.16), (0.09, 0.18)),
        ug_gr_correlation=0.0,  # not measured: drawn independently
        redshift=(0.17, 1.23, 2.24),
        petro_rad_r=(1.5, 0.2),
        petro_offset=(0.02, 0.05),
    ),
}
_CLASSES = tuple(CALIBRATION)
_Z95 = 1.6448536269514722


def _split_normal(
    rng: np.random.Generator, p: tuple[float, float, float], n: int
) -> npt.NDArray[np.float64]:
    """Draws with the given p5 / p50 / p95: a normal with a different spread on each side."""
    p5, p50, p95 = p
    z = rng.standard_normal(n)
    low, high = (p50 - p5) / _Z95, (p95 - p50) / _Z95
    return np.where(z < 0, p50 + z * low, p50 + z * high)


def _colours_inside(
    rng: np.random.Generator,
    model: ClassModel,
    r: npt.NDArray[np.float64],
    shift: tuple[float, float],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(u-g, g-r) for each r, redrawn until u < 19.6 and g < 20."""
    (ug_m, ug_s), (gr_m, gr_s) = model.colours[:2]
    ug_m, gr_m = ug_m + shift[0], gr_m + shift[1]
    rho = model.ug_gr_correlation
    n = len(r)
    ug = np.empty(n)
    gr = np.empty(n)
    todo = np.arange(n)
    for _attempt in range(50):
        if todo.size == 0:
            break
        a, b = rng.standard_normal(todo.size), rng.standard_normal(todo.size)
        gr[todo] = gr_m + gr_s * a
        ug[todo] = ug_m + ug_s * (rho * a + np.sqrt(1 - rho * rho) * b)
        g_try = r[todo] + gr[todo]
        u_try = g_try + ug[todo]
        todo = todo[~((u_try > 0) & (u_try < 19.6) & (g_try > 0) & (g_try < 20.0))]
    # Rows still outside (very faint r): squeeze their colours just inside the cuts.
    gr[todo] = np.minimum(gr[todo], 19.99 - r[todo])
    ug[todo] = np.minimum(ug[todo], 19.59 - r[todo] - gr[todo])
    return ug, gr


@functools.cache
def _colour_shift(cls: str) -> tuple[float, float]:
    """How far to move the drawn colour means so that they match the calibration AFTER the cuts
    (redrawing faint rows' colours pulls the means blue). Found on a fixed pilot sample."""
    model = CALIBRATION[cls]
    pilot = np.random.default_rng(20_240_601)
    r = _split_normal(pilot, model.r, 40_000)
    shift = (0.0, 0.0)
    for _round in range(6):
        ug, gr = _colours_inside(np.random.default_rng(7), model, r, shift)
        shift = (
            shift[0] + model.colours[0][0] - float(ug.mean()),
            shift[1] + model.colours[1][0] - float(gr.mean()),
        )
    return shift


def _draw_class(rng: np.random.Generator, cls: str, n: int) -> dict[str, Any]:
    """``n`` rows of one class, all inside the cuts u < 19.6, g < 20.

    The calibration was measured after the cuts, so r keeps its drawn value (its percentiles
    are the calibrated ones) and only the colours of a row outside the cuts are redrawn, from
    means shifted so that the kept colours average to the calibrated ones.
    """
    model = CALIBRATION[cls]
    (ri_m, ri_s), (iz_m, iz_s) = model.colours[2:]
    r = _split_normal(rng, model.r, n)
    ug, gr = _colours_inside(rng, model, r, _colour_shift(cls))
    ri = ri_m + ri_s * rng.standard_normal(n)
    iz = iz_m + iz_s * rng.standard_normal(n)
    g = r + gr
    i = r - ri
    mags = {"u": g + ug, "g": g, "r": r, "i": i, "z": i - iz}
    out: dict[str, Any] = dict(mags)
    off_m, off_s = model.petro_offset
    rad_m, rad_s = model.petro_rad_r
    rad_r = np.clip(rad_m + rad_s * rng.standard_normal(n), 0.5, None)
    for band, scale in zip(_BANDS, (1.15, 1.05, 1.0, 0.98, 0.97), strict=True):
        out[f"petroMag_{band}"] = mags[band] + off_m + off_s * rng.standard_normal(n)
        out[f"petroRad_{band}"] = np.clip(rad_r * scale + 0.1 * rng.standard_normal(n), 0.3, None)
    redshift = _split_normal(rng, model.redshift, n)
    out["redshift"] = redshift if model.redshift[0] < 0 else np.clip(redshift, 0.0, None)
    return out


def _chunk(rng: np.random.Generator, start: int, n: int, last_objid: int) -> dict[str, Any]:
    """Rows ``start`` .. ``start + n`` of the whole set, in objid order."""
    shares = np.array([CALIBRATION[c].share for c in _CLASSES])
    labels = rng.choice(len(_CLASSES), size=n, p=shares / shares.sum())
    rows: dict[str, Any] = {}
    for k, cls in enumerate(_CLASSES):
        where = np.flatnonzero(labels == k)
        drawn = _draw_class(rng, cls, len(where))
        for name, values in drawn.items():
            rows.setdefault(name, np.empty(n))[where] = values
    rows["class"] = np.array(_CLASSES)[labels]
    gaps = rng.integers(1, 1_000, size=n, dtype=np.uint64)
    rows["objid"] = np.uint64(last_objid) + np.cumsum(gaps, dtype=np.uint64)
    slot = (np.arange(start, start + n, dtype=np.uint64) * np.uint64(_STRIDE)) % np.uint64(_SLOTS)
    plate = np.uint64(_PLATES.start) + slot // np.uint64(_FIBERS)
    fiber = np.uint64(1) + slot % np.uint64(_FIBERS)
    mjd = rng.integers(51_600, 58_900, size=n, dtype=np.uint64) - np.uint64(50_000)
    rows["specobjid"] = (
        (plate << np.uint64(50))
        | (fiber << np.uint64(38))
        | (mjd << np.uint64(24))
        | (np.uint64(26) << np.uint64(10))
    )
    rows["ra"] = rng.uniform(0.0, 360.0, n)
    rows["dec"] = np.degrees(
        np.arcsin(rng.uniform(np.sin(np.radians(-10.0)), np.sin(np.radians(70.0)), n))
    )
    # SDSS's missing-photometry sentinel, mostly in u.
    for name, rate in (("petroMag_u", 0.004), ("petroRad_u", 0.004), ("petroRad_z", 0.001)):
        rows[name][rng.random(n) < rate] = SENTINEL
    rows["provenance"] = np.full(n, "synthetic")
    return rows


def _chunks(rng: np.random.Generator, start: int, n: int, objid: int) -> Iterator[dict[str, Any]]:
    done = 0
    while done < n:
        size = min(_CHUNK, n - done)
        rows = _chunk(rng, start + done, size, objid)
        objid = int(rows["objid"][-1])
        done += size
        yield rows


_NAMES = [name for name, _t, _c, _k in COLUMNS] + ["provenance"]
_KINDS = {name: kind for name, _t, _c, kind in COLUMNS} | {"provenance": "string"}


def _write_csv(path: Path, chunks: Iterator[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(_NAMES)
        for rows in chunks:
            text = {
                name: (
                    [str(v) for v in rows[name].tolist()]
                    if _KINDS[name] != "float64"
                    else [repr(v) for v in rows[name].tolist()]
                )
                for name in _NAMES
            }
            writer.writerows(zip(*(text[name] for name in _NAMES), strict=True))


_FITS_BLOCK = 2880


def _fits_dtype() -> np.dtype[Any]:
    fields: list[tuple[str, str]] = []
    for name in _NAMES:
        kind = _KINDS[name]
        fields.append((name, ">i8" if kind == "uint64" else ">f8" if kind == "float64" else "S9"))
    return np.dtype(fields)


def _write_fits(path: Path, rows: int, chunks: Iterator[dict[str, Any]]) -> None:
    """A binary-table FITS file written record chunk by record chunk (uint64 via TZERO)."""
    from astropy.io import fits

    columns = []
    for name in _NAMES:
        kind = _KINDS[name]
        if kind == "uint64":
            columns.append(fits.Column(name=name, format="K", bzero=2**63))
        elif kind == "float64":
            columns.append(fits.Column(name=name, format="D"))
        else:
            columns.append(fits.Column(name=name, format="9A"))
    hdu = fits.BinTableHDU.from_columns(columns, nrows=0)
    header = hdu.header
    header["NAXIS2"] = rows
    header["SYNTHETC"] = (True, "synthetic rows, not SDSS measurements")
    header["ORIGIN"] = "shardflow preprocessing.sources.synth"
    header["COMMENT"] = "Calibrated on a real DR14 sample; Petrosian mags and radii modelled."
    dtype = _fits_dtype()
    with open(path, "wb") as f:
        f.write(fits.PrimaryHDU().header.tostring().encode("ascii"))
        f.write(header.tostring().encode("ascii"))
        written = 0
        for chunk in chunks:
            n = len(chunk["objid"])
            record = np.empty(n, dtype=dtype)
            for name in _NAMES:
                kind = _KINDS[name]
                if kind == "uint64":
                    record[name] = (chunk[name] - np.uint64(2**63)).view(np.int64)
                elif kind == "float64":
                    record[name] = chunk[name]
                else:
                    record[name] = np.char.encode(chunk[name].astype(str), "ascii")
            data = record.tobytes()
            f.write(data)
            written += len(data)
        f.write(b"\0" * (-written % _FITS_BLOCK))


def write_sdss_exports(
    dest_dir: Path,
    *,
    rows: int,
    files: int,
    fmt: Literal["csv", "fits"],
    seed: int = 0,
) -> list[Path]:
    """Write ``rows`` synthetic rows as ``files`` CasJobs-style exports in ``dest_dir``.

    Rows are in objid order across files; the same seed gives the same bytes.
    """
    if fmt not in ("csv", "fits"):
        raise SourceError(f"synthetic export format {fmt!r}: use csv or fits")
    if not 1 <= files <= rows:
        raise SourceError(f"cannot split {rows:,} rows into {files:,} files")
    if rows > _SLOTS:
        raise SourceError(f"at most {_SLOTS:,} synthetic rows (unique plate/fiber pairs)")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written: list[Path] = []
    objid = _FIRST_OBJID
    start = 0
    for number in range(files):
        n = rows // files + (1 if number < rows % files else 0)
        path = dest_dir / f"sdss-synthetic-{number:04d}.{fmt}"
        last: list[int] = [objid]

        def tracked(
            chunks: Iterator[dict[str, Any]], last: list[int] = last
        ) -> Iterator[dict[str, Any]]:
            for chunk in chunks:
                last[0] = int(chunk["objid"][-1])
                yield chunk

        chunks = tracked(_chunks(rng, start, n, objid))
        partial = path.with_name(path.name + ".part")
        if fmt == "csv":
            _write_csv(partial, chunks)
        else:
            _write_fits(partial, n, chunks)
        partial.replace(path)
        objid = last[0]
        start += n
        written.append(path)
    return written
