from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from astropy.io import fits

from data_catalog import Catalog
from preprocessing.sources import exports, sdss, synth


def _ingested(tmp_path: Path, fmt: str, rows: int, files: int) -> pa.Table:
    paths = synth.write_sdss_exports(tmp_path / fmt, rows=rows, files=files, fmt=fmt, seed=3)  # type: ignore[arg-type]
    assert len(paths) == files
    catalog = Catalog(tmp_path / f"catalog-{fmt}")
    manifest = exports.ingest_exports(catalog, source=str(tmp_path / fmt))
    assert manifest.rows == rows
    assert manifest.statistics["synthetic_rows"] == rows
    assert [s["provenance"] for s in manifest.sources] == ["synthetic"] * files
    return pa.concat_tables(pq.read_table(catalog.file_path(manifest, e)) for e in manifest.files)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    return _ingested(tmp_path_factory.mktemp("synth"), "fits", 60_000, 2)


def test_csv_and_fits_hold_the_same_rows(tmp_path: Path) -> None:
    csv_rows = _ingested(tmp_path, "csv", 3_001, 3)
    fits_rows = _ingested(tmp_path, "fits", 3_001, 3)
    assert csv_rows.equals(fits_rows)


def test_marked_synthetic(tmp_path: Path) -> None:
    (path,) = synth.write_sdss_exports(tmp_path, rows=10, files=1, fmt="fits")
    with fits.open(path) as hdus:
        assert hdus[1].header["SYNTHETC"] is True
        assert hdus[1].header["NAXIS2"] == 10


def test_ids_exact_and_unique(big: pa.Table) -> None:
    objid = big.column("objid").to_numpy()
    spec = big.column("specobjid").to_numpy()
    assert objid.dtype == np.uint64 and spec.dtype == np.uint64
    assert np.all(np.diff(objid.astype(object)) > 0)  # sorted, unique across files
    assert len(np.unique(spec)) == len(spec)
    assert int(spec.max()) > 2**63


def test_calibrated_per_class(big: pa.Table) -> None:
    classes = np.array(big.column("class").to_pylist())
    for cls, model in synth.CALIBRATION.items():
        mask = classes == cls
        assert abs(mask.mean() - model.share) < 0.01, cls
        r = big.column("r").to_numpy()[mask]
        p5, p50, p95 = np.percentile(r, [5, 50, 95])
        assert abs(p50 - model.r[1]) < 0.1, cls
        assert abs(p5 - model.r[0]) < 0.2 and abs(p95 - model.r[2]) < 0.2, cls
        g = big.column("g").to_numpy()[mask]
        u = big.column("u").to_numpy()[mask]
        for colour, (mean, sd) in zip((u - g, g - r), model.colours[:2], strict=True):
            assert abs(colour.mean() - mean) < 0.03, cls
            assert abs(colour.std() - sd) < 0.05, cls
        if model.ug_gr_correlation:
            assert abs(np.corrcoef(u - g, g - r)[0, 1] - model.ug_gr_correlation) < 0.1, cls
        z = big.column("redshift").to_numpy()[mask]
        assert abs(np.median(z) - model.redshift[1]) < 0.05 * max(1, model.redshift[1]), cls
        rad = big.column("petroRad_r").to_numpy()[mask]
        assert abs(np.median(rad) - model.petro_rad_r[0]) < 0.3, cls
    u = big.column("u").to_numpy()
    assert u.max() < 19.6 and big.column("g").to_numpy().max() < 20.0


def test_sentinels_present(big: pa.Table) -> None:
    assert 0 < int(np.sum(big.column("petroMag_u").to_numpy() == -9999.0)) < 1_000


def test_deterministic(tmp_path: Path) -> None:
    a = synth.write_sdss_exports(tmp_path / "a", rows=500, files=2, fmt="csv", seed=9)
    b = synth.write_sdss_exports(tmp_path / "b", rows=500, files=2, fmt="csv", seed=9)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(sdss.SourceError):
        synth.write_sdss_exports(tmp_path, rows=2, files=3, fmt="csv")
    with pytest.raises(sdss.SourceError):
        synth.write_sdss_exports(tmp_path, rows=2, files=1, fmt="xlsx")  # type: ignore[arg-type]
