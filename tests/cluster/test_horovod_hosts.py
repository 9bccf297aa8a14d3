"""`shardflow train --hosts` across real hosts: horovodrun in one namespace reaches two others
by ssh (a real sshd in each), one rank per host, talking over their eth0. The same model
version and the same weights, byte for byte, as `--np 2` on localhost; a host that cannot be
reached is refused in one line before any rank starts."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog
from lab.netns import Host, Hosts, Ssh, start_sshd

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SSH_PORT = 2222  # not 22: the test passes --ssh-port through to horovodrun
TRAIN = ("train", "sdss", "--np", "2", "--epochs", "1", "--batch-size", "64", "--seed", "3")


def _shardflow(
    home: Path, host: Host, *args: str, path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHARDFLOW_HOME": str(home)}
    if path is not None:
        env["PATH"] = f"{path}:{env['PATH']}"
    return subprocess.run(
        host.command([str(BIN / "shardflow"), *args]),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )


@pytest.fixture(scope="module")
def processed_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home holding a small processed SDSS version (made on this host, no namespace)."""
    from preprocessing.sources.synth import write_sdss_exports

    root = tmp_path_factory.mktemp("hosts-train")
    write_sdss_exports(root / "exports", rows=16_000, files=2, fmt="csv", seed=11)
    env = {**os.environ, "SHARDFLOW_HOME": str(root / "home")}
    for args in (
        ["ingest", "sdss", "--source", str(root / "exports")],
        ["preprocess", "sdss", "--rows-per-group", "500", "--rank-multiple", "2"],
    ):
        done = subprocess.run(
            [str(BIN / "shardflow"), *args], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
    return root / "home"


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    with Hosts(["head", "w1", "w2"]) as made:
        yield made


def _ssh(hosts: Hosts, tmp_path: Path, names: tuple[str, ...] = ("w1", "w2")) -> Ssh:
    ssh = start_sshd([hosts[n] for n in names], tmp_path / "ssh", port=SSH_PORT)
    for name in names:
        hosts.wait_for_port(hosts["head"], hosts[name], SSH_PORT)
    return ssh


def _remote_flags(ssh: Ssh) -> tuple[str, ...]:
    return ("--network-interface", "eth0", "--ssh-port", str(ssh.port),
            "--ssh-identity-file", str(ssh.identity), "--disable-cache")  # fmt: skip


def _weights(home: Path, version: str) -> dict[str, Any]:
    """The model's weight arrays by name (model.keras is a zip whose entries carry the time
    they were written: its bytes differ between equal models)."""
    import h5py

    catalog = Catalog(home / "catalog")
    manifest = catalog.get("sdss-dnn", version)
    keras = catalog.file_path(manifest, next(f for f in manifest.files if f.path == "model.keras"))
    arrays: dict[str, Any] = {}
    with zipfile.ZipFile(keras) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")

    def keep(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            arrays[name] = item[()]

    with weights:
        weights.visititems(keep)
    return arrays


def test_two_hosts_train_what_localhost_trains(
    hosts: Hosts, tmp_path: Path, processed_home: Path
) -> None:
    ssh = _ssh(hosts, tmp_path)
    local_home, remote_home = tmp_path / "local", tmp_path / "remote"
    shutil.copytree(processed_home, local_home)
    shutil.copytree(processed_home, remote_home)

    local = _shardflow(local_home, hosts["head"], *TRAIN, "--json")
    assert local.returncode == 0, local.stderr[-3000:]

    sent_before = {n: hosts[n].bytes_sent() for n in ("w1", "w2")}
    remote = _shardflow(
        remote_home, hosts["head"], *TRAIN, "--hosts", "w1:1,w2:1", *_remote_flags(ssh),
        "--json", path=ssh.bin,
    )  # fmt: skip
    assert remote.returncode == 0, remote.stderr[-3000:]
    sent = {n: hosts[n].bytes_sent() - sent_before[n] for n in ("w1", "w2")}

    local_version = json.loads(local.stdout.strip().splitlines()[-1])["version"]
    remote_version = json.loads(remote.stdout.strip().splitlines()[-1])["version"]
    assert remote_version == local_version
    local_weights = _weights(local_home, local_version)
    remote_weights = _weights(remote_home, remote_version)
    assert sorted(remote_weights) == sorted(local_weights) and local_weights
    for name, array in local_weights.items():
        assert np.array_equal(remote_weights[name], array), name
    # Each rank ran on its own host and sent its gradients over its link (the model has
    # about 10 k parameters: at least tens of kB per epoch; ssh alone sends a few kB).
    assert sent["w1"] > 100_000 and sent["w2"] > 100_000, sent
    # The figure for the closing note (pytest -s): ring allreduce sends 2(N-1)/N of the
    # gradient bytes per step from each rank, plus Horovod's control loop and ssh.
    metrics = json.loads(remote.stdout.strip().splitlines()[-1])
    predicted = metrics.get("allreduce_bytes_per_epoch")
    print(f"\nbytes sent per host {sent}, ring prediction per rank {predicted}")


def test_an_unreachable_host_is_refused_before_any_rank(
    hosts: Hosts, tmp_path: Path, processed_home: Path
) -> None:
    ssh = _ssh(hosts, tmp_path, names=("w1",))  # w2 runs no sshd
    home = tmp_path / "home"
    shutil.copytree(processed_home, home)
    refused = _shardflow(
        home, hosts["head"], *TRAIN, "--hosts", "w1:1,w2:1", *_remote_flags(ssh), path=ssh.bin
    )
    assert refused.returncode == 1, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "cannot reach host w2 by ssh (port 2222)" in lines[0]
    assert Catalog(home / "catalog").names() == ["sdss", "sdss-processed"]
    assert not list((home / "runs").glob("*")) if (home / "runs").exists() else True
