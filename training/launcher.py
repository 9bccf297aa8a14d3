"""Train on a processed dataset with ``horovodrun`` and commit the model to the catalog.

processed version (train/ and test/ Parquet, equal row groups)
    │  steps per epoch planned from the catalog's row counts
    ▼
horovodrun -np N -H localhost:N --gloo python -m training.worker run/worker.json
    │  rank r streams row groups r, r+N, ...; rank 0 writes model + metrics.json
    ▼
model version "<dataset>-<model>" (parent: the processed version)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import IO, Any

from data_catalog import Catalog, Manifest, derived_version, model_name, processed_name
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from data_catalog.manifest import ParentRef
from training import credentials, models
from training.checkpoints import STEP_CHECKPOINT
from training.config import LaunchConfig, TrainConfig, check_launch
from training.fingerprint import model_code
from training.hosts import check_hosts
from training.input import as_url, group_rows, plan_steps
from training.rank.config import WorkerConfig
from training.rank.run_dir import DIVERGED_NAME, last_checkpoint

Progress = Callable[[str], None]


def find_horovodrun() -> str:
    """The horovodrun of this environment (beside its python), else the one on PATH."""
    local = Path(sys.executable).parent / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if found is None:
        raise ShardflowError("horovodrun not found: install Horovod (make setup)")
    return found


def _train_groups(processed: Manifest) -> list[str]:
    """The training row groups as "file#row_group", in petastorm's order (file path order)."""
    return [
        f"{entry.path}#{index}"
        for entry in ProcessedLayout.of(processed).split_entries(processed, "train")
        for index in range(entry.row_groups or 0)
    ]


def row_groups_by_rank(processed: Manifest, num_ranks: int) -> dict[str, list[str]]:
    """Which training row groups each rank reads, every epoch, as "file#row_group".

    petastorm numbers the row groups of the dataset's files in path order and gives group i to
    shard i % num_ranks; the per-epoch shuffle reorders a rank's groups, never the set.
    """
    groups = _train_groups(processed)
    return {str(rank): groups[rank::num_ranks] for rank in range(num_ranks)}


def row_groups_by_epoch(
    processed: Manifest, num_ranks: int, seed: int, epochs: int
) -> dict[str, dict[str, list[str]]]:
    """{epoch (from 1): {rank: row groups in the order the rank read them}}."""
    from training.input import describe_orders

    groups = _train_groups(processed)
    orders = describe_orders(len(groups), num_ranks, seed, range(epochs))
    return {
        epoch: {rank: [groups[i] for i in order] for rank, order in by_rank.items()}
        for epoch, by_rank in orders.items()
    }


def _split_location(catalog: Catalog, manifest: Manifest, split: str) -> str | None:
    """Where the ranks read ``split`` of ``manifest``: a local folder, or a URL under an
    object-store catalog (each rank reads its own row groups from the store); None when the
    version has no such split."""
    layout = ProcessedLayout.of(manifest)
    if split not in layout.splits or not layout.split_entries(manifest, split):
        return None
    return catalog.split_url(manifest, split)


def _split_files(catalog: Catalog, manifest: Manifest) -> dict[str, list[str]] | None:
    """Each split's files' URLs, in path order, where the catalog keeps no folder of them (an
    object store holding a version's files as content-addressed objects); else None."""
    if catalog.is_local or manifest.format_version == 1:
        return None
    layout = ProcessedLayout.of(manifest)
    entries = {split: layout.split_entries(manifest, split) for split in layout.splits}
    return {
        split: [catalog.file_url(manifest, entry) for entry in found]
        for split, found in entries.items()
        if found
    }


def train(
    catalog: Catalog,
    dataset: str,
    *,
    config: TrainConfig,
    launch: LaunchConfig,
    runs_dir: Path,
    progress: Progress = lambda _msg: None,
) -> tuple[Manifest, dict[str, Any]]:
    """Train on the latest processed version of ``dataset`` as ``launch`` says; returns (model
    version, metrics).

    ``config.model`` must name a model: the caller resolves None (the dataset's default model)
    first. The same processed version, configuration and code give the same model version,
    wherever and however it runs: a rerun returns the committed one without training again.
    """
    from training.input import InputSpec
    from training.verify_input import verify_input

    if config.model is None:
        # The caller knows the dataset registry and resolves None to the dataset's default.
        raise ValueError("TrainConfig.model is None: resolve the dataset's default model first")
    check_launch(config, launch)
    processed = catalog.get(processed_name(dataset))
    # Before anything is planned from the manifest, launched or written: the ranks would read
    # whatever bytes are there, and the manifest's counts plan their steps.
    layout = verify_input(catalog, processed, progress).layout
    spec = InputSpec.of(layout)
    try:
        models.check(config.model, spec.kind)
    except ValueError as exc:
        raise ShardflowError(f"{dataset}: {exc}") from exc
    try:
        steps = plan_steps(group_rows(layout.train, processed), config.num_ranks, config.batch_size)
    except ValueError as exc:
        raise ShardflowError(str(exc)) from exc
    name = model_name(dataset, config.model)
    parameters = config.parameters()
    parents = [processed.ref]
    version = derived_version(
        name=name, kind="model", parents=parents, parameters=parameters, code=model_code()
    )
    if catalog.exists(name, version):
        progress(f"{name}@{version} already in the catalog; not training again")
        manifest = catalog.get(name, version)
        return manifest, dict(manifest.statistics)

    remote = check_hosts(launch, config.num_ranks)
    if remote:
        progress(f"hosts {', '.join(remote)}: reachable by ssh, same code")
    run_dir = runs_dir / f"{name}-{version}"
    # One run per run folder at a time: a second run of the same model version waits, then
    # finds it committed (or, after a failed first run, trains in the folder it left).
    with _one_run_at_a_time(runs_dir, run_dir, progress):
        if catalog.exists(name, version):
            progress(f"{name}@{version} was committed by the run we waited for")
            manifest = catalog.get(name, version)
            return manifest, dict(manifest.statistics)
        return _train_in(
            catalog,
            run_dir,
            config=config,
            launch=launch,
            processed=processed,
            layout=layout,
            steps=steps,
            name=name,
            parents=parents,
            progress=progress,
        )


RUN_LOCKS = ".locks"
"""Under the runs folder: ``<run folder name>.lock``, flock held by the live run of it; the
file (and the folder, when empty) goes when the run ends, so that ``runs/`` holds run folders
only."""


@contextlib.contextmanager
def _one_run_at_a_time(runs_dir: Path, run_dir: Path, progress: Progress) -> Iterator[None]:
    """Hold the run folder's lock for the block; wait (saying so) while another run holds it.
    The lock file lives beside the run folders, never in one: a run clears its folder."""
    locks = runs_dir / RUN_LOCKS
    path = locks / f"{run_dir.name}.lock"
    waiting = f"waiting for another run training in {run_dir} to finish"
    lock = _locked(path, lambda: progress(waiting))
    try:
        yield
    finally:
        # Removed while still held: a run waiting on this file finds, once it has the lock,
        # that the name now leads elsewhere (or nowhere) and takes the lock again by name.
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            locks.rmdir()  # only when empty: another run's lock keeps it
        lock.close()


def _locked(path: Path, on_wait: Callable[[], None]) -> IO[str]:
    """``path`` opened and flock-ed, its name still leading to the locked file."""
    import fcntl

    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path, "a+")  # noqa: SIM115  # held past this function
        except FileNotFoundError:
            continue  # the folder went between the two calls: an ending run emptied it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()


def _train_in(
    catalog: Catalog,
    run_dir: Path,
    *,
    config: TrainConfig,
    launch: LaunchConfig,
    processed: Manifest,
    layout: ProcessedLayout,
    steps: int,
    name: str,
    parents: list[ParentRef],
    progress: Progress,
) -> tuple[Manifest, dict[str, Any]]:
    """Launch the ranks in ``run_dir`` (holding its lock) and commit the model they wrote."""
    from training.input import InputSpec

    spec = InputSpec.of(layout)
    runs_dir = run_dir.parent
    parameters = config.parameters()
    train_url = str(as_url(_split_location(catalog, processed, "train") or ""))
    _prepare_run_dir(runs_dir, name, run_dir, config, launch, train_url, progress)
    worker_config = WorkerConfig(
        train=config,
        launch=launch,
        train_url=train_url,
        test_dir=_split_location(catalog, processed, "test") or "",
        validation_dir=_split_location(catalog, processed, "validation"),
        files=_split_files(catalog, processed),
        run_dir=str(run_dir),
        spec=asdict(spec),
        mean=list(layout.normalization.mean),
        std=list(layout.normalization.std),
        num_classes=layout.num_classes,
        steps_per_epoch=steps,
    )
    worker_config.dump(run_dir / "worker.json")
    progress(
        f"train: {config.num_ranks} ranks x {steps} steps x {config.batch_size} per batch, "
        f"{config.epochs} epochs, on {processed.name}@{processed.version}"
    )
    new_since = processed.extra.get("run", {}).get("new_since")
    if new_since is not None:
        progress(
            f"train: {processed.ref} grew from {new_since['base']}: {len(new_since['new'])} "
            f"parts new, {new_since['reused']} reused"
        )
    # A resumed run's folder may hold the report of an earlier run that diverged.
    (run_dir / DIVERGED_NAME).unlink(missing_ok=True)
    with _run_dir_kept_only_with_checkpoints(run_dir):
        run_ranks(config, launch, run_dir, progress)
        _refuse_diverged(run_dir / DIVERGED_NAME)
    metrics = json.loads((run_dir / "metrics.json").read_text())

    with catalog.stage(name, kind="model") as stage:
        shutil.copy2(run_dir / "model.keras", stage.path / "model.keras")
        shutil.copy2(run_dir / "metrics.json", stage.path / "metrics.json")
        shutil.copy2(run_dir / "curves.png", stage.path / "curves.png")
        manifest = stage.commit(
            code_version=model_code(),
            parents=parents,
            parameters=parameters,
            schema={
                "format": "keras",
                "model": config.model,
                "input_kind": spec.kind,
                "input_shape": list(spec.input_shape),
                "feature_columns": spec.feature_columns,
                "num_classes": worker_config.num_classes,
            },
            statistics=metrics,
            rows=layout.train.rows,
            extra={
                "run_dir": str(run_dir),
                # The same set every epoch; the order each rank read them in, per epoch, is a
                # pure function of (seed, epoch, ranks): training.input.row_group_order.
                "row_groups_by_rank": row_groups_by_rank(processed, config.num_ranks),
                "row_groups_by_epoch": row_groups_by_epoch(
                    processed, config.num_ranks, config.seed, config.epochs
                ),
                "steps_per_epoch": steps,
                # What of the processed version is new since the one it grew from.
                **({"input_new_since": new_since} if new_since is not None else {}),
            },
        )
    return manifest, metrics


def _prepare_run_dir(
    runs_dir: Path,
    name: str,
    run_dir: Path,
    config: TrainConfig,
    launch: LaunchConfig,
    train_url: str,
    progress: Progress,
) -> None:
    """An empty ``run_dir`` for model ``name``; with ``launch.resume``, the one holding the
    checkpoints to resume from, else one made for it from a step checkpoint of a run of the
    same configuration on another rank count (in ``runs_dir``)."""
    if launch.resume:
        if not (run_dir / "checkpoints").is_dir():
            other = _step_checkpoint_of_other_rank_count(runs_dir, name, config, train_url)
            if other is None:
                raise ShardflowError(
                    f"nothing to resume: no checkpoints of this configuration in {run_dir}"
                )
            (run_dir / "checkpoints").mkdir(parents=True)
            shutil.copy2(other, run_dir / "checkpoints" / STEP_CHECKPOINT)
            progress(
                f"resume: no checkpoint of {config.num_ranks} ranks; continuing from {other}, "
                "a run of the same configuration on another rank count"
            )
    elif run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def _step_checkpoint_of_other_rank_count(
    runs_dir: Path, name: str, config: TrainConfig, train_url: str
) -> Path | None:
    """The newest step checkpoint of a run of ``config`` on another number of ranks (the same
    parameters but ``num_ranks``, the same training split), or None."""
    found = []
    for worker_json in runs_dir.glob(f"{name}-*/worker.json"):
        step_file = worker_json.parent / "checkpoints" / STEP_CHECKPOINT
        if not step_file.is_file():
            continue
        other = WorkerConfig.load(worker_json)
        same = replace(other.train, num_ranks=config.num_ranks).parameters()
        moved = other.train.num_ranks != config.num_ranks
        # The split by catalog name, version and split (a catalog copied elsewhere is the same).
        same_split = other.train_url.split("/")[-3:] == train_url.split("/")[-3:]
        if moved and same == config.parameters() and same_split:
            found.append(step_file)
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def _refuse_diverged(report: Path) -> None:
    """A one-line ShardflowError when the ranks stopped because training diverged (rank 0
    wrote ``report`` instead of a model: training.rank.divergence.DivergenceGuard)."""
    if not report.is_file():
        return
    where = json.loads(report.read_text())
    raise ShardflowError(
        f"training diverged at epoch {where['epoch']} step {where['step']} "
        f"({where['reason']}): nothing committed; lower the learning rate (--lr)"
    )


@contextlib.contextmanager
def _run_dir_kept_only_with_checkpoints(run_dir: Path) -> Iterator[None]:
    """Remove ``run_dir`` when the block fails before any checkpoint was written there (a
    failed launch leaves nothing to ``--resume`` from, only a folder); keep it when it holds a
    checkpoint."""
    try:
        yield
    except BaseException:
        checkpoints = run_dir / "checkpoints"
        if (
            last_checkpoint(checkpoints)[1] is None
            and not (checkpoints / STEP_CHECKPOINT).is_file()
        ):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def horovodrun_command(
    config: TrainConfig,
    launch: LaunchConfig,
    run_dir: Path,
    *,
    horovodrun: str = "horovodrun",
    python: str = sys.executable,
) -> list[str]:
    """The command line that starts ``config.num_ranks`` ranks of ``python -m training.worker``
    on the worker config in ``run_dir``: where they run, which controller, the timeline."""
    command = [horovodrun, "-np", str(config.num_ranks)]
    if launch.launcher == "slurm":
        from training.slurm import horovodrun_hosts

        command += ["-H", horovodrun_hosts(config.num_ranks, os.environ)]
    elif launch.hostfile:
        command += ["--hostfile", launch.hostfile]
    else:
        command += ["-H", launch.hosts or f"localhost:{config.num_ranks}"]
    if launch.network_interface:
        command += ["--network-interface", launch.network_interface]
    if launch.ssh_port is not None:
        command += ["--ssh-port", str(launch.ssh_port)]
    if launch.ssh_identity_file:
        command += ["--ssh-identity-file", launch.ssh_identity_file]
    if launch.disable_cache:
        command.append("--disable-cache")
    command.append("--mpi" if launch.controller == "mpi" else "--gloo")
    if launch.timeline:
        command += ["--timeline-filename", str(run_dir / "timeline.json")]
    return [*command, python, "-m", "training.worker", str(run_dir / "worker.json")]


# How long horovodrun may take to stop its ranks once asked: its middlemen give each rank 5 s
# after SIGTERM before SIGKILL (horovod/runner/common/util/safe_shell_exec.py).
STOP_SECONDS = 15.0


def run_ranks(config: TrainConfig, launch: LaunchConfig, run_dir: Path, progress: Progress) -> None:
    """Run `horovodrun` on the worker config in ``run_dir``; raises ShardflowError on failure.

    horovodrun runs through :mod:`training.horovodrun` (it dies with this process; its
    rendezvous server binds loopback for local runs) in a session of its own, so that a
    Ctrl-C in the terminal reaches only this process, which then stops it (:func:`_stop`)
    before the interruption goes on.
    """
    command = _rank_launch_command(config, launch, run_dir)
    runner = "Horovod's Spark runner" if launch.launcher == "spark" else "horovodrun"
    progress("$ " + " ".join(command))
    tail: deque[str] = deque(maxlen=200)
    with (
        # Secrets reach the ranks in a file of the run folder, never on a command line.
        credentials.credentials_file(run_dir, os.environ) as secrets_file,
        subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                **secrets_file,
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONUNBUFFERED": "1",
            },
            start_new_session=True,
        ) as proc,
    ):
        assert proc.stdout is not None
        stopped: list[int] | None = None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                tail.append(line)
                progress(line)
                if stopped is None and _GLOO_TIMEOUT.search(line):
                    # A rank gave up waiting for a peer: look for one stopped on this host
                    # now, before horovodrun ends them all.
                    stopped = _stopped_ranks(proc.pid)
            returncode = proc.wait()
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM, a Prefect crash): no rank outlives this call.
            _stop(proc)
            raise
    if returncode != 0:
        raise ShardflowError(_failure_message(returncode, list(tail), stopped or [], runner))


def _rank_launch_command(config: TrainConfig, launch: LaunchConfig, run_dir: Path) -> list[str]:
    """What starts the ranks and dies with this process: horovodrun through
    :mod:`training.horovodrun`, or Horovod's Spark runner through :mod:`training.spark`."""
    if launch.launcher == "spark":
        from training import spark

        spark.find_java()
        master = launch.spark_master or f"local[{config.num_ranks}]"
        spark.check_master(master)
        return spark.spark_command(
            master, config.num_ranks, run_dir / "worker.json", parent=os.getpid()
        )
    if launch.controller == "mpi":
        require_mpi()
    find_horovodrun()  # Horovod is installed
    return [
        *(sys.executable, "-m", "training.horovodrun", "--parent", str(os.getpid())),
        *horovodrun_command(config, launch, run_dir)[1:],
    ]


# Gloo's words when a collective waited for a peer longer than HOROVOD_GLOO_TIMEOUT_SECONDS.
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")


def _stopped_ranks(horovodrun: int) -> list[int]:
    """The ranks under ``horovodrun`` (on this host) that are stopped (SIGSTOP, a debugger)."""
    import psutil

    found = []
    try:
        children = psutil.Process(horovodrun).children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            if child.status() != psutil.STATUS_STOPPED or "training.worker" not in child.cmdline():
                continue
            found.append(int(child.environ().get("HOROVOD_RANK", "-1")))
        except (psutil.Error, ValueError):
            continue
    return sorted(r for r in found if r >= 0)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop horovodrun and its ranks: SIGTERM, which its own handler turns into stopping every
    rank; SIGKILL to its process group after ``STOP_SECONDS`` (the ranks' middlemen, in
    sessions of their own, then stop their ranks when horovodrun's end of their pipe closes)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        # Reading on, so that horovodrun never blocks on a full pipe while it stops.
        proc.communicate(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def require_mpi() -> None:
    """Refuse the MPI controller unless this Horovod was built with it."""
    import horovod.tensorflow as hvd

    if not hvd.mpi_built():
        raise ShardflowError(
            "this Horovod was built without MPI; use --controller gloo, or install an MPI "
            "(e.g. apt-get install libopenmpi-dev) and rebuild Horovod with HOROVOD_WITH_MPI=1"
        )


def _failure_message(
    returncode: int, tail: list[str], stopped: list[int], runner: str = "horovodrun"
) -> str:
    """One line saying which rank failed and how, from ``runner``'s last lines; a rank that
    only timed out waiting for a peer is not blamed: the peer (``stopped``, when one on this
    host was found stopped) is."""
    text = "\n".join(tail)
    rank = re.search(r"Process name: (\S+)", text)
    code = re.search(r"Exit code: (-?\d+)", text)
    if rank and code:
        name, exit_code = _first_to_fail(tail, rank.group(1), int(code.group(1)))
        own = _own_lines(tail, name)
        waited = next((m for line in own if (m := _GLOO_TIMEOUT.search(line))), None)
        if waited is not None:
            seconds = int(waited.group(1)) / 1000
            who = (
                f"rank {', '.join(map(str, stopped))} was stopped (SIGSTOP or a debugger) and "
                "stopped answering"
                if stopped
                else "a rank stopped answering (stopped, hung, or cut off from the others)"
            )
            return (
                f"training stopped: {who}; rank {name} gave up waiting for it after "
                f"{seconds:.0f} s (HOROVOD_GLOO_TIMEOUT_SECONDS) and {runner} stopped every "
                "rank; rerun with --resume to continue from the last checkpoint"
            )
        how = f"exit code {exit_code}"
        if exit_code > 128 or exit_code < 0:
            number = exit_code - 128 if exit_code > 128 else -exit_code
            with contextlib.suppress(ValueError):
                how += f" ({signal.Signals(number).name})"
        # The rank's own last error line, when it printed one (a killed rank prints none).
        errors = [m.group(1) for line in own if (m := _ERROR_LINE.search(line))]
        cause = f" ({errors[-1].strip()[:200]})" if errors else ""
        return (
            f"training stopped: rank {name} ended with {how}{cause} and {runner} "
            "stopped the other ranks; rerun with --resume to continue from the last checkpoint"
        )
    if returncode < 0:
        with contextlib.suppress(ValueError):
            killed = signal.Signals(-returncode).name
            return (
                f"{runner} was killed ({killed}) by something other than shardflow, and its "
                "ranks with it; rerun with --resume to continue from the last checkpoint"
            )
    from training.spark import FAILURE_PREFIX

    failed = [line.split(FAILURE_PREFIX, 1)[1] for line in tail if FAILURE_PREFIX in line]
    if failed:
        return f"{runner} failed: {failed[-1].strip()[:300]}"
    errors = [m.group(1) for line in tail if (m := _ERROR_LINE.search(line))]
    last = errors[-1] if errors else (tail[-1] if tail else "no output")
    return f"{runner} exited with {returncode}: {last.strip()[:200]}"


# A Python exception's last line, as a rank prints it: "[0]<stderr>:ValueError: ..." (a
# dotted class name too, "tensorflow....UnknownError: ...").
_ERROR_LINE = re.compile(r"(?:^|:)\s*((?:\w+\.)*\w+(?:Error|Exception|Interrupt): .*)$")


def _own_lines(tail: list[str], rank: str) -> list[str]:
    """What ``rank`` printed, as horovodrun prefixes it: "[1]<stderr>:...". Horovod's Spark
    runner prefixes the Spark task's index instead, the rank on one host: a local master, the
    only one whose ranks print to the runner's output (a cluster's print to executor logs)."""
    return [line for line in tail if line.startswith(f"[{rank}]<")]


# A rank's words when it ended because a peer was gone (killed, or ended by its own error):
# Gloo's, and Horovod's once its background loop has stopped.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|HorovodInternalError"
    r"|Horovod has been shut down"
)
# How a rank ended, from the most to the least to blame (_first_to_fail).
_KILLED, _OWN_ERROR, _STOPPED, _PEER_LOST = range(4)


def _how_it_ended(exit_code: int, own: list[str]) -> int:
    """``_KILLED`` (a signal but SIGTERM or SIGINT, which no runner sends: the rank died on its
    own or something outside killed it), ``_STOPPED`` (SIGTERM or SIGINT: what a runner or a
    user stopping the run sends), ``_PEER_LOST`` (``own`` lines say a peer was gone: Gloo's
    "Connection closed by peer", a HorovodInternalError, a Gloo timeout) or ``_OWN_ERROR`` (its
    own error, or one we cannot see)."""
    number = exit_code - 128 if exit_code > 128 else -exit_code
    if number in (signal.SIGTERM, signal.SIGINT):
        return _STOPPED
    if exit_code > 128 or exit_code < -1:  # -1: Horovod lost the task's answer, not a signal
        return _KILLED
    if any(_PEER_GONE.search(line) or _GLOO_TIMEOUT.search(line) for line in own):
        return _PEER_LOST
    return _OWN_ERROR


def _first_to_fail(tail: list[str], named: str, exit_code: int) -> tuple[str, int]:
    """The rank to blame and its exit code: the runner's choice (``named``, ``exit_code``)
    unless ``tail`` holds every rank's exit code (training.spark prints them) and another rank
    ended in a way more to blame (:func:`_how_it_ended`); among equals, the runner's choice,
    else the first it learned of.

    Horovod's Spark runner names the rank whose exit code it learned first, polling each once a
    second: a rank that only exited because its peer was killed may be named. A rank stopped
    by SIGTERM is blamed only when no rank failed on its own: a runner sends SIGTERM to the
    rest once one has failed.
    """
    from training.spark import RANK_EXIT_PREFIX

    ends = (
        re.match(rf"{re.escape(RANK_EXIT_PREFIX)}(\d+) exit code (-?\d+)$", line) for line in tail
    )
    failed = {m.group(1): int(m.group(2)) for m in ends if m and m.group(2) != "0"}
    if named not in failed:
        return named, exit_code
    how = {rank: _how_it_ended(code, _own_lines(tail, rank)) for rank, code in failed.items()}
    best = min(how.values())
    if how[named] == best:
        return named, exit_code
    first = next(rank for rank in failed if how[rank] == best)
    return first, failed[first]
