"""The same processed data read by 1, 2 and 4 ranks through petastorm, as training reads it."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
from petastorm import make_batch_reader

from data_catalog import Catalog, Manifest
from preprocessing.images import write_shard
from preprocessing.plan import PlanConfig, plan_training_split
from preprocessing.sources import idx
from training.launcher import row_groups_by_rank

ROWS = 2_000


@pytest.fixture(scope="module")
def processed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Catalog, Manifest]:
    root = tmp_path_factory.mktemp("sharding")
    rng = np.random.default_rng(5)
    images, labels = root / "images", root / "labels"
    idx.write(images, rng.integers(0, 256, (ROWS, 28, 28), dtype=np.uint8), compress=False)
    idx.write(labels, rng.integers(0, 10, ROWS, dtype=np.uint8), compress=False)
    plan = plan_training_split("train", ROWS, PlanConfig(target_rows_per_shard=750))
    catalog = Catalog(root / "catalog")
    with catalog.stage("sharding-processed", kind="processed") as stage:
        for shard in plan.shards:
            write_shard(str(images), str(labels), shard, str(stage.path))
        manifest = stage.commit(rows=plan.rows)
    assert len(manifest.files) > 1  # several files: the global row-group order matters
    return catalog, manifest


def read_rank(url: str, rank: int, num_ranks: int) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with make_batch_reader(
            url,
            schema_fields=["index"],
            cur_shard=rank,
            shard_count=num_ranks,
            num_epochs=1,
            shuffle_row_groups=True,
            seed=3,
            reader_pool_type="dummy",
        ) as reader:
            return [int(i) for batch in reader for i in batch.index]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_every_sample_once_per_epoch_with_equal_counts(
    processed: tuple[Catalog, Manifest], num_ranks: int
) -> None:
    catalog, manifest = processed
    train = catalog.version_dir(manifest.name, manifest.version) / "train"
    seen = [read_rank(train.as_uri(), rank, num_ranks) for rank in range(num_ranks)]
    assert {len(s) for s in seen} == {ROWS // num_ranks}
    everything = sorted(i for s in seen for i in s)
    assert everything == list(range(ROWS))

    # The lineage recorded for a model names exactly the row groups each rank read.
    expected = row_groups_by_rank(manifest, num_ranks)
    for rank, indices in enumerate(seen):
        groups = set()
        for name in expected[str(rank)]:
            path, group = name.split("#")
            table = pq.ParquetFile(train.parent / path).read_row_group(int(group), ["index"])
            groups.update(table.column("index").to_pylist())
        assert groups == set(indices)
