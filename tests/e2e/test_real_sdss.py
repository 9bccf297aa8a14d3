"""The real SDSS DR14 sample (shared/data/sdss-dr14-10k.csv, through a spreadsheet: no objid, a
float-mangled specobjid, no Petrosian columns) ingested and preprocessed as a user runs it."""

from __future__ import annotations

import csv
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e

SAMPLE = Path(__file__).resolve().parents[2] / ".." / ".." / "shared" / "data" / "sdss-dr14-10k.csv"
PHOTOMETRY = ["u", "g", "r", "i", "z", "u_g", "g_r", "r_i", "i_z"]


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    found = [p for p in (SAMPLE, Path("/work/shared/data/sdss-dr14-10k.csv")) if p.exists()]
    if not found:
        pytest.skip("the real DR14 sample (shared/data/sdss-dr14-10k.csv) is not on this machine")
    copy = tmp_path / "exports" / "sdss-dr14-10k.csv"
    copy.parent.mkdir()
    shutil.copy(found[0], copy)
    return copy


def test_real_dr14_sample_ingests_with_derived_ids_and_preprocesses_without_petrosian(
    shardflow: Callable[..., Result], sample: Path, shardflow_home: Path
) -> None:
    ingested = ok(shardflow("ingest", "sdss", "--source", str(sample), "--json")).json
    assert ingested["rows"] == 10_000
    raw = ok(shardflow("catalog", "show", f"sdss@{ingested['version']}", "--json")).json
    (source,) = raw["sources"]
    # The ids are rebuilt, and the manifest says so (and how).
    assert set(source["derived"]) == {"objid", "specobjid"}
    assert "not SDSS's objID" in source["derived"]["objid"]
    assert "plate << 50" in source["derived"]["specobjid"]
    assert not any(c.startswith("petro") for c in raw["schema"]["columns"])

    # The first row's spectrum: plate 3306, mjd 54922, fiberid 491, exported as "3.72E+18".
    with sample.open() as f:
        first = next(csv.DictReader(f))
    directory = Path(raw["directory"])
    table = pq.read_table(sorted(directory.glob("*.parquet"))[0])
    row = table.slice(0, 1).to_pylist()[0]
    assert row["specobjid"] == 3306 << 50 | 491 << 38 | (54922 - 50000) << 24
    assert row["specobjid_exported"] == first["specobjid"] == "3.72E+18"
    assert row["objid"] >> 32 & 0xFFFF == int(first["run"])
    # (plate, mjd, fiberid) is unique in the sample, so the derived keys are too.
    keys = set(zip(table["objid"].to_pylist(), table["specobjid"].to_pylist(), strict=True))
    assert len(keys) == 10_000

    processed = ok(shardflow("preprocess", "sdss", "--json")).json
    assert processed["rows_in"] == 10_000
    assert processed["rows"] + processed["quarantine"]["rows"] == 10_000
    assert processed["quarantine"]["rows"] == 0  # real magnitudes, no sentinels in this sample
    assert sum(s["rows"] for s in processed["splits"].values()) == 10_000
    shown = ok(shardflow("catalog", "show", f"sdss-processed@{processed['version']}", "--json"))
    assert shown.json["schema"]["feature_columns"] == PHOTOMETRY
    assert len(processed["normalization"]["mean"]) == len(PHOTOMETRY)

    with_redshift = ok(shardflow("preprocess", "sdss", "--with-redshift", "--json")).json
    assert with_redshift["version"] != processed["version"]
    assert with_redshift["splits"] == processed["splits"]  # the same rows, split the same way
    shown = ok(shardflow("catalog", "show", f"sdss-processed@{with_redshift['version']}", "--json"))
    assert shown.json["schema"]["feature_columns"] == [*PHOTOMETRY, "redshift"]


def test_an_id_part_out_of_its_field_is_refused_in_one_line(
    shardflow: Callable[..., Result], sample: Path
) -> None:
    lines = sample.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[5].split(",")
    cells[header.index("fiberid")] = "5000"  # fiberid has 12 bits of the specobjid
    lines[5] = ",".join(cells)
    sample.write_text("\n".join(lines) + "\n")
    refused = shardflow("ingest", "sdss", "--source", str(sample))
    assert refused.returncode != 0
    message = refused.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("shardflow: ")
    assert "fiberid in row 5 is 5000" in message[0]
    assert "Traceback" not in refused.stderr
    listed = shardflow("catalog", "list", "--json")
    assert "sdss" not in listed.stdout
