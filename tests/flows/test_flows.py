"""The flows under Prefect's test harness: the preprocess flow on a scheduler given as a
parameter, its task runs and artifacts; the registry's default model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import LocalCluster

from flows.stages import with_default_model
from preprocessing.config import JobOptions
from preprocessing.plan import PlanConfig
from training.config import TrainConfig


@pytest.fixture(scope="module")
def harness() -> Iterator[str]:
    """Prefect's test harness (a temporary API server and database); yields the API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # Its server sends no telemetry; a generous start-up limit: the machine may be busy (the
    # default is 30 s).
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with prefect_test_harness(server_startup_timeout=600):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="module")
def sdss_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with a raw "sdss" version of 6,000 synthetic rows in 2 CSV exports."""
    from data_catalog import Catalog
    from preprocessing.sources import exports
    from preprocessing.sources.synth import write_sdss_exports

    home = tmp_path_factory.mktemp("flows-home")
    written = write_sdss_exports(home / "exports", rows=6_000, files=2, fmt="csv", seed=4)
    exports.ingest_exports(Catalog(home / "catalog"), source=str(written[0].parent))
    return home


def test_preprocess_flow_runs_on_the_scheduler_it_is_given(harness: str, sdss_home: Path) -> None:
    from prefect.client.orchestration import get_client

    from flows.pipeline import preprocess_flow

    # A cluster of its own, as a deployment's `scheduler` parameter would name; its workers
    # report task runs to the same API, as a real cluster's workers are configured to.
    with LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        env={"PREFECT_API_URL": harness},
    ) as remote:
        state = preprocess_flow(
            dataset="sdss",
            home=str(sdss_home),
            scheduler=remote.scheduler_address,
            options=JobOptions(plan=PlanConfig(rank_multiple=8, target_rows_per_group=200)),
            return_state=True,
        )
        assert state.is_completed(), state.message
        result = state.result()
        # The given scheduler ran the job: its task log holds the scan and write tasks.
        prefixes = set(remote.scheduler.task_prefixes)
        assert {"scan", "write-train", "write-test"} <= prefixes, prefixes
    assert result["splits"]["train"]["num_row_groups"] % 8 == 0
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs()
        names = {t.name for t in task_runs if t.flow_run_id == state.state_details.flow_run_id}
        artifacts = {a.key for a in client.read_artifacts()}
    assert {"scan-00000", "write-train-00000"} <= names
    assert {"sdss-preprocess-progress", "sdss-shards", "sdss-preprocess-summary"} <= artifacts


def test_preprocess_flow_refuses_a_malformed_scheduler_in_one_line(
    harness: str, sdss_home: Path
) -> None:
    from flows.pipeline import preprocess_flow

    state = preprocess_flow(
        dataset="sdss", home=str(sdss_home), scheduler="not-an-address", return_state=True
    )
    assert state.is_failed()
    assert "scheduler 'not-an-address' is not a scheduler address" in str(state.message)


def test_the_registry_chooses_the_model() -> None:
    assert with_default_model("sdss", TrainConfig()).model == "dnn"
    assert with_default_model("fashion-mnist", TrainConfig()).model == "cnn"
    assert with_default_model("sdss", TrainConfig(model="dnn", epochs=2)).epochs == 2
