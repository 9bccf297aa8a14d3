"""The flows under Prefect's test harness: the preprocess flow on a cluster given as a
parameter, its task runs and artifacts; the registry's default model; the stage results'
JSON shapes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import LocalCluster

from flows.stages import with_default_model
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import DATASETS
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

    # A cluster of its own, as a deployment's `cluster` parameter would name; its workers
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
            cluster=ClusterConfig(scheduler=remote.scheduler_address),
            options=JobOptions(plan=PlanConfig(rank_multiple=8, target_rows_per_group=200)),
            return_state=True,
        )
        assert state.is_completed(), state.message
        result = state.result()
        # The given scheduler ran the job: its task log holds the scan and write tasks.
        prefixes = set(remote.scheduler.task_prefixes)
        assert {"scan", "duplicates", "write"} <= prefixes, prefixes
    assert result["splits"]["train"]["num_row_groups"] >= 8
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs()
        names = {t.name for t in task_runs if t.flow_run_id == state.state_details.flow_run_id}
        artifacts = {a.key for a in client.read_artifacts()}
    assert {"scan-00000", "write-00000"} <= names
    assert {"sdss-preprocess-progress", "sdss-shards", "sdss-preprocess-summary"} <= artifacts


def test_preprocess_flow_refuses_a_malformed_scheduler_in_one_line(
    harness: str, sdss_home: Path
) -> None:
    from flows.pipeline import preprocess_flow

    # As a deployment run passes it: JSON, validated into a ClusterConfig.
    state = preprocess_flow(
        dataset="sdss",
        home=str(sdss_home),
        cluster={"scheduler": "not-an-address"},  # type: ignore[arg-type]
        return_state=True,
    )
    assert state.is_failed()
    assert "scheduler 'not-an-address' is not a scheduler address" in str(state.message)


def test_a_cluster_parameter_without_workers_gets_the_configs_default() -> None:
    from flows.pipeline import ingest_flow, pipeline, preprocess_flow
    from preprocessing.config import usable_cores

    for entry in (ingest_flow, preprocess_flow, pipeline):
        checked = entry.validate_parameters(
            {"dataset": "sdss", "cluster": {"scheduler": "tcp://10.0.0.5:8786"}}
        )
        assert checked["cluster"] == ClusterConfig(
            workers=usable_cores(), scheduler="tcp://10.0.0.5:8786"
        )
    # Users and deploy/prefect.yaml call the ingest flow with these arguments only.
    checked = ingest_flow.validate_parameters({"dataset": "sdss", "source": "exports/"})
    assert (checked["dataset"], checked["source"], checked.get("cluster")) == (
        "sdss",
        "exports/",
        None,
    )


def test_the_registry_chooses_the_model() -> None:
    assert with_default_model(DATASETS["sdss"], TrainConfig()).model == "dnn"
    assert with_default_model(DATASETS["fashion-mnist"], TrainConfig()).model == "cnn"
    assert with_default_model(DATASETS["sdss"], TrainConfig(model="dnn", epochs=2)).epochs == 2


def slowed_ranks() -> list[dict[str, Any]]:
    """Two ranks' records of one epoch: rank 1's input slowed."""
    from tests.training.test_input_metrics import rank

    return [
        rank(0, input_per_batch=0.002, step=0.1, longest=0.1),
        rank(1, input_per_batch=0.2, step=0.1, longest=0.1),
    ]


def test_the_train_stage_hands_on_each_epoch_once_as_rank_0_says_it_is_written(
    tmp_path: Path,
) -> None:
    from flows.stages import EpochWatch
    from training.input_metrics import EPOCHS_FILE, EpochLog, epoch_line

    log = EpochLog(tmp_path / EPOCHS_FILE)
    lines: list[str] = []
    entries: list[dict[str, Any]] = []
    watch = EpochWatch(lines.append, entries.append)
    watch("[0]<stdout>:Epoch 1/2")
    log.add(0, slowed_ranks())
    watch("[0]<stdout>:" + epoch_line(0, log.path))
    assert [e["epoch"] for e in entries] == [0]
    log.add(1, slowed_ranks())
    watch("[0]<stdout>:" + epoch_line(1, log.path))
    watch("[0]<stdout>:" + epoch_line(1, log.path))  # said twice: handed on once
    assert [e["epoch"] for e in entries] == [0, 1]
    assert entries[1]["input_summary"]["flags"]["1"] == ["input-bound", "slowest"]
    assert len(lines) == 4  # every line passed on
    # A file it cannot read (another host's disk) is said, and training goes on.
    watch(epoch_line(2, tmp_path / "elsewhere" / EPOCHS_FILE))
    assert lines[-1].startswith("input view: cannot read")
    assert len(entries) == 2


def test_the_train_stage_publishes_a_version_of_the_input_table_per_epoch(
    harness: str, tmp_path: Path
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.pipeline import input_by_epoch_table
    from flows.stages import EpochWatch
    from training.input_metrics import EPOCHS_FILE, EpochLog, epoch_line

    @flow(name="input-by-epoch")
    def epochs() -> None:
        watch = EpochWatch(lambda _line: None, input_by_epoch_table("unit-dnn", print))
        log = EpochLog(tmp_path / EPOCHS_FILE)
        for epoch in range(3):
            log.add(epoch, slowed_ranks())
            watch("[0]<stdout>:" + epoch_line(epoch, log.path))

    state = epochs(return_state=True)
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["unit-dnn-input-by-epoch"]))
        )
    assert len(versions) == 3
    assert all(v.flow_run_id == state.state_details.flow_run_id for v in versions)
    tables = sorted(
        (json.loads(v.data) if isinstance(v.data, str) else v.data for v in versions),
        key=lambda table: table[0]["epoch"],
    )
    assert [[(row["epoch"], row["rank"]) for row in t] for t in tables] == [
        [(1, 0), (1, 1)],
        [(2, 0), (2, 1)],
        [(3, 0), (3, 1)],
    ]
    assert tables[-1][1]["flags"] == "input-bound, slowest"
