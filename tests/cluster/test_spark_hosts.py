"""`shardflow train --launcher spark` on a real Spark standalone cluster across hosts: a master
in one network namespace, a worker (1 core) in each of two others, the launcher in a fourth.
Each rank runs in a Spark executor on its own worker host and the ranks talk over eth0; the
model version is the one `local[2]` commits for the same configuration."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.netns import Host, Hosts
from tests.conftest import copy_home

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(__import__("pyspark").__file__).parent
MASTER_PORT = 7077
TRAIN = ("train", "fashion-mnist", "--launcher", "spark", "--np", "2", "--epochs", "2")


def _spark_env(host: Host, work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": host.address,
        "SPARK_LOG_DIR": str(work),
        "PYSPARK_PYTHON": sys.executable,
    }


@pytest.fixture(scope="module")
def processed_home(fashion_processed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Fashion-MNIST subset ingested and preprocessed (the session's, copied)."""
    return copy_home(fashion_processed, tmp_path_factory.mktemp("spark-hosts") / "home")


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[Hosts]:
    """A master on "master", a 1-core worker on each of "w1" and "w2"; "head" is the launcher's."""
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    with Hosts(["master", "w1", "w2", "head"]) as hosts:
        master = hosts["master"]
        log = (tmp_path / "master.log").open("w")
        master.popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", master.address,
             "--port", str(MASTER_PORT), "--webui-port", "18080"],
            env=_spark_env(master, tmp_path), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        hosts.wait_for_port(hosts["head"], master, MASTER_PORT, timeout=120)
        for name in ("w1", "w2"):
            worker = hosts[name]
            work = tmp_path / name
            work.mkdir()
            worker.popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker",
                 f"spark://{master.address}:{MASTER_PORT}", "--host", worker.address,
                 "--cores", "1", "--memory", "4g", "--webui-port", "18081",
                 "--work-dir", str(work)],
                env=_spark_env(worker, work), stdout=(work / "worker.log").open("w"),
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        yield hosts


def test_two_ranks_on_two_spark_workers_train_the_same_model_version(
    spark_cluster: Hosts, processed_home: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(processed_home, home)
    head, master = spark_cluster["head"], spark_cluster["master"]
    env = {**os.environ, "SHARDFLOW_HOME": str(home), "SPARK_LOCAL_IP": head.address}
    trained = subprocess.run(
        head.command(
            [str(BIN / "shardflow"), *TRAIN, "--spark-master",
             f"spark://{master.address}:{MASTER_PORT}", "--json"]
        ),
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = json.loads(trained.stdout.strip().splitlines()[-1])
    # The ranks talked over the worker hosts' links: each sent at least an epoch's allreduce
    # (seen: 56 and 54 MB for 26 MB an epoch), the launcher's host next to nothing.
    for name in ("w1", "w2"):
        assert spark_cluster[name].bytes_sent() >= result["allreduce_bytes_per_epoch"]
    assert result["num_ranks"] == 2
    assert result["test_accuracy"] >= 0.6
    # One executor on each worker host, each running one rank.
    for name in ("w1", "w2"):
        assert list((tmp_path / name).glob("app-*/*/stderr")), f"no executor on {name}"
    # The same configuration on local[2] is the same model version (where it ran is no part
    # of the identity): it is found committed, not trained again.
    again = subprocess.run(
        [str(BIN / "shardflow"), *TRAIN, "--spark-master", "local[2]", "--json"],
        capture_output=True, text=True, env={**os.environ, "SHARDFLOW_HOME": str(home)},
        timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["version"] == result["version"]
