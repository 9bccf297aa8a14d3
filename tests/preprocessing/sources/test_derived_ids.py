"""Exports without usable ids (the DR14 sample's shape): ids rebuilt, marked, refused when a part
does not fit, never mixed with exports carrying SDSS's own ids."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog
from preprocessing.sources import derived_ids
from preprocessing.sources.errors import SourceError
from preprocessing.sources.exports import convert_export, ingest_exports
from preprocessing.sources.synth import write_sdss_exports

HEADER = "ra,dec,u,g,r,i,z,run,rerun,camcol,field,specobjid,class,redshift,plate,mjd,fiberid"
# Two real rows of the DR14 sample (shared/data/sdss-dr14-10k.csv), as the spreadsheet left them.
ROWS = (
    "183.5313257,0.08969303,19.47406,17.0424,15.94699,15.50342,15.22531,752,301,4,267,"
    "3.72E+18,STAR,-8.96E-06,3306,54922,491",
    "183.5983705,0.135285032,18.6628,17.21449,16.67637,16.48922,16.3915,752,301,4,267,"
    "3.64E+17,STAR,-5.49E-05,323,51615,541",
)


def _sample(path: Path, rows: tuple[str, ...] = ROWS) -> Path:
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def test_the_sample_columns_are_recognised_in_any_case_and_order() -> None:
    names = HEADER.split(",")
    assert derived_ids.variant_of(names) is not None
    assert derived_ids.variant_of([n.upper() for n in reversed(names)]) is not None
    assert derived_ids.variant_of(["objid", *names]) is None  # an export with its own ids
    assert derived_ids.variant_of(names[:-1]) is None


def test_ids_are_rebuilt_from_their_parts_and_marked_derived(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    result = convert_export(str(_sample(tmp_path / "sample.csv")), str(out))
    assert result["rows"] == 2
    assert set(result["derived"]) == {"objid", "specobjid"}
    table = pq.read_table(out)
    assert derived_ids.derived_of(table.schema) == result["derived"]
    specobjid = table["specobjid"].to_pylist()
    assert specobjid == [
        3306 << 50 | 491 << 38 | (54922 - 50000) << 24,
        323 << 50 | 541 << 38 | (51615 - 50000) << 24,
    ]
    # Within a float's rounding of what the spreadsheet kept.
    assert abs(specobjid[0] - 3.72e18) / 3.72e18 < 0.005
    assert table["specobjid_exported"].to_pylist() == ["3.72E+18", "3.64E+17"]
    objid = table["objid"].to_pylist()[0]
    assert objid >> 59 == 2 and objid >> 48 & 0x7FF == 301 and objid >> 32 & 0xFFFF == 752
    assert objid >> 29 & 0x7 == 4 and objid >> 16 & 0xFFF == 267
    assert not any(name.startswith("petro") for name in table.column_names)


def test_a_part_too_large_for_its_field_is_refused_naming_the_row(tmp_path: Path) -> None:
    bad = ROWS[1].rsplit(",", 1)[0] + ",4096"  # fiberid has 12 bits
    with pytest.raises(SourceError, match=r"fiberid in row 2 is 4096"):
        convert_export(str(_sample(tmp_path / "sample.csv", (ROWS[0], bad))), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_derived_and_own_ids_are_not_mixed_in_one_version(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    write_sdss_exports(exports, rows=50, files=1, fmt="csv", seed=1)
    _sample(exports / "sample.csv")
    catalog = Catalog(tmp_path / "catalog")
    with pytest.raises(SourceError, match="cannot share one raw version"):
        ingest_exports(catalog, source=str(exports))
    assert list(catalog.versions("sdss")) == []
