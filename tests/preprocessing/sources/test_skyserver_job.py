"""The SkyServer ingest as a driver job: planning, objid ranges, resume by page, the reply cap."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_catalog import Catalog, Manifest
from preprocessing.sources import sdss
from tests.preprocessing.sources.skyserver_standin import StandIn, serve, synthetic_rows

UINT64_MAX = 2**64 - 1
REPO = Path(__file__).parents[3]


@pytest.fixture(scope="module")
def rows_5k() -> list[tuple[int, int, str]]:
    return synthetic_rows(5_000)


def shared_objids(n: int) -> list[tuple[int, int, str]]:
    """Rows whose objids come in pairs (one object, two spectra), sorted by key."""
    base = synthetic_rows(n)
    rows = []
    for k, (_objid, specobjid, line) in enumerate(base):
        objid = base[k // 2 * 2][0]
        rows.append((objid, specobjid, str(objid) + line[line.index(",") :]))
    return sorted(rows, key=lambda r: (r[0], r[1]))


def content(manifest: Manifest) -> dict[str, Any]:
    """What a rerun must reproduce: everything but fetch times (and what derives from them)."""
    return {
        "sources": [{k: v for k, v in s.items() if k != "fetched_at"} for s in manifest.sources],
        "files": [(f.path, f.sha256, f.bytes, f.rows, f.row_groups) for f in manifest.files],
        "statistics": manifest.statistics,
        "parameters": manifest.parameters,
        "schema": manifest.schema,
        "rows": manifest.rows,
    }


def keys_in_file_order(catalog: Catalog, manifest: Manifest) -> list[tuple[int, int]]:
    keys: list[tuple[int, int]] = []
    for entry in manifest.files:
        table = pq.read_table(catalog.file_path(manifest, entry), columns=["objid", "specobjid"])
        keys += zip(
            table.column("objid").to_pylist(), table.column("specobjid").to_pylist(), strict=True
        )
    return keys


# --- planning --------------------------------------------------------------------------------


def test_plan_asks_nothing_and_names_the_same_job_alike() -> None:
    # Nothing listens on port 9: planning must not try.
    job = sdss.plan_skyserver_ingest(
        skyserver_url="http://127.0.0.1:9/", data_release=17, limit=None, concurrency=2
    )
    again = sdss.plan_skyserver_ingest(
        skyserver_url="http://127.0.0.1:9", data_release=17, limit=None, concurrency=2
    )
    assert job.passes == ("count", "pages") and job.version is None and job.kind == "raw"
    assert job.work_key == again.work_key
    others = [
        sdss.plan_skyserver_ingest(skyserver_url="http://127.0.0.1:9", concurrency=1),
        sdss.plan_skyserver_ingest(skyserver_url="http://127.0.0.1:9", concurrency=2, page_size=5),
        sdss.plan_skyserver_ingest(skyserver_url="http://127.0.0.1:9", concurrency=2, limit=10),
        sdss.plan_skyserver_ingest(
            skyserver_url="http://127.0.0.1:9", concurrency=2, bounds={"r": (0, 18)}
        ),
        sdss.plan_skyserver_ingest(
            skyserver_url="http://127.0.0.1:9", concurrency=2, data_release=16
        ),
    ]
    assert len({job.work_key, *(o.work_key for o in others)}) == 6


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"skyserver_url": "ftp://skyserver.sdss.org"}, "is not http"),
        ({"bounds": {"u; drop table x": (0, 1)}}, "cannot bound column"),
        ({"bounds": {"u": (2, 1)}}, "low 2.0 exceeds high 1.0"),
        ({"page_size": 0}, "page size 0 out of range"),
        ({"limit": 0}, "limit 0 must be a positive"),
        ({"concurrency": 0}, "concurrency 0 must be at least 1"),
    ],
)
def test_plan_refuses_bad_arguments_in_one_line(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(sdss.SourceError, match=message) as info:
        sdss.plan_skyserver_ingest(**arguments)
    assert "\n" not in str(info.value)


def _count_result(count: int, objids: list[int] | None) -> dict[str, Any]:
    return {"count": count, "objids": objids, "source": {}}


def test_pages_tasks_one_per_range_and_one_with_a_limit(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"
    done = {"count": [_count_result(1_000, [100, 1_099])]}
    three = sdss.plan_skyserver_ingest(skyserver_url=url, concurrency=3)
    assert [t.fn for t in three.tasks("count", {}, tmp_path)] == [sdss.count_task]
    assert three.tasks("count", {}, tmp_path)[0].args[1] is True  # asks min/max objid
    parts = [t.args[2] for t in three.tasks("pages", done, tmp_path)]
    assert [p.objids for p in parts] == [(None, 432), (433, 765), (766, None)]
    assert all(p.target is None and not p.probe for p in parts)

    # With a limit, the first `limit` rows in key order: one range, paged in order.
    limited = sdss.plan_skyserver_ingest(skyserver_url=url, concurrency=3, limit=250)
    assert limited.tasks("count", {}, tmp_path)[0].args[1] is False
    (only,) = limited.tasks("pages", {"count": [_count_result(1_000, None)]}, tmp_path)
    assert only.args[2] == sdss.PageRange(
        number=1, of=1, objids=(None, None), target=250, probe=False
    )
    serial = sdss.plan_skyserver_ingest(skyserver_url=url)
    (only,) = serial.tasks("pages", {"count": [_count_result(1_000, None)]}, tmp_path)
    assert only.args[2].target == 1_000 and only.args[2].probe


# --- objid ranges ----------------------------------------------------------------------------


def _holders(ranges: list[sdss.ObjidRange], objid: int) -> list[int]:
    return [
        i
        for i, (low, high) in enumerate(ranges)
        if (low is None or low <= objid) and (high is None or objid <= high)
    ]


def test_objid_ranges_hold_every_id_of_a_small_span_once() -> None:
    for low in range(0, 4):
        for high in range(low, low + 12):
            for parts in range(1, 9):
                ranges = sdss.objid_ranges(low, high, parts)
                assert 1 <= len(ranges) <= min(parts, high - low + 1)
                for objid in range(0, high + 4):
                    assert len(_holders(ranges, objid)) == 1, (low, high, parts, objid)
                # Every range holds at least one id of low..high: none is asked for in vain.
                assert all(_holders(ranges, x) for x in range(low, high + 1))
                assert {_holders(ranges, x)[0] for x in range(low, high + 1)} == set(
                    range(len(ranges))
                )


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    ends=st.lists(st.integers(0, UINT64_MAX), min_size=2, max_size=2),
    parts=st.integers(1, 8),
)
def test_objid_ranges_hold_every_uint64_once(
    data: st.DataObject, ends: list[int], parts: int
) -> None:
    low, high = sorted(ends)
    ranges = sdss.objid_ranges(low, high, parts)
    assert 1 <= len(ranges) <= parts
    assert ranges[0][0] is None and ranges[-1][1] is None
    for (_a, end), (start, _b) in itertools.pairwise(ranges):
        assert end is not None and start == end + 1  # contiguous, in order
        assert low < start <= high
    # The edges, either side of every cut, and anywhere.
    probes = {0, UINT64_MAX, low, high, *(s for s, _e in ranges[1:] if s is not None)}
    probes |= {p - 1 for p in probes if p > 0} | {p + 1 for p in probes if p < UINT64_MAX}
    probes |= set(data.draw(st.lists(st.integers(0, UINT64_MAX), max_size=20)))
    for objid in probes:
        assert len(_holders(ranges, objid)) == 1, (objid, ranges)
    # Even cuts: no range of low..high more than one id longer than another.
    if len(ranges) == parts:
        bounded = [(low if s is None else s, high if e is None else e) for s, e in ranges]
        sizes = [e - s + 1 for s, e in bounded]
        assert max(sizes) - min(sizes) <= 1


# --- running ---------------------------------------------------------------------------------


def test_concurrency_two_fetches_every_row_once(tmp_path: Path) -> None:
    rows = shared_objids(25_000)
    catalog = Catalog(tmp_path / "catalog")
    with serve(StandIn(rows, cap=2_000)) as server:
        manifest = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=3_000, concurrency=2
        )
    assert manifest.rows == 25_000
    assert manifest.statistics["count_reported"] == 25_000
    # Every row once, in key order across the files (range 1's pages, then range 2's).
    assert keys_in_file_order(catalog, manifest) == [(r[0], r[1]) for r in rows]
    assert "min(p.objid) as min_objid, max(p.objid) as max_objid" in server.queries[0]
    pages = server.page_queries
    assert sum("p.objid <=" in q and "p.objid >=" not in q for q in pages) >= 2
    assert sum("p.objid >=" in q and "p.objid <=" not in q for q in pages) >= 2
    assert all(("p.objid <=" in q) != ("p.objid >=" in q) for q in pages)
    # Each range ends with a reply that holds no row, kept as a source without a file.
    ends = [s for s in manifest.sources[1:] if "file" not in s]
    assert [s["rows"] for s in ends] == [0, 0]
    assert [s["file"] for s in manifest.sources if "file" in s] == [
        f"page-{n:05d}.parquet" for n in range(1, manifest.statistics["pages"] + 1)
    ]


@pytest.mark.parametrize(
    ("count_extra", "message"),
    [
        (7, "counted 4,007 rows but paging returned 4,000"),
        (-3, "counted 3,997 rows but holds more"),
    ],
)
def test_concurrency_two_checks_the_total(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]], count_extra: int, message: str
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with (
        serve(StandIn(rows_5k[:4_000], count_extra=count_extra)) as server,
        pytest.raises(sdss.SourceError, match=message),
    ):
        sdss.ingest_skyserver(
            catalog,
            skyserver_url=server.url,
            page_size=1_000,
            concurrency=2,
            work_root=tmp_path / "work",
        )
    assert catalog.names() == []
    # The refused count and pages are not kept for a rerun: it must ask again.
    assert not list((tmp_path / "work").glob("sdss-*/count.json"))


def test_concurrency_with_a_limit_pages_one_range(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]]
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with serve(StandIn(rows_5k)) as server:
        manifest = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=1_000, concurrency=3, limit=2_500
        )
    assert manifest.rows == 2_500
    assert keys_in_file_order(catalog, manifest) == [(r[0], r[1]) for r in rows_5k[:2_500]]
    assert "min(" not in server.queries[0]
    assert not any("p.objid >=" in q or "p.objid <=" in q for q in server.queries)


def test_a_failing_server_is_retried_then_the_rerun_resumes_by_page(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    monkeypatch.setattr("preprocessing.sources.sdss.time.sleep", waits.append)
    catalog = Catalog(tmp_path / "catalog")
    work = tmp_path / "work"
    messages: list[str] = []
    with serve(StandIn(rows_5k, fail_after_pages=4)) as server:
        with pytest.raises(sdss.SourceError, match="HTTP 503: Service Unavailable") as info:
            sdss.ingest_skyserver(
                catalog,
                skyserver_url=server.url,
                page_size=500,
                work_root=work,
                progress=messages.append,
            )
        assert "\n" not in str(info.value)
        # A line per retry, with its wait.
        retries = [m for m in messages if "retrying in" in m]
        assert retries == [
            f"{sdss.query_url(server.url, 17)}: HTTP 503: "
            f"Service Unavailable: the server is busy (attempt {a}/3); retrying in {w:.1f} s"
            for a, w in zip((1, 2), waits, strict=True)
        ]
        # 2 s then 4 s, each plus up to 1 s of jitter (preprocessing/sources/retry.py).
        assert [int(w) for w in waits] == [2, 4]
        asked_before = list(server.queries)
        assert len(asked_before) == 1 + 4 + 3  # count, 4 pages, page 5 three times

        server.fail_after_pages = None
        messages.clear()
        resumed = sdss.ingest_skyserver(
            catalog,
            skyserver_url=server.url,
            page_size=500,
            work_root=work,
            progress=messages.append,
        )
        asked_after = server.queries[len(asked_before) :]
        clean = sdss.ingest_skyserver(
            Catalog(tmp_path / "clean"), skyserver_url=server.url, page_size=500
        )
    assert clean.statistics["pages"] == 10
    # No count and none of the 4 pages again: pages 5..10, then the final probe.
    assert not any("count(*)" in q for q in asked_after)
    assert len(asked_after) == 6 + 1
    assert not set(asked_after) & set(asked_before[1:5])
    assert any("kept 4 pages (2,000 rows) from an interrupted run" in m for m in messages)
    assert content(resumed) == content(clean)
    assert not [p for p in work.glob("sdss-*") if p.is_dir()]  # the job's folder is gone


def test_a_refusal_in_one_range_stops_the_others_and_the_rerun_resumes(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]]
) -> None:
    catalog, work = Catalog(tmp_path / "catalog"), tmp_path / "work"
    standin = StandIn(rows_5k)
    answer = standin.answer

    def times_out_on_the_third_query(cmd: str) -> str:
        reply = answer(cmd)
        return "ERROR: Query timeout expired" if len(standin.queries) == 3 else reply

    standin.answer = times_out_on_the_third_query  # type: ignore[method-assign]
    with serve(standin) as server:
        with pytest.raises(sdss.SourceError, match="Query timeout expired") as info:
            sdss.ingest_skyserver(
                catalog,
                skyserver_url=server.url,
                page_size=1_000,
                concurrency=2,
                work_root=work,
            )
        assert "\n" not in str(info.value)
        # The count, range 1's first page, its second refused; range 2 then asked nothing.
        asked_before = list(standin.queries)
        assert len(asked_before) == 3
        assert not any("p.objid >=" in q for q in asked_before)

        standin.answer = answer  # type: ignore[method-assign]
        resumed = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=1_000, concurrency=2, work_root=work
        )
    asked_after = standin.queries[3:]
    assert not any("count(*)" in q for q in asked_after)
    assert asked_before[1] not in asked_after  # range 1's first page was kept
    assert asked_before[2] in asked_after  # its refused page is asked again
    assert resumed.rows == 5_000
    assert keys_in_file_order(catalog, resumed) == [(r[0], r[1]) for r in rows_5k]


_KILLED_RUN = """
import sys
from pathlib import Path
from data_catalog import Catalog
from preprocessing.sources import sdss
sdss.ingest_skyserver(
    Catalog(Path(sys.argv[1])), skyserver_url=sys.argv[2], page_size=500,
    work_root=Path(sys.argv[3]),
)
"""


def test_a_run_killed_mid_paging_resumes_after_its_last_whole_page(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]]
) -> None:
    catalog_dir, work = tmp_path / "catalog", tmp_path / "work"
    with serve(StandIn(rows_5k)) as server:
        # The process dies by SIGKILL right after writing (and recording) its 3rd page.
        killed = subprocess.run(
            [sys.executable, "-c", _KILLED_RUN, str(catalog_dir), server.url, str(work)],
            cwd=REPO,
            env={**os.environ, "SHARDFLOW_CRASH_AT": "after-file:3"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert len(server.queries) == 1 + 3
        (job_folder,) = [p for p in work.glob("sdss-skyserver-*") if p.is_dir()]
        pages = sorted(p.name for p in (job_folder / "range-01").glob("page-*.parquet"))
        assert pages == ["page-00001.parquet", "page-00002.parquet", "page-00003.parquet"]

        catalog = Catalog(catalog_dir)
        resumed = sdss.ingest_skyserver(
            catalog, skyserver_url=server.url, page_size=500, work_root=work
        )
    asked_after = server.queries[4:]
    assert len(asked_after) == 7 + 1  # pages 4..10 and the probe; no count, no page again
    assert not set(asked_after) & set(server.queries[:4])
    assert resumed.rows == 5_000
    assert keys_in_file_order(catalog, resumed) == [(r[0], r[1]) for r in rows_5k]
    assert catalog.verify() == []


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def test_an_endless_reply_is_refused_in_bounded_memory(
    tmp_path: Path, rows_5k: list[tuple[int, int, str]]
) -> None:
    """Read whole, the stand-in's 300 MB reply would take 300 MB and more (its text, its
    lines); capped, the reply is refused once past the bytes 1,000 rows can fill."""
    catalog = Catalog(tmp_path / "catalog")
    cap = sdss.reply_cap(1_000)
    assert cap == 4096 * 1_000 + 2**20
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    before = _status("VmRSS")
    standin = StandIn(rows_5k, mode="endless", endless_bytes=300_000_000)
    started = time.monotonic()
    with (
        serve(standin) as server,
        pytest.raises(
            sdss.SourceError, match=f"reply exceeds {cap:,} bytes for a page of 1,000 rows"
        ) as info,
    ):
        sdss.ingest_skyserver(catalog, skyserver_url=server.url, page_size=1_000)
    seconds = time.monotonic() - started
    grown = _status("VmHWM") - before
    print(f"refused after {seconds:.2f} s; peak RSS grew {grown / 2**20:.1f} MiB")
    assert "\n" not in str(info.value)
    assert len(standin.page_queries) == 1  # not retried: a bad reply, not a busy server
    # Refused early: the stand-in was cut off long before its 300 MB (the cap, plus what the
    # sockets buffer), and memory grew by about the cap, not by the reply.
    assert standin.endless_sent < 64 * 2**20
    assert grown < 64 * 2**20
