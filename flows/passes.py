"""Each pass of a job as one Prefect task run, its tasks plain Dask tasks under it.

    flow run shardflow-ingest
      └─ task run "convert" ── the same runner as `shardflow ingest` (planned_runner: this
            │                  process, its threads, or a Dask cluster, as the plan says):
            │                  2,000 tasks, each timed where it runs
            ├─ progress artifact <key>-progress: updated at most every few seconds and
            │  once per percent, and when a pass ends
            ├─ a log line at most every half minute, and when a pass ends
            └─ table artifact <key>-<pass>, once, when the pass ends or fails: its totals,
               its slowest tasks and the task that failed

What Prefect records grows with passes, not with tasks: a job of 57,000 tasks in four passes
is four task runs, four table versions and at most about a hundred progress updates per
stage. A task that fails still names itself (its key, and the error, which names the file)
in its pass's table, log and state.

Each task runs inside :func:`flows.timed_tasks.timed_call` (on a Dask worker, which never
imports Prefect, or in this process). The flow's tasks run where the CLI's do: a flow run
that started a LocalCluster for a job the CLI runs on its own threads paid the cluster's start,
its workers' imports and its stop on top of Prefect's own cost (``bench prefect``: 2,000 CSV
exports, flow ÷ plain 1.27 in wall time with the cluster, docs/prefect.md).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from flows.timed_tasks import failed_task, timed_spec
from preprocessing.cluster import PlannedRunner, planned_runner
from preprocessing.config import ClusterConfig
from preprocessing.driver import PassProgress, Result, TaskSpec, input_bytes

Progress = Callable[[str], None]
Bar = Callable[[PassProgress], float]


class PassTable:
    """One pass's summary: its totals (from the driver's last report, results reused from
    earlier versions included), its ``SLOWEST`` slowest tasks, and the task that failed."""

    SLOWEST = 10

    def __init__(self, pass_name: str, planned: int) -> None:
        self.pass_name = pass_name
        self.planned = planned
        """The pass's tasks to run (those kept from earlier versions not counted)."""
        self.slowest: list[tuple[float, int, dict[str, Any]]] = []
        self.count = 0
        self.failure: dict[str, Any] | None = None

    def add(self, spec: TaskSpec, result: Result, seconds: float) -> None:
        self.count += 1
        if len(self.slowest) == self.SLOWEST and seconds <= self.slowest[0][0]:
            return
        row = {
            "task": spec.key,
            "rows": int(result.get("rows", spec.rows)),
            "bytes": input_bytes(spec, result),
            "reused": "yes" if result.get("reused") else "",
            "seconds": round(seconds, 3),
            "error": "",
        }
        item = (seconds, self.count, row)
        if len(self.slowest) < self.SLOWEST:
            heapq.heappush(self.slowest, item)
        else:
            heapq.heapreplace(self.slowest, item)

    def fail(self, exc: BaseException) -> None:
        self.failure = {
            "task": f"FAILED {failed_task(exc) or '(unknown: the cluster lost it)'}",
            "rows": None,
            "bytes": None,
            "reused": "",
            "seconds": None,
            "error": f"{type(exc).__name__}: {exc}",
        }

    def rows(self, state: PassProgress | None) -> list[dict[str, Any]]:
        total = {
            "task": f"all {state.tasks_total if state else self.planned:,} tasks",
            "rows": state.rows_done if state else 0,
            "bytes": state.bytes_done if state else 0,
            "reused": str(state.reused if state else 0),
            "seconds": round(state.seconds, 1) if state else None,
            "error": "",
        }
        slowest = [
            {**row, "task": f"slowest: {row['task']}"}
            for _seconds, _n, row in sorted(self.slowest, key=lambda item: -item[0])
        ]
        return [total, *([self.failure] if self.failure else []), *slowest]

    def description(self, state: PassProgress | None) -> str:
        """Markdown: how far the pass came; the failed task, or how many the table shows."""
        head = f"pass {self.pass_name}: " + (
            state.describe() if state else f"0/{self.planned:,} tasks"
        )
        if self.failure is not None:
            return f"{head}; **{self.failed_line()}**"
        return f"{head}; the {min(self.count, self.SLOWEST)} slowest of {self.count:,} tasks run"

    def failed_line(self) -> str:
        assert self.failure is not None
        task = self.failure["task"].removeprefix("FAILED ")
        return f"task {task} failed: {self.failure['error']}"


class StageWatch:
    """What a stage's flow run shows of its passes (its driver's ``on_progress``): a progress
    artifact, log lines and one table per pass, each at a bounded rate. An artifact the API
    refuses is said in the log and the run goes on: a view must not stop the work.

    The calls are made in the driver's thread, not a thread of their own: CPython 3.11.7's
    parser keeps its recursion depth per interpreter, and a Prefect call compiling code (a
    forward reference) in one thread while the stage fingerprints its modules with
    ``ast.parse`` in another failed with "SystemError: AST constructor recursion depth
    mismatch" (docs/STACK.md). At most a hundred or so short calls per stage are not worth it.
    """

    UPDATE_SECONDS = 5.0
    """Progress updates at most this often, and only once the bar moved a percent."""
    LOG_SECONDS = 30.0

    def __init__(self, key: str, description: str, bar: Bar) -> None:
        self.key = key
        self.bar = bar
        self.states: dict[str, PassProgress] = {}
        self.shown = (0.0, 0.0)  # (when, percent) of the last update
        self.logged = 0.0
        self.artifact: UUID | None = None
        self._send(lambda: self._create(description))

    def _send(self, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as exc:  # the API's answer, whatever it is: said, and the run goes on
            get_run_logger().warning(f"Prefect API: an artifact was not sent: {exc!r}")

    def _create(self, description: str) -> None:
        # "Sync compatible": typed as a value or a coroutine, a value in a synchronous flow.
        created = create_progress_artifact(
            progress=0.0, key=f"{self.key}-progress", description=description
        )
        self.artifact = cast(UUID, created)

    def _update(self, percent: float, description: str) -> None:
        if self.artifact is not None:  # else its creation failed, and was said
            update_progress_artifact(self.artifact, progress=percent, description=description)

    def log(self, line: str) -> None:
        get_run_logger().info(line)  # the pass's task run's log, in one

    def __call__(self, state: PassProgress) -> None:
        self.states[state.pass_name] = state
        now = time.monotonic()
        ended = state.tasks_done == state.tasks_total
        percent = 100.0 * self.bar(state)
        when, shown = self.shown
        if ended or (now - when >= self.UPDATE_SECONDS and percent - shown >= 1.0):
            self.shown = (now, percent)
            self._send(lambda: self._update(percent, state.describe()))
        if ended or now - self.logged >= self.LOG_SECONDS:
            self.logged = now
            self.log(state.describe())

    def publish(self, table: PassTable) -> None:
        state = self.states.get(table.pass_name)
        self._send(
            lambda: create_table_artifact(
                key=f"{self.key}-{table.pass_name}",
                table=table.rows(state),
                description=table.description(state),
            )
        )

    def finish(self, description: str) -> None:
        self._send(lambda: self._update(100.0, description))


def _pass_name(run_key: str) -> str:
    # preprocessing.driver.run_passes keys each pass's run "<pass>-<job's work key>-<8 hex>";
    # pass names hold no dash.
    return run_key.split("-", 1)[0]


class _PassTaskRuns:
    """The driver's task runner in a flow: each pass one Prefect task run whose body runs the
    pass's tasks, each timed, on ``runner`` (the CLI's: plain Dask tasks, or this process)."""

    def __init__(self, runner: PlannedRunner, watch: StageWatch) -> None:
        self.runner = runner
        self.watch = watch

    def usage(self) -> dict[str, Any]:
        return self.runner.usage()

    def run(
        self, tasks: Sequence[TaskSpec], *, run_key: str, on_done: Callable[[int, Result], None]
    ) -> list[Result]:
        if not tasks:  # every result of the pass kept from an earlier version
            return []
        name = _pass_name(run_key)
        table = PassTable(name, len(tasks))
        results: list[Result] = []

        def done(index: int, timed: dict[str, Any]) -> None:
            table.add(tasks[index], timed["result"], timed["seconds"])
            on_done(index, timed["result"])

        def body() -> dict[str, Any]:
            try:
                ran = self.runner.run(
                    [timed_spec(spec) for spec in tasks], run_key=run_key, on_done=done
                )
            except Exception as exc:
                table.fail(exc)
                self.watch.log(f"pass {name}: {table.failed_line()}")
                self.watch.publish(table)
                raise
            results.extend(timed["result"] for timed in ran)
            self.watch.publish(table)
            return {"pass": name, "tasks": len(tasks)}

        pass_task(name, len(tasks), body)
        return results


@task(name="pass", task_run_name="{pass_name}", cache_policy=NO_CACHE)
def pass_task(pass_name: str, tasks: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One pass of a job as a task run of the running flow run: its ``tasks`` Dask tasks,
    run by ``run`` (which keeps their results: the task run's own result stays small)."""
    return run()


class PassRuns:
    """The runner factory of a flow's stage: the CLI's runner for ``cluster`` (the Dask
    cluster it describes, started only when the plan needs one), with each pass a task run;
    keeps the cluster's dashboard link, if one was started, for the summary."""

    def __init__(self, cluster: ClusterConfig, watch: StageWatch, progress: Progress) -> None:
        self.cluster = cluster
        self.watch = watch
        self.progress = progress
        self.dashboard: str | None = None

    @contextmanager
    def __call__(self) -> Iterator[_PassTaskRuns]:
        with planned_runner(self.cluster, self.progress) as runner:
            try:
                yield _PassTaskRuns(runner, self.watch)
            finally:
                self.dashboard = runner.dashboard
