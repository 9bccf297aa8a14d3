from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from astropy.table import Table
from numpy.typing import NDArray

from data_catalog import Catalog, Manifest
from preprocessing.sources import exports, sdss
from tests.preprocessing.sources.skyserver_standin import BIG_SPECOBJID, HEADER, synthetic_rows

NAMES = HEADER.split(",")


def _lines(n: int, seed: int = 0) -> list[str]:
    return [r[2] for r in synthetic_rows(n, seed)]


def write_csv(path: Path, lines: list[str], header: list[str] | None = None) -> Path:
    # CasJobs spells columns as declared (objID, petroMag_r): matching ignores case.
    names = header or [n.replace("objid", "objID").upper() if n == "ra" else n for n in NAMES]
    path.write_text(",".join(names) + "\n" + "".join(line + "\n" for line in lines))
    return path


def _table(lines: list[str]) -> Table:
    cells = [line.split(",") for line in lines]
    columns = {}
    for i, (name, _t, _c, kind) in enumerate(sdss.COLUMNS):
        values = [c[i] for c in cells]
        if kind == sdss.UINT64:
            columns[name] = np.array([int(v) for v in values], dtype=np.uint64)
        elif kind == sdss.FLOAT64:
            columns[name] = np.array([float(v) for v in values])
        else:
            columns[name] = np.array(values)
    return Table(columns)


def write_fits(path: Path, lines: list[str], **overrides: NDArray[Any]) -> Path:
    table = _table(lines)
    for name, values in overrides.items():
        table[name] = values
    table.write(path, format="fits")
    return path


def write_votable(path: Path, lines: list[str]) -> Path:
    table = _table(lines)
    # VOTable has no unsigned long: ids as long where they fit, as text where they do not.
    table["objid"] = table["objid"].astype(np.int64)
    table["specobjid"] = np.array([str(int(v)) for v in table["specobjid"]])
    table.write(path, format="votable")
    return path


def _all(catalog: Catalog, manifest: Manifest, name: str) -> list[object]:
    out: list[object] = []
    for entry in manifest.files:
        out += pq.read_table(catalog.file_path(manifest, entry)).column(name).to_pylist()
    return out


def test_csv_fits_votable_ingest(tmp_path: Path) -> None:
    lines = _lines(3_000)
    src = tmp_path / "exports"
    src.mkdir()
    write_csv(src / "a.csv", lines[:1_000])
    write_fits(src / "b.fits", lines[1_000:2_000])
    write_votable(src / "c.vot", lines[2_000:])
    (src / "README.txt").write_text("ignored")
    catalog = Catalog(tmp_path / "catalog")
    manifest = exports.ingest_exports(catalog, source=str(src))
    assert manifest.rows == 3_000
    assert len(manifest.files) == 3
    assert [s["format"] for s in manifest.sources] == ["csv", "fits", "votable"]
    objids = _all(catalog, manifest, "objid")
    assert objids == [int(line.split(",")[0]) for line in lines]
    assert BIG_SPECOBJID in _all(catalog, manifest, "specobjid")
    table = pq.read_table(catalog.file_path(manifest, manifest.files[1]))
    assert str(table.schema.field("specobjid").type) == "uint64"
    assert str(table.schema.field("class").type) == "string"


def test_glob_and_row_groups(tmp_path: Path) -> None:
    lines = _lines(500)
    for i in range(3):
        write_csv(tmp_path / f"part{i}.csv", lines[i * 100 : (i + 1) * 100 + 50 * i])
    catalog = Catalog(tmp_path / "catalog")
    manifest = exports.ingest_exports(catalog, source=str(tmp_path / "part*.csv"))
    assert manifest.rows == 100 + 150 + 200
    assert [e.rows for e in manifest.files] == [100, 150, 200]
    assert [e.row_groups for e in manifest.files] == [1, 1, 1]  # groups of 100,000 rows


def test_fits_and_csv_twins_give_the_same_rows(tmp_path: Path) -> None:
    lines = _lines(200)
    write_fits(tmp_path / "part.fits", lines)
    write_csv(tmp_path / "part.csv", lines)
    catalog = Catalog(tmp_path / "catalog")
    manifest = exports.ingest_exports(catalog, source=str(tmp_path))
    tables = [pq.read_table(catalog.file_path(manifest, e)) for e in manifest.files]
    assert tables[0].equals(tables[1])
    assert all("provenance" not in s for s in manifest.sources)


def _refused(tmp_path: Path, source: Path, message: str) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with pytest.raises(sdss.SourceError, match=message) as info:
        exports.ingest_exports(catalog, source=str(source))
    assert "\n" not in str(info.value)
    with pytest.raises(Exception):  # noqa: B017 - NotFound
        catalog.get("sdss")


def test_drifted_column_is_refused(tmp_path: Path) -> None:
    header = [n if n != "petroRad_r" else "petroRadR" for n in NAMES]
    path = write_csv(tmp_path / "x.csv", _lines(5), header)
    _refused(tmp_path, path, r"x\.csv: .*missing petroRad_r; unexpected petroRadR")


def test_fits_float_objid_is_refused(tmp_path: Path) -> None:
    lines = _lines(5)
    objid = np.array([float(line.split(",")[0]) for line in lines])
    path = write_fits(tmp_path / "f.fits", lines, objid=objid)
    _refused(tmp_path, path, r"f\.fits: column objid is float64, not an integer")


def test_hostile_column_name_is_refused(tmp_path: Path) -> None:
    header = [*NAMES[:-1], 'redshift"; drop table x--']
    path = write_csv(tmp_path / "h.csv", _lines(5), header)
    _refused(tmp_path, path, "is not a plain identifier")


def test_bad_csv_value_names_row(tmp_path: Path) -> None:
    lines = _lines(5)
    lines[3] = "1.23765E+18" + lines[3][lines[3].index(",") :]
    path = write_csv(tmp_path / "v.csv", lines)
    _refused(tmp_path, path, r"v\.csv: objid in row 4 is '1.23765E\+18', not a uint64")


def test_nothing_to_read(tmp_path: Path) -> None:
    _refused(tmp_path, tmp_path / "nothing*.csv", "no file matches")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path, tmp_path / "empty", "no CSV, FITS or VOTable files")
    (tmp_path / "corrupt.fits").write_bytes(b"SIMPLE  = nonsense")
    _refused(tmp_path, tmp_path / "corrupt.fits", "unreadable FITS")
