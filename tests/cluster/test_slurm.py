"""The SLURM targets on a real single-node SLURM (tests/cluster/slurm.py): `shardflow
preprocess --cluster slurm` runs its Dask workers as SLURM jobs and makes the version a
LocalCluster makes; `shardflow train --launcher slurm` inside `sbatch -n 2` trains on the
allocation's two task slots and commits a model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_catalog import Catalog, Manifest
from tests.cluster import slurm
from tests.cluster.slurm import Slurm

pytestmark = pytest.mark.e2e
slurm_cluster = slurm.slurm_cluster  # the fixture: a single-node SLURM for this module

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PREPROCESS = ("preprocess", "sdss", "--rows-per-group", "500", "--rank-multiple", "2")


def _shardflow(home: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # As from a login shell: no allocation, only the way to the controller.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(BIN / "shardflow"), *args],
        capture_output=True,
        text=True,
        # Each Dask worker job's scratch folder goes under TMPDIR (sbatch exports it).
        env={**env, "SHARDFLOW_HOME": str(home), "TMPDIR": str(home / "tmp")},
        cwd=cwd,
        timeout=600,
    )


def _ok(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from preprocessing.sources.synth import write_sdss_exports

    out = tmp_path_factory.mktemp("exports")
    write_sdss_exports(out, rows=8_000, files=2, fmt="csv", seed=5)
    return out


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, exports: Path) -> Manifest:
    """The processed version a LocalCluster makes."""
    home = tmp_path_factory.mktemp("local-home")
    _ok(_shardflow(home, "ingest", "sdss", "--source", str(exports), "--json"))
    _ok(_shardflow(home, *PREPROCESS, "--workers", "2", "--json"))
    return Catalog(home / "catalog").get("sdss-processed")


@pytest.fixture(scope="module")
def slurm_home(
    tmp_path_factory: pytest.TempPathFactory, slurm_cluster: Slurm, exports: Path
) -> Path:
    """A home whose ingest and preprocess ran on Dask workers in SLURM jobs."""
    home = tmp_path_factory.mktemp("slurm-home")
    (home / "jobs").mkdir()
    _ok(
        _shardflow(home, "ingest", "sdss", "--source", str(exports), "--cluster", "slurm",
                   "--workers", "1", "--memory-limit", "1GiB", "--json", cwd=home / "jobs")
    )  # fmt: skip
    return home


def test_srun_runs_two_tasks(slurm_cluster: Slurm) -> None:
    done = slurm_cluster.run("srun", "-N1", "-n2", "hostname")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [slurm_cluster.hostname] * 2


def test_preprocess_on_slurm_workers_makes_the_local_version(
    slurm_cluster: Slurm, slurm_home: Path, local: Manifest
) -> None:
    jobs_dir = slurm_home / "jobs"
    done = _shardflow(
        slurm_home, *PREPROCESS, "--cluster", "slurm", "--workers", "2", "--memory-limit",
        "1GiB", "--slurm-partition", "debug", "--slurm-walltime", "00:10:00", "--json",
        "--verbose", cwd=jobs_dir,
    )  # fmt: skip
    result = _ok(done)
    made = Catalog(slurm_home / "catalog").get("sdss-processed")
    assert result["version"] == local.version
    assert made.content_digest() == local.content_digest()
    assert [(f.path, f.sha256) for f in made.files] == [(f.path, f.sha256) for f in local.files]

    # The workers were SLURM jobs: named so in SLURM's record, their output (sbatch's
    # slurm-JOBID.out, in the folder the command ran in) shows a Dask worker that joined
    # this command's scheduler, and none is left queued.
    scheduler = re.search(r"scheduler (tcp://[\d.]+:\d+)", done.stderr)
    assert scheduler is not None, done.stderr[-3000:]
    worker_jobs = [job for job in slurm_cluster.finished_jobs() if job["Name"] == "shardflow-dask"]
    registered = re.compile(rf"Registered to:\s+{re.escape(scheduler.group(1))}\n")
    joined = [
        job["JobId"]
        for job in worker_jobs
        if (jobs_dir / f"slurm-{job['JobId']}.out").exists()
        and registered.search((jobs_dir / f"slurm-{job['JobId']}.out").read_text())
    ]
    assert len(joined) == 2, (worker_jobs, sorted(p.name for p in jobs_dir.iterdir()))
    assert all(job["NodeList"] == slurm_cluster.hostname for job in worker_jobs)
    # Those were the scheduler's only workers, and they ran every task.
    assert result["resources"]["workers"] == 2, result  # type: ignore[index]
    assert slurm_cluster.queued_jobs() == []
    # Each job had its own scratch folder, under the TMPDIR sbatch handed it, gone with the job.
    for job_id in joined:
        output = (jobs_dir / f"slurm-{job_id}.out").read_text()
        assert f"Local Directory: {slurm_home / 'tmp' / f'shardflow-dask-{job_id}'}/" in output
    assert list((slurm_home / "tmp").glob("shardflow-dask-*")) == []


def test_a_partition_sbatch_refuses_is_one_line(slurm_cluster: Slurm, slurm_home: Path) -> None:
    # Other row groups than the committed version's: a version to make, not to reuse.
    done = _shardflow(
        slurm_home, "preprocess", "sdss", "--rows-per-group", "250", "--cluster", "slurm",
        "--slurm-partition", "nosuch", cwd=slurm_home / "jobs",
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "sbatch refuses the Dask worker job" in lines[0]
    assert "invalid partition" in lines[0].lower(), lines[0]


def _finished(slurm_cluster: Slurm, job_id: str) -> dict[str, str] | None:
    """The jobcomp record of job ``job_id`` once it has ended."""
    return next((job for job in slurm_cluster.finished_jobs() if job["JobId"] == job_id), None)


def test_the_pipeline_batch_script_runs_every_stage(
    slurm_cluster: Slurm, exports: Path, tmp_path: Path
) -> None:
    """deploy/slurm/pipeline.sbatch as a user submits it: ingest and preprocess on the
    allocation, then `train --launcher slurm` without --np: horovodrun -np 2 on the
    allocation's host (its two task slots), and a model committed."""
    home = tmp_path / "home"
    done = slurm_cluster.run(
        "sbatch", "--parsable", str(ROOT / "deploy" / "slurm" / "pipeline.sbatch"),
        env={**slurm_cluster.env, "SHARDFLOW_HOME": str(home), "DATASET": "sdss",
             "SOURCE": str(exports), "EPOCHS": "1", "SHARDFLOW": str(BIN / "shardflow")},
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    # Not `sbatch --wait`: it looks at the job 2, 10, 42, 74 s after submitting (its sleep grows
    # fourfold up to 32 s while below MinJobAge / 2, src/sbatch/sbatch.c _job_wait), so a job
    # done in 20 s was seen done at 42 s. Its jobcomp record is looked for every 0.5 s instead;
    # JobState COMPLETED is what --wait's exit 0 said (a non-zero exit is FAILED).
    deadline = time.monotonic() + 600
    while (record := _finished(slurm_cluster, job_id)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    output_file = tmp_path / f"shardflow-pipeline-{job_id}.out"
    output = output_file.read_text() if job_id and output_file.exists() else ""
    assert record is not None, ("not finished within 600 s", output[-3000:])
    assert record["JobState"] == "COMPLETED", (record, output[-3000:])
    assert f"-np 2 -H {slurm_cluster.hostname}:2" in output, output[-3000:]
    catalog = Catalog(home / "catalog")
    model = catalog.get("sdss-dnn")
    assert model.statistics["num_ranks"] == 2
    assert list(model.parents) == [catalog.get("sdss-processed").ref]
    assert (record["Name"], record["JobState"], record["ProcCnt"]) == (
        "shardflow-pipeline",
        "COMPLETED",
        "2",
    )


def test_no_worker_job_starting_is_one_line_and_cancels_the_jobs(
    slurm_cluster: Slurm, slurm_home: Path
) -> None:
    # Both CPUs taken by another job: the worker job stays pending.
    blocker = slurm_cluster.run(
        "sbatch", "--parsable", "-n", "2", "--wrap", "sleep 300", cwd=slurm_home / "jobs"
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip().split(";")[0]
    try:
        done = _shardflow(
            slurm_home, "preprocess", "sdss", "--rows-per-group", "200", "--cluster", "slurm",
            "--workers", "1", "--slurm-start-timeout", "5", cwd=slurm_home / "jobs",
        )  # fmt: skip
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert re.search(r"no SLURM job started a worker within 5 s: check `squeue -j \d+`$",
                         lines[0]), lines[0]  # fmt: skip
        assert slurm_cluster.queued_jobs() == [blocker_id]  # its own job was cancelled
    finally:
        slurm_cluster.run("scancel", blocker_id)
