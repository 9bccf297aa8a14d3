"""The one driver on a real Dask LocalCluster: passes, the rolling window, commits, failures,
an existing version, and a scheduler of its own."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from distributed import Client, LocalCluster

from data_catalog import Catalog, Manifest, Staging, derived_version
from data_catalog.errors import ShardflowError
from preprocessing.cluster import dask_runner
from preprocessing.config import ClusterConfig
from preprocessing.driver import (
    PassProgress,
    Result,
    Results,
    Runner,
    TaskSpec,
    ThreadRunner,
    run_job,
    serial_runner,
)


def count_task(number: int, out: str) -> Result:
    """Pass 1: write a file whose content is the number; say which worker did it."""
    from distributed import get_worker

    path = Path(out) / f"count-{number:03d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"number": number}))
    try:
        worker = get_worker().address
    except ValueError:  # not on a Dask worker (the serial runner)
        worker = "local"
    return {"number": number, "file": path.name, "worker": worker}


def sum_task(numbers: list[int], out: str) -> Result:
    """Pass 2: planned from pass 1's results."""
    (Path(out) / "sum.json").write_text(json.dumps({"sum": sum(numbers)}))
    return {"sum": sum(numbers)}


def failing_task(number: int) -> Result:
    if number == 3:
        raise ShardflowError(f"input {number} is broken")
    return {"number": number}


CODE = "src-test"


@dataclass(frozen=True, kw_only=True)
class CountJob:
    """A job of two passes: ``count`` tasks write a file each, then ``sum`` adds them up."""

    size: int
    name: str = "counts"
    kind: str = "processed"
    passes: tuple[str, ...] = ("count", "sum")

    @property
    def version(self) -> str:
        return derived_version(
            name=self.name, kind=self.kind, parents=(), parameters={"size": self.size}, code=CODE
        )

    @property
    def work_key(self) -> str:
        return f"{self.name}-{self.version}"

    def tasks(self, pass_name: str, done: Results, work: Path) -> Sequence[TaskSpec]:
        if pass_name == "count":
            return [
                TaskSpec(key=f"count-{n:03d}", fn=count_task, args=(n, str(work)), rows=1)
                for n in range(self.size)
            ]
        numbers = [int(r["number"]) for r in done["count"]]
        return [TaskSpec(key="sum", fn=sum_task, args=(numbers, str(work)))]

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        for path in sorted(work.iterdir()):
            stage.adopt(path, path.name)
        return stage.commit(
            code_version=CODE,
            rows=self.size,
            parameters={"size": self.size},
            statistics={"sum": done["sum"][0]["sum"]},
        )


@dataclass(frozen=True, kw_only=True)
class FailingJob(CountJob):
    passes: tuple[str, ...] = ("count",)

    def tasks(self, pass_name: str, done: Results, work: Path) -> Sequence[TaskSpec]:
        return [TaskSpec(key=f"fail-{n}", fn=failing_task, args=(n,)) for n in range(self.size)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as local:
        yield local


def test_passes_run_in_order_and_commit_one_version(cluster: LocalCluster, tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    seen: list[PassProgress] = []
    with Client(cluster) as client:

        @contextlib.contextmanager
        def runner() -> Iterator[Runner]:
            yield Runner(client)

        manifest = run_job(
            catalog,
            CountJob(size=20),
            runner=runner,
            work_root=tmp_path / "work",
            on_progress=seen.append,
        )
    assert manifest.statistics["sum"] == sum(range(20))
    assert len(manifest.files) == 21  # 20 count files and the sum
    assert catalog.verify() == []
    counts = [p for p in seen if p.pass_name == "count"]
    assert [p.tasks_done for p in counts] == list(range(1, 21))
    assert counts[-1].rows_done == counts[-1].rows_total == 20
    assert [p.pass_name for p in seen][-1] == "sum"
    assert not (tmp_path / "work" / f"counts-{manifest.version}").exists()  # removed on commit
    # The run is noted beside the data (the report's ingest MB/s), not in the version.
    run = manifest.extra["run"]
    assert run["passes"]["count"]["tasks"] == 20 and run["passes"]["sum"]["tasks"] == 1
    assert run["passes"]["count"]["rows"] == 20
    assert run["seconds"] >= run["passes"]["count"]["seconds"] > 0


def test_the_window_follows_the_worker_threads(cluster: LocalCluster) -> None:
    with Client(cluster) as client:
        runner = Runner(client)
        window = runner.window()
        assert window == 4  # two workers of one thread: two tasks each in flight
        in_flight: list[int] = []

        def unfinished(_index: int, _result: Any) -> None:
            in_flight.append(sum(s.status == "pending" for s in client.futures.values()))

        specs = [
            TaskSpec(key=f"count-{n:03d}", fn=count_task, args=(n, "/tmp/shardflow-window"))
            for n in range(30)
        ]
        results = runner.run(specs, run_key="window", on_done=unfinished)
    assert [r["number"] for r in results] == list(range(30))  # in task order
    assert 1 <= max(in_flight) <= window
    assert {r["worker"] for r in results} == set(cluster.scheduler_info["workers"])


def started_at(number: int) -> Result:
    import time

    time.sleep(0.05)
    return {"number": number, "started": time.time()}


def test_the_largest_tasks_start_first_and_results_keep_task_order(cluster: LocalCluster) -> None:
    # The largest task is planned last: started last, it would be the run's long tail.
    rows = [10] * 11 + [1000]
    specs = [
        TaskSpec(key=f"sized-{n:03d}", fn=started_at, args=(n,), rows=r) for n, r in enumerate(rows)
    ]
    with Client(cluster) as client:
        results = Runner(client).run(specs, run_key="sized", on_done=lambda _i, _r: None)
    assert [r["number"] for r in results] == list(range(12))
    # Submitted first; the tasks after the first window's worth wait for results to come back.
    largest = results[-1]["started"]
    assert all(largest <= r["started"] for r in results[4:-1])


def test_a_failing_task_stops_the_run_and_commits_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    catalog = Catalog(tmp_path / "catalog")
    with Client(cluster) as client:

        @contextlib.contextmanager
        def runner() -> Iterator[Runner]:
            yield Runner(client)

        with pytest.raises(ShardflowError, match="input 3 is broken"):
            run_job(catalog, FailingJob(size=12), runner=runner)
    assert catalog.names() == []
    assert not any((tmp_path / "catalog" / "staging").iterdir())


def test_an_existing_version_starts_no_runner(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    first = run_job(catalog, CountJob(size=3), runner=serial_runner)

    def no_runner() -> Any:
        raise AssertionError("the runner started although the version exists")

    again = run_job(catalog, CountJob(size=3), runner=no_runner)
    assert again.version == first.version and again.created == first.created


def test_a_given_scheduler_runs_the_tasks(tmp_path: Path) -> None:
    """``ClusterConfig(scheduler=...)``: the tasks run on that cluster's workers, not on a
    LocalCluster of the driver's own."""
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None
    ) as remote:
        address = remote.scheduler_address
        config = ClusterConfig(scheduler=address)
        catalog = Catalog(tmp_path / "catalog")
        manifest = run_job(
            catalog, CountJob(size=5), runner=lambda: dask_runner(config), work_root=tmp_path
        )
        assert manifest.statistics["sum"] == 10
        # The given scheduler ran the job's tasks (its task prefixes are the task keys').
        prefixes = set(remote.scheduler.task_prefixes)
        assert "count" in prefixes and any(p.startswith("sum") for p in prefixes)


class _RefusingRunner:
    """Refuses every task before running any, as a worker with other code is refused."""

    def run(self, tasks: Sequence[TaskSpec], **_: Any) -> list[Result]:
        from preprocessing.driver import CodeVersionError

        raise CodeVersionError("tcp://127.0.0.1:1", "tests", "src-theirs", "src-mine")


def test_a_refused_run_leaves_no_empty_work_folder(tmp_path: Path) -> None:
    """Issue #29 item 23: the job's folder is kept for a rerun only when it holds work."""
    from preprocessing.driver import CodeVersionError, job_dir

    work_root = tmp_path / "work"
    job = CountJob(size=3)
    with pytest.raises(CodeVersionError):
        run_job(
            Catalog(tmp_path / "catalog"),
            job,
            runner=lambda: contextlib.nullcontext(_RefusingRunner()),  # type: ignore[arg-type]
            work_root=work_root,
        )
    assert not job_dir(work_root, job).exists()

    class CrashAfterOne:
        def run(self, tasks: Sequence[TaskSpec], **_: Any) -> list[Result]:
            tasks[0].fn(*tasks[0].args)
            raise ShardflowError("stopped after one task")

    with pytest.raises(ShardflowError, match="stopped after one task"):
        run_job(
            Catalog(tmp_path / "catalog"),
            job,
            runner=lambda: contextlib.nullcontext(CrashAfterOne()),  # type: ignore[arg-type]
            work_root=work_root,
        )
    assert [p.name for p in job_dir(work_root, job).iterdir()] == ["count-000.json"]


def later_first_task(number: int) -> Result:
    """Finishes sooner the higher its number."""
    time.sleep(0.25 * (4 - number))
    return {"number": number}


def test_threads_run_every_pass_and_commit_what_the_serial_runner_commits(tmp_path: Path) -> None:
    versions = {}
    for way, runner in (
        ("threads", lambda: contextlib.nullcontext(ThreadRunner(2))),
        ("serial", serial_runner),
    ):
        manifest = run_job(Catalog(tmp_path / way / "catalog"), CountJob(size=9), runner=runner)
        versions[way] = (manifest.version, manifest.statistics, manifest.content_digest())
    assert versions["threads"] == versions["serial"]
    assert versions["threads"][1] == {"sum": 36}


def test_threads_give_results_in_task_order_and_report_each_as_it_ends() -> None:
    finished: list[int] = []
    results = ThreadRunner(4).run(
        [TaskSpec(key=f"late-{n}", fn=later_first_task, args=(n,)) for n in range(4)],
        run_key="late",
        on_done=lambda index, _result: finished.append(index),
    )
    assert results == [{"number": n} for n in range(4)]
    assert finished == [3, 2, 1, 0]


def test_a_failing_task_on_threads_stops_the_run_and_commits_nothing(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    done: list[int] = []
    with pytest.raises(ShardflowError, match="input 3 is broken"):
        ThreadRunner(1).run(
            [TaskSpec(key=f"fail-{n}", fn=failing_task, args=(n,)) for n in range(12)],
            run_key="fail",
            on_done=lambda index, _result: done.append(index),
        )
    # One thread: the tasks after the broken one were cancelled, not run.
    assert done == [0, 1, 2]
    with pytest.raises(ShardflowError, match="input 3 is broken"):
        run_job(
            catalog, FailingJob(size=12), runner=lambda: contextlib.nullcontext(ThreadRunner(2))
        )
    assert catalog.names() == []
