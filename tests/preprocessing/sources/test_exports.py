from __future__ import annotations

import functools
import hashlib
import math
import subprocess
import sys
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from astropy.table import Table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preprocessing.sources import exports
from preprocessing.sources.errors import SourceError
from preprocessing.sources.exports import convert_export
from preprocessing.sources.synth import write_sdss_exports
from tests.conftest import serving
from tests.preprocessing.sources.skyserver_standin import BIG_SPECOBJID, HEADER, synthetic_rows

NAMES = HEADER.split(",")
UINT64_MAX = 2**64 - 1


def _lines(n: int, seed: int = 0) -> list[str]:
    return [r[2] for r in synthetic_rows(n, seed)]


def write_csv(path: Path, lines: list[str], header: list[str] | None = None) -> Path:
    # CasJobs spells columns as declared (objID, specObjID): matching ignores case.
    names = header or [n.replace("objid", "objID") for n in NAMES]
    path.write_text(",".join(names) + "\n" + "".join(line + "\n" for line in lines))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """synth's exports: 250,001 rows as CSV; 20,000 rows as CSV and FITS (same seed, same rows)."""
    root = tmp_path_factory.mktemp("synthetic")
    (big,) = write_sdss_exports(root / "big", rows=250_001, files=1, fmt="csv", seed=3)
    (csv,) = write_sdss_exports(root / "csv", rows=20_000, files=1, fmt="csv", seed=5)
    (fits,) = write_sdss_exports(root / "fits", rows=20_000, files=1, fmt="fits", seed=5)
    return {"big": big, "csv": csv, "fits": fits}


def _refused(tmp_path: Path, source: Path | str, message: str) -> None:
    before = _files(tmp_path)
    with pytest.raises(SourceError, match=message) as info:
        convert_export(str(source), str(tmp_path / "out.parquet"))
    assert "\n" not in str(info.value)
    assert _files(tmp_path) == before  # neither out nor a partial file


# ---------------------------------------------------------------------------------------------
# Values


def test_uint64_ids_exact_past_2_63(tmp_path: Path) -> None:
    lines = _lines(6)
    ids = [2**63 - 1, 2**63, 2**63 + 1, UINT64_MAX - 1, UINT64_MAX, 0]
    lines = [f"{ids[i]}{line[line.index(',') :]}" for i, line in enumerate(lines)]
    path = write_csv(tmp_path / "ids.csv", lines)
    result = convert_export(str(path), str(tmp_path / "ids.parquet"))
    table = pq.read_table(tmp_path / "ids.parquet")
    assert result["rows"] == 6
    assert table.column("objid").to_pylist() == ids
    assert BIG_SPECOBJID in table.column("specobjid").to_pylist()
    assert str(table.schema.field("objid").type) == "uint64"
    assert not table.schema.field("objid").nullable


def test_float_mangled_id_names_file_column_row(tmp_path: Path) -> None:
    lines = _lines(5)
    lines[2] = "1.23765E+18" + lines[2][lines[2].index(",") :]
    path = write_csv(tmp_path / "mangled.csv", lines)
    _refused(
        tmp_path,
        path,
        r"mangled\.csv: objid in row 3 is '1\.23765E\+18', not a uint64; 64-bit ids lose digits",
    )


def test_id_past_uint64_and_empty_id_refused(tmp_path: Path) -> None:
    lines = _lines(4)
    over = lines.copy()
    over[1] = f"{2**64}{over[1][over[1].index(',') :]}"
    _refused(tmp_path, write_csv(tmp_path / "over.csv", over), r"objid in row 2 .*not a uint64")
    cells = lines[3].split(",")
    cells[NAMES.index("specobjid")] = ""
    empty = [*lines[:3], ",".join(cells)]
    _refused(tmp_path, write_csv(tmp_path / "e.csv", empty), r"e\.csv: specobjid in row 4 is empty")


def test_not_a_number_names_row(tmp_path: Path) -> None:
    lines = _lines(5)
    cells = lines[4].split(",")
    cells[NAMES.index("petroRad_r")] = "12,5".replace(",", "x")
    lines[4] = ",".join(cells)
    path = write_csv(tmp_path / "n.csv", lines)
    _refused(tmp_path, path, r"n\.csv: petroRad_r in row 5 is '12x5', not a number")


def test_empty_nan_inf_float_cells_kept(tmp_path: Path) -> None:
    lines = _lines(6)
    column = NAMES.index("petroMag_u")
    cells = ["", "nan", "NaN", "inf", "-inf", '""']
    for i, cell in enumerate(cells):
        parts = lines[i].split(",")
        parts[column] = cell
        lines[i] = ",".join(parts)
    path = write_csv(tmp_path / "f.csv", lines)
    convert_export(str(path), str(tmp_path / "f.parquet"))
    values = pq.read_table(tmp_path / "f.parquet").column("petroMag_u").to_pylist()
    assert [math.isnan(v) for v in values] == [True, True, True, False, False, True]
    assert values[3:5] == [math.inf, -math.inf]


def test_converting_imports_no_pandas(tmp_path: Path, synthetic: dict[str, Path]) -> None:
    # pyarrow imports pandas (0.17 CPU-s) to check a Python value it is handed (pa.scalar,
    # pc.equal(column, "text")); ingest converts with none: empty float cells and synth's
    # provenance column on the way.
    lines = _lines(3)
    parts = lines[0].split(",")
    parts[NAMES.index("petroMag_u")] = ""
    lines[0] = ",".join(parts)
    empty = write_csv(tmp_path / "f.csv", lines)
    script = (
        "import sys\n"
        "from preprocessing.sources.exports import convert_export\n"
        "for n, path in enumerate(sys.argv[1:]):\n"
        "    convert_export(path, f'{path}.{n}.parquet')\n"
        "print('pandas' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(empty), str(synthetic["csv"])],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"


def test_sentinels_and_text_kept(tmp_path: Path) -> None:
    lines = _lines(3)
    parts = lines[0].split(",")
    parts[NAMES.index("petroRad_u")] = "-9999"
    parts[NAMES.index("class")] = " QSO "
    lines[0] = ",".join(parts)
    path = write_csv(tmp_path / "s.csv", lines)
    result = convert_export(str(path), str(tmp_path / "s.parquet"))
    table = pq.read_table(tmp_path / "s.parquet")
    assert table.column("petroRad_u")[0].as_py() == -9999.0
    assert table.column("class").to_pylist()[0] == "QSO"
    assert result["synthetic_rows"] == 0
    assert "provenance" not in table.column_names


# ---------------------------------------------------------------------------------------------
# Shape of the file


def test_schema_drift_names_missing_and_unexpected(tmp_path: Path) -> None:
    header = [n if n != "petroRad_r" else "petroRadR" for n in NAMES] + ["extra"]
    path = write_csv(tmp_path / "x.csv", [line + ",1" for line in _lines(5)], header)
    _refused(
        tmp_path,
        path,
        r"x\.csv: columns differ from the expected schema: missing petroRad_r; "
        r"unexpected petroRadR, extra",
    )


def test_table1_line_and_bom_accepted(tmp_path: Path) -> None:
    lines = _lines(50)
    plain = write_csv(tmp_path / "plain.csv", lines)
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf#Table1\r\n" + plain.read_bytes())
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    digests = {
        convert_export(str(p), str(p.with_suffix(".parquet")))["output"]["sha256"]
        for p in (plain, marked, bom)
    }
    assert len(digests) == 1
    objids = pq.read_table(tmp_path / "marked.parquet").column("objid").to_pylist()
    assert objids == [int(line.split(",")[0]) for line in lines]


def test_wrong_field_count_names_row(tmp_path: Path) -> None:
    lines = _lines(6)
    lines[4] = lines[4].rsplit(",", 1)[0]
    path = write_csv(tmp_path / "w.csv", lines)
    _refused(tmp_path, path, r"w\.csv: row 5 has 20 fields, header has 21")


def test_no_rows_no_file(tmp_path: Path) -> None:
    _refused(tmp_path, write_csv(tmp_path / "h.csv", []), r"h\.csv: no rows")
    (tmp_path / "z.csv").write_bytes(b"")
    _refused(tmp_path, tmp_path / "z.csv", r"z\.csv: empty file")
    _refused(tmp_path, tmp_path / "absent.csv", r"absent\.csv: no such file")
    (tmp_path / "corrupt.fits").write_bytes(b"SIMPLE  = nonsense")
    _refused(tmp_path, tmp_path / "corrupt.fits", r"corrupt\.fits: unreadable FITS")
    _refused(tmp_path, tmp_path / "notes.txt", r"notes\.txt: not a CSV, FITS or VOTable")


# ---------------------------------------------------------------------------------------------
# Output: row groups, digests, determinism, failures


def test_row_groups_and_digests(tmp_path: Path, synthetic: dict[str, Path]) -> None:
    out = tmp_path / "big.parquet"
    result = convert_export(str(synthetic["big"]), str(out))
    metadata = pq.ParquetFile(out).metadata
    groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert groups == [100_000, 100_000, 50_001]
    assert result == {
        "rows": 250_001,
        "input": {
            "sha256": _sha256(synthetic["big"]),
            "bytes": synthetic["big"].stat().st_size,
            "format": "csv",
        },
        "output": {
            "bytes": out.stat().st_size,
            "sha256": _sha256(out),
            "rows": 250_001,
            "row_groups": 3,
        },
        "synthetic_rows": 250_001,
    }
    assert _files(tmp_path) == ["big.parquet"]


def test_same_input_same_bytes_however_read(
    tmp_path: Path, synthetic: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = convert_export(str(synthetic["csv"]), str(tmp_path / "1.parquet"))
    again = convert_export(str(synthetic["csv"]), str(tmp_path / "2.parquet"))
    # 16 KiB reads: pyarrow hands out batches of ~40 rows instead of ~2,600.
    monkeypatch.setattr(exports, "_READ_BLOCK", 1 << 14)
    small = convert_export(str(synthetic["csv"]), str(tmp_path / "3.parquet"))
    assert first == again == small
    assert (tmp_path / "1.parquet").read_bytes() == (tmp_path / "3.parquet").read_bytes()


def test_failure_after_row_groups_leaves_nothing(
    tmp_path: Path, synthetic: dict[str, Path]
) -> None:
    path = tmp_path / "late.csv"
    with open(path, "wb") as f:
        f.write(synthetic["big"].read_bytes())
        f.write(b"1.23765E+18" + b",1" * (len(NAMES) - 1) + b",synthetic\n")
    _refused(tmp_path, path, r"late\.csv: objid in row 250002 is '1\.23765E\+18'")


def test_fits_twin_gives_the_same_bytes(tmp_path: Path, synthetic: dict[str, Path]) -> None:
    from_csv = convert_export(str(synthetic["csv"]), str(tmp_path / "csv.parquet"))
    from_fits = convert_export(str(synthetic["fits"]), str(tmp_path / "fits.parquet"))
    assert from_fits["input"] == {
        "sha256": _sha256(synthetic["fits"]),
        "bytes": synthetic["fits"].stat().st_size,
        "format": "fits",
    }
    assert from_fits["output"] == from_csv["output"]
    assert from_fits["synthetic_rows"] == 20_000
    table = pq.read_table(tmp_path / "fits.parquet")
    assert table.column("specobjid").to_numpy().max() > 2**63


def test_votable_same_rows_as_csv(tmp_path: Path) -> None:
    lines = _lines(300)
    csv = write_csv(tmp_path / "v.csv", lines)
    cells = [line.split(",") for line in lines]
    columns: dict[str, Any] = {name: [c[i] for c in cells] for i, name in enumerate(NAMES)}
    table = Table(
        {
            name: (
                # VOTable has no unsigned long: ids as long where they fit, as text otherwise.
                np.array(values, dtype=np.int64)
                if name == "objid"
                else np.array(values)
                if name in ("specobjid", "class")
                else np.array(values, dtype=np.float64)
            )
            for name, values in columns.items()
        }
    )
    table.write(tmp_path / "v.vot", format="votable")
    from_csv = convert_export(str(csv), str(tmp_path / "csv.parquet"))
    from_vot = convert_export(str(tmp_path / "v.vot"), str(tmp_path / "vot.parquet"))
    assert from_vot["input"] == {
        "sha256": _sha256(tmp_path / "v.vot"),
        "bytes": (tmp_path / "v.vot").stat().st_size,
        "format": "votable",
    }
    assert from_vot["output"] == from_csv["output"]


# ---------------------------------------------------------------------------------------------
# Remote inputs


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over HTTP on 127.0.0.1 by a thread; (directory, base URL)."""
    root = tmp_path / "served"
    root.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    with serving(server) as url:
        yield root, url


def test_http_url_gives_the_same_digests(
    tmp_path: Path, synthetic: dict[str, Path], http_root: tuple[Path, str]
) -> None:
    root, base = http_root
    for name in ("csv", "fits"):
        served = root / synthetic[name].name
        served.write_bytes(synthetic[name].read_bytes())
        local = convert_export(str(served), str(tmp_path / f"local-{name}.parquet"))
        remote = convert_export(f"{base}/{served.name}", str(tmp_path / f"http-{name}.parquet"))
        assert remote == local
    assert _files(tmp_path) == [
        "http-csv.parquet",
        "http-fits.parquet",
        "local-csv.parquet",
        "local-fits.parquet",
        "served",
    ]
    _refused(tmp_path, f"{base}/absent.csv", r"/absent\.csv: no such file")


# ---------------------------------------------------------------------------------------------
# Anything at all


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.text(
        alphabet=st.sampled_from(list('#Table1\n,"\r objidRA09.-E+x\x00\ufeff')), max_size=400
    ),
    header=st.booleans(),
)
def test_csv_fuzz_raises_only_source_error(tmp_path: Path, body: str, header: bool) -> None:
    path = tmp_path / "fuzz.csv"
    path.write_text((",".join(NAMES) + "\n" if header else "") + body)
    out = tmp_path / "fuzz.parquet"
    out.unlink(missing_ok=True)
    try:
        result = convert_export(str(path), str(out))
    except SourceError:
        assert not out.exists()
    else:
        assert result["output"]["rows"] == pq.ParquetFile(out).metadata.num_rows
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def _split_fits(source: Path, out: Path, *, extra: Table | None = None) -> Path:
    """``source``'s rows over two BINTABLE HDUs of one schema (and ``extra`` as a third)."""
    from astropy.io import fits

    with fits.open(source) as hdul:
        table = Table.read(hdul[1])
    half = len(table) // 2
    hdus = [fits.PrimaryHDU()]
    hdus += [fits.table_to_hdu(table[:half]), fits.table_to_hdu(table[half:])]
    if extra is not None:
        hdus.append(fits.table_to_hdu(extra))
    fits.HDUList(hdus).writeto(out)
    return out


def test_every_bintable_of_a_fits_export_is_read(
    tmp_path: Path, synthetic: dict[str, Path]
) -> None:
    """Issue #29 item 2: 20,000 rows over two BINTABLE HDUs give the one-table file's bytes."""
    split = _split_fits(synthetic["fits"], tmp_path / "split.fits")
    whole = convert_export(str(synthetic["fits"]), str(tmp_path / "whole.parquet"))
    halves = convert_export(str(split), str(tmp_path / "halves.parquet"))
    assert halves["rows"] == 20_000
    assert halves["output"] == whole["output"]


def test_a_bintable_of_other_columns_is_refused_by_name(
    tmp_path: Path, synthetic: dict[str, Path]
) -> None:
    other = Table({"ra": [1.0, 2.0], "dec": [3.0, 4.0]})
    other.meta["EXTNAME"] = "NOTES"
    split = _split_fits(synthetic["fits"], tmp_path / "mixed.fits", extra=other)
    _refused(tmp_path, split, r"mixed\.fits: HDU 3 \(NOTES\) has other columns than HDU 1")
