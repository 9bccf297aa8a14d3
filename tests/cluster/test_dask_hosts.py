"""`shardflow preprocess --scheduler` on a Dask cluster of real hosts: a `dask scheduler` in one
namespace, a `dask worker` in each of two others, the command in a fourth. The same processed
version, file for file, as on a LocalCluster; both workers work; a worker killed mid-run
changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_catalog import Catalog, Manifest
from lab.netns import Host, Hosts

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
PORT = 8786


def _shardflow(home: Path, *args: str, host: Host | None = None) -> dict[str, object]:
    command = [str(BIN / "shardflow"), *args, "--json"]
    env = {**os.environ, "SHARDFLOW_HOME": str(home)}
    if host is not None:
        command = host.command(command)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from preprocessing.sources.synth import write_sdss_exports

    out = tmp_path_factory.mktemp("exports")
    write_sdss_exports(out, rows=40_000, files=4, fmt="csv", seed=5)
    return out


def _home(root: Path, exports: Path) -> Path:
    """A home holding the raw version of ``exports`` (the same version in every home)."""
    _shardflow(root, "ingest", "sdss", "--source", str(exports))
    return root


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, exports: Path) -> Manifest:
    """The processed version a LocalCluster makes."""
    home = _home(tmp_path_factory.mktemp("local-home"), exports)
    _shardflow(home, "preprocess", "sdss", "--rows-per-group", "500", "--rank-multiple", "8")
    return Catalog(home / "catalog").get("sdss-processed")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Hosts]:
    """`dask scheduler` in sched; `dask worker` (with a nanny) in w1 and w2; head for clients."""
    with Hosts(["sched", "w1", "w2", "head"]) as hosts:
        sched = hosts["sched"]
        sched.popen(
            [str(BIN / "dask"), "scheduler", "--host", sched.address, "--port", str(PORT),
             "--no-dashboard"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        hosts.wait_for_port(hosts["head"], sched, PORT)
        yield hosts


def _start_worker(hosts: Hosts, name: str, scratch: Path, **env: str) -> None:
    host = hosts[name]
    host.popen(
        [str(BIN / "dask"), "worker", f"tcp://{hosts['sched'].address}:{PORT}",
         "--host", host.address, "--nworkers", "1", "--nthreads", "1", "--no-dashboard",
         "--local-directory", str(scratch / name), "--name", name],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait_for_workers(hosts: Hosts, count: int) -> None:
    probe = (
        "from distributed import Client; import sys; "
        f"c = Client('tcp://{hosts['sched'].address}:{PORT}', timeout=30); "
        f"c.wait_for_workers({count}, timeout=120); print(len(c.scheduler_info()['workers']))"
    )
    done = hosts["head"].run([sys.executable, "-c", probe], timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]


def _executed(hosts: Hosts) -> dict[str, int]:
    """Tasks each worker ran, by its name, asked from the head host."""
    probe = (
        "from distributed import Client; import json; "
        f"c = Client('tcp://{hosts['sched'].address}:{PORT}', timeout=30); "
        "counts = c.run(lambda dask_worker: (dask_worker.name, "
        "dask_worker.state.executed_count)); print(json.dumps(dict(counts.values())))"
    )
    done = hosts["head"].run([sys.executable, "-c", probe], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    counts: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return counts


def _files(manifest: Manifest) -> list[tuple[str, str]]:
    return [(f.path, f.sha256) for f in manifest.files]


def test_two_hosts_make_what_a_local_cluster_makes(
    cluster: Hosts, tmp_path: Path, exports: Path, local: Manifest
) -> None:
    for name in ("w1", "w2"):
        _start_worker(cluster, name, tmp_path)
    _wait_for_workers(cluster, 2)
    home = _home(tmp_path / "home", exports)
    result = _shardflow(
        home,
        "preprocess", "sdss", "--rows-per-group", "500", "--rank-multiple", "8",
        "--scheduler", f"tcp://{cluster['sched'].address}:{PORT}",
        host=cluster["head"],
    )  # fmt: skip
    made = Catalog(home / "catalog").get("sdss-processed")
    assert result["version"] == local.version
    assert made.content_digest() == local.content_digest()
    assert _files(made) == _files(local)
    executed = _executed(cluster)
    assert executed["w1"] > 0 and executed["w2"] > 0, executed


def test_a_worker_killed_mid_run_changes_nothing(
    cluster: Hosts, tmp_path: Path, exports: Path, local: Manifest
) -> None:
    # w2's worker process dies by SIGKILL right after writing its 3rd file; its nanny starts
    # another, and the scheduler runs the lost task again (it finds the file whole).
    _start_worker(cluster, "w1", tmp_path)
    _start_worker(cluster, "w2", tmp_path, SHARDFLOW_CRASH_AT="after-shard:3")
    _wait_for_workers(cluster, 2)
    home = _home(tmp_path / "home", exports)
    _shardflow(
        home,
        "preprocess", "sdss", "--rows-per-group", "500", "--rank-multiple", "8",
        "--scheduler", f"tcp://{cluster['sched'].address}:{PORT}",
        host=cluster["head"],
    )  # fmt: skip
    made = Catalog(home / "catalog").get("sdss-processed")
    assert made.content_digest() == local.content_digest()


def test_a_worker_running_other_code_is_refused(
    cluster: Hosts, tmp_path: Path, exports: Path
) -> None:
    """A worker started from a checkout whose SDSS feature code differs (a clone with one
    more commit changing preprocessing/sdss.py) gets no task: the command names the stage
    and both codes. (A commit of docs or training/ alone would change no stage's code.)"""
    repo = Path(__file__).resolve().parents[2]
    other = tmp_path / "other-checkout"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(repo), str(other)], check=True)
    module = other / "preprocessing" / "sdss.py"
    module.write_text(module.read_text() + "\n# another version of the feature code\n")
    subprocess.run(
        ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t",
         "commit", "--quiet", "-am", "another version"],
        check=True,
    )  # fmt: skip
    _start_worker(cluster, "w1", tmp_path, PYTHONPATH=str(other))
    _wait_for_workers(cluster, 1)
    home = _home(tmp_path / "home", exports)
    command = cluster["head"].command(
        [str(BIN / "shardflow"), "preprocess", "sdss", "--scheduler",
         f"tcp://{cluster['sched'].address}:{PORT}"]
    )  # fmt: skip
    refused = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "SHARDFLOW_HOME": str(home)},
        timeout=600,
    )
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    other_version = subprocess.run(
        [sys.executable, "-c",
         "from preprocessing.fingerprint import stage_code; "
         "print(stage_code('preprocessing.sdss'))"],
        capture_output=True, text=True, cwd=other, env={**os.environ, "PYTHONPATH": str(other)},
    ).stdout.strip()  # fmt: skip
    assert f"runs other code for preprocessing.sdss ({other_version})" in lines[0]
    assert Catalog(home / "catalog").names() == ["sdss"]  # nothing processed
