"""A real flow run recorded by a Prefect server on PostgreSQL, configured as deploy/compose.yaml
and deploy/kubernetes configure theirs (PREFECT_SERVER_DATABASE_*, the password apart)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.postgres_server import postgres_server
from tests.prefect_server import shardflow_server

pytestmark = pytest.mark.e2e

INGEST = (
    "import sys; from flows.pipeline import ingest_flow; "
    "print(ingest_flow(dataset='sdss', home=sys.argv[1], source=sys.argv[2])['version'])"
)


def test_a_flow_run_is_recorded_in_postgresql(tmp_path: Path) -> None:
    from preprocessing.sources.synth import write_sdss_exports

    exports = tmp_path / "exports"
    write_sdss_exports(exports, rows=3_000, files=3, fmt="csv", seed=7)
    with postgres_server() as pg:
        pg.psql("postgres", "CREATE DATABASE prefect")
        env = {
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_SERVER_DATABASE_DRIVER": "postgresql+asyncpg",
            "PREFECT_SERVER_DATABASE_HOST": "127.0.0.1",
            "PREFECT_SERVER_DATABASE_PORT": str(pg.port),
            "PREFECT_SERVER_DATABASE_USER": pg.user,
            "PREFECT_SERVER_DATABASE_NAME": "prefect",
            "PREFECT_SERVER_DATABASE_PASSWORD": pg.password,
        }
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        with shardflow_server(env, tmp_path / "server.log", start_seconds=300) as base:
            url = f"{base}/api"
            flow_env = {k: v for k, v in env.items() if not k.startswith("PREFECT_SERVER_DAT")}
            flow = subprocess.run(
                [sys.executable, "-c", INGEST, str(tmp_path / "home"), str(exports)],
                env={**flow_env, "PREFECT_API_URL": url},
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert flow.returncode == 0, flow.stderr[-3000:]
            # What the server wrote is in PostgreSQL: the flow run, its one task run per pass,
            # its artifacts, and (written in batches, seconds later) its events.
            assert pg.psql("prefect", "SELECT state_type FROM flow_run").split() == ["COMPLETED"]
            assert pg.psql("prefect", "SELECT name, state_type FROM task_run").split() == [
                "convert|COMPLETED"
            ]
            keys = set(pg.psql("prefect", "SELECT key FROM artifact").split())
            assert keys == {"sdss-ingest-progress", "sdss-ingest-convert", "sdss-raw-files"}
            deadline = time.monotonic() + 120
            completed = "0"
            while completed == "0" and time.monotonic() < deadline:
                time.sleep(2)
                completed = pg.psql(
                    "prefect",
                    "SELECT count(*) FROM events WHERE event = 'prefect.flow-run.Completed'",
                ).strip()
            assert completed == "1"
