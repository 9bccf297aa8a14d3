from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from data_catalog import Catalog, Manifest
from preprocessing.sources import sdss
from tests.preprocessing.sources.skyserver_standin import (
    BIG_SPECOBJID,
    PATH,
    StandIn,
    serve,
    synthetic_rows,
)

ASTROQUERY_DATA = Path(sdss.__file__).parents[2] / ".venv/lib/python3.11/site-packages"
ASTROQUERY_DATA = ASTROQUERY_DATA / "astroquery/sdss/tests/data"


@pytest.fixture(scope="module")
def rows_25k() -> list[tuple[int, int, str]]:
    return synthetic_rows(25_000)


def _read_all(catalog: Catalog, manifest: Manifest) -> dict[str, NDArray[Any]]:
    tables = [pq.read_table(catalog.file_path(manifest, e)) for e in manifest.files]
    return {
        name: np.concatenate([t.column(name).to_numpy() for t in tables])
        for name in ("objid", "specobjid")
    }


def test_pages_past_the_server_cap(tmp_path: Path, rows_25k: list[tuple[int, int, str]]) -> None:
    catalog = Catalog(tmp_path / "catalog")
    messages: list[str] = []
    with serve(StandIn(rows_25k, cap=10_000)) as server:
        manifest = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=10_000, progress=messages.append
        )
    assert manifest.rows == 25_000
    assert manifest.statistics["rows"] == 25_000
    assert manifest.statistics["count_reported"] == 25_000
    assert manifest.statistics["pages"] == 3
    columns = _read_all(catalog, manifest)
    assert columns["objid"].dtype == np.uint64
    assert columns["specobjid"].dtype == np.uint64
    assert sorted(columns["objid"].tolist()) == [r[0] for r in rows_25k]
    assert len(set(columns["objid"].tolist())) == 25_000
    assert int(columns["specobjid"].max()) == BIG_SPECOBJID
    # The first query counts, with the same WHERE as the pages.
    assert server.queries[0].strip().startswith("select count(*)")
    assert "p.g between 0.0 and 20.0 and p.u between 0.0 and 19.6" in server.queries[0]
    page = pq.read_table(catalog.file_path(manifest, manifest.files[0]))
    assert page.column("class").type == pa.string()
    assert -9999.0 in page.column("petroRad_u").to_pylist()
    sources = manifest.sources
    assert sources[0]["query"] == server.queries[0].strip()
    assert all(s["uri"].endswith(PATH) for s in sources)
    assert all(len(s["sha256"]) == 64 and s["data_release"] == 17 for s in sources)


def test_short_replies_keep_paging(tmp_path: Path, rows_25k: list[tuple[int, int, str]]) -> None:
    """A cap below the page size asked for: short pages, same total."""
    catalog = Catalog(tmp_path / "catalog")
    messages: list[str] = []
    with serve(StandIn(rows_25k[:5_000], cap=1_500)) as server:
        manifest = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=2_000, progress=messages.append
        )
    assert manifest.rows == 5_000
    assert any("capped" in m for m in messages)
    assert sorted(_read_all(catalog, manifest)["objid"].tolist()) == [
        r[0] for r in rows_25k[:5_000]
    ]


def test_objects_with_several_spectra_span_page_boundaries(tmp_path: Path) -> None:
    """One photometric object may be the best match of several spectra: the keyset is
    (objid, specobjid), so a group split by a page boundary loses no row."""
    base = synthetic_rows(1_000)
    rows = []
    for k, (_objid, specobjid, line) in enumerate(base):
        objid = base[k // 2 * 2][0]  # pairs share their objid
        rows.append((objid, specobjid, str(objid) + line[line.index(",") :]))
    rows.sort(key=lambda r: (r[0], r[1]))
    catalog = Catalog(tmp_path / "catalog")
    with serve(StandIn(rows, cap=333)) as server:
        manifest = sdss.ingest_skyserver(catalog, skyserver_url=server.url, page_size=333)
    assert manifest.rows == 1_000
    tables = [pq.read_table(catalog.file_path(manifest, e)) for e in manifest.files]
    keys: list[tuple[int, int]] = []
    for t in tables:
        keys += zip(t.column("objid").to_pylist(), t.column("specobjid").to_pylist(), strict=True)
    assert keys == [(r[0], r[1]) for r in rows]


def test_limit(tmp_path: Path, rows_25k: list[tuple[int, int, str]]) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with serve(StandIn(rows_25k[:3_000])) as server:
        manifest = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=1_000, limit=2_500
        )
    assert manifest.rows == 2_500
    assert manifest.statistics["count_reported"] == 3_000


def _no_versions(catalog: Catalog) -> None:
    with pytest.raises(Exception):  # noqa: B017 - NotFound
        catalog.get("sdss")


def test_fewer_rows_than_counted_is_refused(
    tmp_path: Path, rows_25k: list[tuple[int, int, str]]
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with (
        serve(StandIn(rows_25k[:4_000], count_extra=7)) as server,
        pytest.raises(sdss.SourceError, match="counted 4,007 rows but paging returned 4,000"),
    ):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url, page_size=1_000)
    _no_versions(catalog)


def test_more_rows_than_counted_is_refused(
    tmp_path: Path, rows_25k: list[tuple[int, int, str]]
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with (
        serve(StandIn(rows_25k[:2_000], count_extra=-3)) as server,
        pytest.raises(sdss.SourceError, match="holds more"),
    ):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url, page_size=1_000)
    _no_versions(catalog)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("empty", "empty reply"),
        ("error", "not a '#Table1' CSV table: SQL returned the following error"),
        ("http500", "HTTP 500"),
    ],
)
def test_bad_replies_are_refused(
    tmp_path: Path, mode: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("preprocessing.sources.sdss.time.sleep", lambda _s: None)
    catalog = Catalog(tmp_path / "catalog")
    with (
        serve(StandIn(synthetic_rows(10), mode=mode)) as server,
        pytest.raises(sdss.SourceError, match=message) as info,
    ):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url)
    assert "\n" not in str(info.value)
    _no_versions(catalog)


def test_zero_rows_is_refused(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with serve(StandIn([])) as server, pytest.raises(sdss.SourceError, match="counts no rows"):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url)
    _no_versions(catalog)


def test_error_midway_leaves_no_version(
    tmp_path: Path, rows_25k: list[tuple[int, int, str]]
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    standin = StandIn(rows_25k[:3_000])
    original = standin.answer

    def flaky(cmd: str) -> str:
        reply = original(cmd)
        return "ERROR: Query timeout expired" if len(standin.queries) == 3 else reply

    standin.answer = flaky  # type: ignore[method-assign]
    with (
        serve(standin) as server,
        pytest.raises(sdss.SourceError, match="Query timeout expired"),
    ):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url, page_size=1_000)
    _no_versions(catalog)
    assert not list((tmp_path / "catalog").rglob("*.parquet"))


def test_query_url_matches_astroquery() -> None:
    assert sdss.query_url("https://skyserver.sdss.org", 17) == (
        "https://skyserver.sdss.org/dr17/en/tools/search/x_results.aspx"
    )
    assert sdss.query_url("http://h:1/", 9).endswith("/dr9/en/tools/search/x_sql.asp")
    with pytest.raises(sdss.SourceError):
        sdss.query_url("file:///etc", 17)


def test_sql_is_built_from_the_allowlist() -> None:
    sql = sdss.build_page_sql(10, (5, 2**64 - 1), {"r": (1, 2.5)})
    assert sql.startswith("select top 10 p.objid, p.ra")
    assert "s.z as redshift" in sql
    assert "p.r between 1.0 and 2.5" in sql
    assert f"s.specobjid > {2**64 - 1}" in sql
    assert sql.endswith("order by p.objid, s.specobjid")
    with pytest.raises(sdss.SourceError, match="cannot bound column"):
        sdss.build_count_sql({"u; drop table x": (0, 1)})
    with pytest.raises(sdss.SourceError, match="not a finite number"):
        sdss.build_count_sql({"u": (0, float("nan"))})
    with pytest.raises(sdss.SourceError):
        sdss.build_page_sql(10, (-1, 0))


@pytest.mark.parametrize("name", ["xid_im.txt", "xid_sp.txt"])
def test_astroquery_recorded_replies(name: str) -> None:
    text = (ASTROQUERY_DATA / name).read_text()
    reply = sdss.parse_reply(text, where=name)
    assert reply.columns[:3] == ("ra", "dec", "objid")
    columns = sdss.typed_columns(
        reply, {"objID": sdss.UINT64, "RA": sdss.FLOAT64, "dec": sdss.FLOAT64}, where=name
    )
    first = text.splitlines()[2].split(",")
    assert int(columns["objID"][0]) == int(first[2])
    assert columns["RA"][0] == float(first[0])
    if name == "xid_sp.txt":
        spec = sdss.typed_columns(reply, {"specobjid": sdss.UINT64}, where=name)
        assert int(spec["specobjid"][0]) == 845594848269461504
    else:
        assert len(reply.rows) == 18


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty reply"),
        ("   \n\n", "empty reply"),
        ("ERROR: Invalid object name 'PhotoObjx'.", "Invalid object name"),
        ("#Table1\n", "no header"),
        ("#Table1\na,b\n1\n", "row 1 has 1 fields"),
        ("#Table1\na,A\n1,2\n", "appears twice"),
        ("#Table1\na b,c\n1,2\n", "not a plain identifier"),
        ("#Table1\na\n1\n#Table2\n", "more than one table"),
        ("#Table1\nError: Query timed out\n", "SkyServer reported an error: .*timed out"),
        ("<html><div class='error_message'>bad</div></html>", "reported an error: bad"),
    ],
)
def test_reply_parser_refusals(text: str, message: str) -> None:
    with pytest.raises(sdss.SourceError, match=message):
        sdss.parse_reply(text, where="reply")


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("1.23765E+18", sdss.UINT64),
        ("-1", sdss.UINT64),
        (str(2**64), sdss.UINT64),
        ("abc", sdss.FLOAT64),
        ("nan", sdss.FLOAT64),
    ],
)
def test_typed_refusals(value: str, kind: str) -> None:
    reply = sdss.parse_reply(f"#Table1\nx\n{value}\n", where="reply")
    with pytest.raises(sdss.SourceError, match="x in row 1"):
        sdss.typed_columns(reply, {"x": kind}, where="reply")


_csvish = st.text(
    alphabet=st.sampled_from(list('#Table1\n,"\r ab09.-E+x\x00<>\ufeff')), max_size=300
)


@settings(max_examples=400, deadline=None)
@given(body=st.one_of(_csvish, _csvish.map(lambda s: "#Table1\n" + s), st.text(max_size=200)))
def test_parser_fuzz_raises_only_source_error(body: str) -> None:
    try:
        reply = sdss.parse_reply(body, where="fuzz")
    except sdss.SourceError as exc:
        assert "\n" not in str(exc).replace("\\n", "")
        return
    for kind in (sdss.UINT64, sdss.FLOAT64, sdss.STRING):
        schema = {reply.columns[0]: kind} if reply.columns else {"objid": kind}
        with contextlib.suppress(sdss.SourceError):
            sdss.typed_columns(reply, schema, where="fuzz")
