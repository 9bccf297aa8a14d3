"""The flows under Prefect's test harness: the preprocess flow on a cluster given as a
parameter; what a run records in Prefect (a task run per pass, an artifact version per pass,
whatever the number of tasks); a failed task named in the UI; the registry's default model;
the stage results' JSON shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import LocalCluster

from flows.stages import with_default_model
from preprocessing.config import ClusterConfig, JobOptions
from preprocessing.datasets import DATASETS
from preprocessing.plan import PlanConfig
from training.config import LaunchConfig, TrainConfig


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


def recorded(flow_run_id: Any) -> dict[str, Any]:
    """What the API holds of one flow run: its task runs (by name), its artifacts (every
    version), its logs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    return {
        "task_runs": {t.name: t for t in task_runs},
        "artifacts": artifacts,
        "logs": logs,
    }


def table(artifact: Any) -> list[dict[str, Any]]:
    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert isinstance(data, list)
    return data


def test_preprocess_flow_runs_on_the_scheduler_it_is_given(harness: str, sdss_home: Path) -> None:
    from flows.pipeline import preprocess_flow

    # A cluster of its own, as a deployment's `cluster` parameter would name; its workers need
    # nothing of Prefect (no API URL): its tasks are plain Dask tasks under the pass task runs.
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None
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
    run = recorded(state.state_details.flow_run_id)
    # One task run per pass that had tasks, not one per Dask task.
    passes = {name for name, counts in result["tasks"].items() if counts["tasks"]}
    assert set(run["task_runs"]) == passes
    assert {"scan", "write"} <= passes
    assert {t.state_type.value for t in run["task_runs"].values()} == {"COMPLETED"}
    keys = [a.key for a in run["artifacts"]]
    # One version of each: progress, a table per pass, the shards, the summary.
    assert sorted(keys) == sorted(
        ["sdss-preprocess-progress", "sdss-shards", "sdss-preprocess-summary"]
        + [f"sdss-preprocess-{name}" for name in passes]
    )
    write = next(a for a in run["artifacts"] if a.key == "sdss-preprocess-write")
    rows = table(write)
    total = result["tasks"]["write"]["tasks"]
    assert rows[0]["task"] == f"all {total:,} tasks"
    assert rows[0]["rows"] == result["rows"]
    assert 1 <= len(rows) - 1 <= min(total, 10)  # the slowest, no more than ten
    assert all(row["task"].startswith("slowest: write-") for row in rows[1:])


def test_a_small_job_runs_in_the_flow_process_as_on_the_cli(harness: str, sdss_home: Path) -> None:
    """The flow's passes run their tasks where `shardflow preprocess` would: a job this small
    in the flow run's own process, no LocalCluster started; its passes are still task runs
    with their tables, and the summary says no cluster ran it."""
    from flows.pipeline import preprocess_flow

    state = preprocess_flow(
        dataset="sdss",
        home=str(sdss_home),
        options=JobOptions(plan=PlanConfig(rank_multiple=8, target_rows_per_group=300)),
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    run = recorded(state.state_details.flow_run_id)
    assert any("no cluster started" in log.message for log in run["logs"])
    assert {"scan", "write"} <= set(run["task_runs"])
    by_key = {a.key: a for a in run["artifacts"]}
    write = table(by_key["sdss-preprocess-write"])
    assert write[0]["rows"] == result["rows"]
    assert all(row["task"].startswith("slowest: write-") for row in write[1:])
    assert all(row["seconds"] >= 0 for row in write[1:])
    summary = str(by_key["sdss-preprocess-summary"].data)
    assert "no Dask cluster was started" in summary
    assert "Dask dashboard" not in summary


def test_what_a_run_records_does_not_grow_with_its_tasks(harness: str, tmp_path: Path) -> None:
    """120 exports: one task run, one version of each artifact, a bounded log; the table of
    raw files holds its first 100 and says where the rest are."""
    from flows.pipeline import TABLE_ROWS, ingest_flow
    from preprocessing.sources.synth import write_sdss_exports

    write_sdss_exports(tmp_path / "exports", rows=1_200, files=120, fmt="csv", seed=2)
    state = ingest_flow(
        dataset="sdss",
        home=str(tmp_path / "home"),
        source=str(tmp_path / "exports"),
        cluster=ClusterConfig(workers=1),
        return_state=True,
    )
    assert state.is_completed(), state.message
    run = recorded(state.state_details.flow_run_id)
    assert list(run["task_runs"]) == ["convert"]
    by_key = {a.key: a for a in run["artifacts"]}
    assert len(by_key) == len(run["artifacts"]) == 3
    convert = table(by_key["sdss-ingest-convert"])
    assert convert[0]["task"] == "all 120 tasks"
    assert (convert[0]["rows"], convert[0]["reused"]) == (1_200, "0")
    assert len(convert) == 11  # the total and the ten slowest
    raw_files = by_key["sdss-raw-files"]
    assert len(table(raw_files)) == TABLE_ROWS
    assert "the first 100 of 120" in str(raw_files.description)
    assert float(by_key["sdss-ingest-progress"].data) == 100.0  # type: ignore[arg-type]
    # A few lines of progress, not one per task.
    assert len(run["logs"]) < 20, [log.message for log in run["logs"]]


def heartbeats_of(flow_run_id: Any, deadline_seconds: float = 120.0) -> list[Any]:
    """The heartbeat events the API holds of one flow run, once it holds one (the server
    writes events in batches, a few seconds late), or none by the deadline."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)
    deadline = time.monotonic() + deadline_seconds
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_events(
                EventFilter(  # made anew: its time window ends when it is made
                    event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                    resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
                ),
                limit=50,  # the client's default, 100, is more than its own server takes
            )
            if page.events or time.monotonic() > deadline:
                return list(page.events)
            time.sleep(1.0)


def test_a_flow_run_is_recorded_as_prefect_records_it(harness: str, tmp_path: Path) -> None:
    """What flows.prefect_runtime changes leaves a run's record as it was: the flow run still
    sends its heartbeat (a server's automation notices a crashed run by them) though the
    engine no longer holds its end until the heartbeat thread wakes (up to a second), and its
    parameters are recorded as Prefect's own encoder writes them."""
    from fastapi.encoders import jsonable_encoder
    from prefect import flow_engine
    from prefect.client.orchestration import get_client

    from flows.pipeline import ingest_flow
    from flows.prefect_runtime import heartbeats_without_join
    from preprocessing.sources.synth import write_sdss_exports

    write_sdss_exports(tmp_path / "exports", rows=200, files=2, fmt="csv", seed=3)
    parameters = {
        "dataset": "sdss",
        "home": str(tmp_path / "home"),
        "source": str(tmp_path / "exports"),
        "cluster": ClusterConfig(workers=1, memory_limit="1GiB"),
    }
    state = ingest_flow(**parameters, return_state=True)  # type: ignore[arg-type]
    assert state.is_completed(), state.message
    assert heartbeats_without_join()  # already so: this Prefect's engine takes the change
    assert getattr(flow_engine._send_heartbeats, "__shardflow_unjoined__", False)
    flow_run_id = state.state_details.flow_run_id
    assert len(heartbeats_of(flow_run_id)) >= 1
    with get_client(sync_client=True) as client:
        recorded_parameters = client.read_flow_run(flow_run_id).parameters
    assert recorded_parameters["cluster"]["memory_limit"] == "1GiB"
    assert recorded_parameters == {**jsonable_encoder(parameters), "skyserver": None}


def test_prefects_notification_blocks_load_when_first_used(harness: str, tmp_path: Path) -> None:
    """A process that imports the flows before Prefect leaves Prefect's notification and
    webhook block modules unloaded (flows.prefect_runtime.blocks_on_first_use); a notification
    block saved on the server still loads by its slug there, and its module by name."""
    from prefect.blocks.notifications import SlackWebhook

    SlackWebhook(url="https://hooks.slack.com/services/T0/B0/shardflow").save(
        "shardflow-first-use", overwrite=True
    )
    script = """
import json, sys
import flows.pipeline
from prefect.blocks.core import Block
unloaded = [name for name, cls in [("prefect.blocks.notifications", "SlackWebhook"),
            ("prefect.blocks.webhook", "Webhook")] if cls not in vars(sys.modules[name])]
block = Block.load("slack-webhook/shardflow-first-use")
from prefect.blocks.webhook import Webhook
print(json.dumps({"unloaded": unloaded, "block": type(block).__name__,
                  "url": block.url.get_secret_value(), "webhook": Webhook.get_block_type_slug()}))
"""
    env = {**os.environ, "PREFECT_API_URL": harness, "PREFECT_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "unloaded": ["prefect.blocks.notifications", "prefect.blocks.webhook"],
        "block": "SlackWebhook",
        "url": "https://hooks.slack.com/services/T0/B0/shardflow",
        "webhook": "webhook",
    }


@pytest.mark.parametrize(
    "value",
    [
        None,
        "sdss",
        ClusterConfig(),
        ClusterConfig(workers=2, scheduler="tcp://dask-scheduler:8786"),
        JobOptions(),
        JobOptions(plan=PlanConfig(rank_multiple=8, target_rows_per_group=300)),
        TrainConfig(epochs=2),
        LaunchConfig(),
    ],
)
def test_flow_parameters_are_the_json_prefects_encoder_makes(value: Any) -> None:
    """The flows encode their parameters without FastAPI, into the same JSON."""
    from fastapi.encoders import jsonable_encoder

    from flows.pipeline import pipeline

    assert pipeline.serialize_parameters({"x": value}) == {"x": jsonable_encoder(value)}


def test_a_failed_task_is_named_with_its_error(harness: str, tmp_path: Path) -> None:
    """The third of four exports is damaged: the flow run fails naming the file; so do its
    pass's task run and the pass's table, which names the task."""
    from flows.pipeline import ingest_flow
    from preprocessing.sources.synth import write_sdss_exports

    paths = write_sdss_exports(tmp_path / "exports", rows=400, files=4, fmt="csv", seed=2)
    damaged = sorted(paths)[2]
    with open(damaged, "a") as f:
        f.write("1,2,3\n")
    state = ingest_flow(
        dataset="sdss",
        home=str(tmp_path / "home"),
        source=str(tmp_path / "exports"),
        cluster=ClusterConfig(workers=1),
        return_state=True,
    )
    assert state.is_failed()
    assert damaged.name in str(state.message)
    run = recorded(state.state_details.flow_run_id)
    convert = run["task_runs"]["convert"]
    assert convert.state_type.value == "FAILED"
    assert damaged.name in str(convert.state.message)
    (pass_table,) = [a for a in run["artifacts"] if a.key == "sdss-ingest-convert"]
    failed = [row for row in table(pass_table) if row["task"].startswith("FAILED")]
    assert [row["task"] for row in failed] == ["FAILED convert-00003"]
    assert damaged.name in failed[0]["error"]
    assert "convert-00003" in str(pass_table.description)
    assert any("convert-00003" in log.message for log in run["logs"])


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


def test_a_skyserver_ingest_waits_for_a_slot_of_the_skyserver_limit(
    harness: str, tmp_path: Path
) -> None:
    """Another flow run holds the one slot of `skyserver`: this run's ingest asks SkyServer
    nothing until that slot is released, then ingests."""
    import threading
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.concurrency.sync import concurrency

    from flows.pipeline import SKYSERVER_LIMIT, ingest_flow
    from preprocessing.datasets import SkyServerOptions
    from tests.preprocessing.sources.skyserver_standin import StandIn, serve, synthetic_rows

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=SKYSERVER_LIMIT, limit=1)
        )
    outcome: dict[str, Any] = {}
    try:
        with serve(StandIn(synthetic_rows(900, seed=5), cap=2_000)) as server:

            def ingest() -> None:
                named = ingest_flow.with_options(flow_run_name="waits-for-skyserver")
                outcome["state"] = named(
                    dataset="sdss",
                    home=str(tmp_path / "home"),
                    skyserver=SkyServerOptions(url=server.url),
                    cluster=ClusterConfig(workers=1),
                    return_state=True,
                )

            with concurrency(SKYSERVER_LIMIT, occupy=1):
                thread = threading.Thread(target=ingest)
                thread.start()
                # The run has started (its Dask cluster, then the slot it waits for).
                deadline = time.monotonic() + 300
                running = False
                while not running and time.monotonic() < deadline and thread.is_alive():
                    time.sleep(2)
                    with get_client(sync_client=True) as client:
                        runs = client.read_flow_runs(
                            flow_run_filter=FlowRunFilter(
                                name=FlowRunFilterName(any_=["waits-for-skyserver"])
                            )
                        )
                    running = any(r.state_type.value == "RUNNING" for r in runs)
                assert running, outcome
                time.sleep(10)
                asked_while_held = len(server.asked_at)
                released_at = time.monotonic()
            thread.join(timeout=600)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(SKYSERVER_LIMIT)
    assert asked_while_held == 0
    assert outcome["state"].is_completed(), outcome["state"].message
    assert min(server.asked_at) > released_at
    assert outcome["state"].result()["rows"] == 900


def test_a_train_past_its_timeout_fails_in_one_line_and_leaves_no_rank(
    harness: str, tmp_path: Path
) -> None:
    import psutil

    from flows.pipeline import preprocess_flow, train_flow
    from tests.conftest import ingest_random_mnist

    home = tmp_path / "home"
    home.mkdir()
    ingest_random_mnist(home, train_rows=3_000, seed=3)
    assert preprocess_flow(dataset="mnist", home=str(home), cluster=ClusterConfig(workers=1))
    state = train_flow(
        dataset="mnist",
        home=str(home),
        config=TrainConfig(num_ranks=2, epochs=50, batch_size=8),
        timeout_seconds=30,
        return_state=True,
    )
    assert state.is_failed()
    message = str(state.message)
    assert "training stopped after its timeout of 30 s (timeout_seconds)" in message
    assert "\n" not in message
    run = recorded(state.state_details.flow_run_id)
    (horovodrun,) = [t for name, t in run["task_runs"].items() if name.startswith("horovodrun")]
    assert horovodrun.state.name == "TimedOut"
    # horovodrun was started, and neither it nor any rank outlives the flow run.
    assert any(log.message.startswith("$ ") for log in run["logs"])
    left = [
        p.cmdline()
        for p in psutil.Process().children(recursive=True)
        if any("training.worker" in a or "horovodrun" in a for a in p.cmdline())
    ]
    assert left == []
