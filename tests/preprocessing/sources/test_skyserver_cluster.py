"""The SkyServer ingest on a real Dask LocalCluster: two ranges at once, a worker killed."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from data_catalog import Catalog
from preprocessing.cluster import dask_runner
from preprocessing.config import ClusterConfig
from preprocessing.driver import run_job, serial_runner
from preprocessing.sources import sdss
from tests.preprocessing.sources.skyserver_standin import StandIn, serve
from tests.preprocessing.sources.test_skyserver_job import content, shared_objids

pytestmark = pytest.mark.e2e


def test_on_a_local_cluster_as_in_one_process_with_a_worker_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rows = shared_objids(12_000)
    standin = StandIn(rows, cap=1_500, delay=0.02)
    with serve(standin) as server:
        job = sdss.plan_skyserver_ingest(
            skyserver_url=server.url, data_release=17, limit=None, concurrency=2, page_size=2_000
        )
        serial = run_job(
            Catalog(tmp_path / "serial"),
            replace(job, progress=lambda _m: None),
            runner=serial_runner,
            work_root=tmp_path / "serial-work",
        )
        asked_serially = list(standin.queries)
        standin.queries.clear()
        standin.max_in_flight = 0

        # The worker process that writes the job's 3rd page dies by SIGKILL right after; the
        # scheduler runs its range again on another worker, which keeps the pages written.
        monkeypatch.setenv("SHARDFLOW_CRASH_AT", "after-file:3")
        with caplog.at_level(logging.INFO, logger="distributed.nanny"):
            on_cluster = run_job(
                Catalog(tmp_path / "cluster"),
                job,
                runner=lambda: dask_runner(ClusterConfig(workers=2)),
                work_root=tmp_path / "cluster-work",
            )
    assert "was killed by signal 9" in caplog.text  # the nanny saw its worker die
    assert content(on_cluster) == content(serial)
    assert on_cluster.rows == 12_000 and on_cluster.statistics["count_reported"] == 12_000
    # Every query once, none again after the kill; never more than two in flight.
    assert sorted(standin.queries) == sorted(asked_serially)
    assert 1 <= standin.max_in_flight <= 2
