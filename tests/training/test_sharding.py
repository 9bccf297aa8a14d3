"""The same processed data read by 1, 2 and 4 ranks through petastorm, as training reads it:
every sample once per epoch, equal counts, a new order every epoch that the lineage names."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_catalog import Catalog, Manifest
from data_catalog.layout import ProcessedLayout
from preprocessing.config import JobOptions
from preprocessing.driver import run_locally
from preprocessing.images import plan_job
from preprocessing.plan import PlanConfig
from tests.conftest import ingest_random_mnist
from training.input import InputSpec, _reader, as_url, epoch_batches, epoch_seed, plan_steps
from training.launcher import row_groups_by_epoch

ROWS = 2_000
SEED = 3


@pytest.fixture(scope="module")
def processed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Catalog, Manifest]:
    root = tmp_path_factory.mktemp("sharding")
    catalog = ingest_random_mnist(root, ROWS, seed=5)
    options = JobOptions(
        plan=PlanConfig(rank_multiple=8, target_rows_per_group=100, target_rows_per_shard=600),
        validation_fraction=0,
    )
    job = plan_job(catalog, catalog.get("mnist"), options)
    done = run_locally(job, root / "work")
    with catalog.stage(job.name, kind="processed") as stage:
        manifest = job.commit(stage, done, root / "work")
    assert len([f for f in manifest.files if f.path.startswith("split=train/")]) > 1
    return catalog, manifest


def _indices_of_group(directory: Path, name: str) -> list[int]:
    path, group = name.split("#")
    table = pq.ParquetFile(directory / path).read_row_group(int(group), ["index"])
    return [int(i) for i in table.column("index").to_pylist()]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_every_sample_once_per_epoch_in_the_recorded_order(
    processed: tuple[Catalog, Manifest], num_ranks: int
) -> None:
    catalog, manifest = processed
    directory = catalog.version_dir(manifest.name, manifest.version)
    spec = InputSpec.of(ProcessedLayout.of(manifest))
    recorded = row_groups_by_epoch(manifest, num_ranks, SEED, epochs=2)
    orders = []
    for epoch in (0, 1):
        seen = []
        for rank in range(num_ranks):
            reader = _reader(
                str(as_url(directory / "split=train")),
                spec,
                rank=rank,
                num_ranks=num_ranks,
                seed=epoch_seed(SEED, epoch),
                columns=["index"],
            )
            with reader:
                groups = [[int(i) for i in batch.index] for batch in reader]
            # The lineage names exactly the row groups this rank read, in its reading order.
            expected = recorded[str(epoch + 1)][str(rank)]
            assert groups == [_indices_of_group(directory, name) for name in expected]
            seen.append([i for g in groups for i in g])
        assert {len(s) for s in seen} == {manifest.statistics["train"]["rows"] // num_ranks}
        assert sorted(i for s in seen for i in s) == sorted(
            pq.read_table(directory / "split=train", columns=["index"]).column("index").to_pylist()
        )
        orders.append(seen)
    # A new order every epoch, the same set per rank.
    assert orders[0] != orders[1]
    assert [sorted(s) for s in orders[0]] == [sorted(s) for s in orders[1]]


def test_epoch_batches_are_exact_and_deterministic(processed: tuple[Catalog, Manifest]) -> None:
    catalog, manifest = processed
    directory = catalog.version_dir(manifest.name, manifest.version)
    layout = ProcessedLayout.of(manifest)
    spec = InputSpec.of(layout)
    steps = plan_steps(layout.train, 3, 32)

    def labels(epoch: int, rank: int) -> list[int]:
        chunks = epoch_batches(
            str(as_url(directory / "split=train")),
            spec,
            rank=rank,
            num_ranks=3,
            seed=SEED,
            epoch=epoch,
            batch_size=32,
            steps=steps,
            shuffle_buffer=256,
        )
        return [int(v) for _x, y in chunks for v in y]

    first = labels(0, 1)
    assert len(first) == steps * 32  # equal steps on every rank, whatever its share
    assert labels(0, 1) == first  # same seed, epoch and ranks: the same order
    assert labels(1, 1) != first
    assert len(labels(0, 0)) == len(labels(0, 2)) == steps * 32
