"""Shard writing: equal row groups, whole-or-absent files, reuse after an interrupted run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from preprocessing.images import finished_shard, write_shard
from preprocessing.plan import Shard
from preprocessing.sources import idx


def sources(tmp_path: Path, n: int = 40) -> tuple[str, str]:
    rng = np.random.default_rng(3)
    images, labels = tmp_path / "images", tmp_path / "labels"
    idx.write(images, rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), compress=False)
    idx.write(labels, rng.integers(0, 10, n, dtype=np.uint8), compress=True)
    return str(images), str(labels)


SHARD = Shard(split="train", index=1, start=8, rows=24, rows_per_group=8)


def test_shard_holds_its_rows_in_equal_groups(tmp_path: Path) -> None:
    images, labels = sources(tmp_path)
    result = write_shard(images, labels, SHARD, str(tmp_path / "out"))
    assert result == {
        "path": "train/part-00001.parquet",
        "rows": 24,
        "bytes": (tmp_path / "out" / result["path"]).stat().st_size,
    }
    table = pq.read_table(tmp_path / "out" / result["path"])
    assert table.column("index").to_pylist() == list(range(8, 32))
    pixels = np.frombuffer(b"".join(table.column("image").to_pylist()), np.uint8)
    np.testing.assert_array_equal(pixels.reshape(24, 28, 28), idx.read_records(images, 8, 24))
    metadata = pq.read_metadata(tmp_path / "out" / result["path"])
    assert [metadata.row_group(i).num_rows for i in range(3)] == [8, 8, 8]
    assert not list((tmp_path / "out").rglob("*.partial"))


def test_finished_shard_is_reused_and_a_damaged_one_rewritten(tmp_path: Path) -> None:
    images, labels = sources(tmp_path)
    out = tmp_path / "out"
    assert finished_shard(SHARD, str(out)) is None
    write_shard(images, labels, SHARD, str(out))
    path = out / SHARD.path
    written = path.read_bytes()
    again = write_shard(images, labels, SHARD, str(out))
    assert again["reused"] is True
    path.write_bytes(written[: len(written) // 2])  # as a crash mid-write could leave it
    assert finished_shard(SHARD, str(out)) is None
    rewritten = write_shard(images, labels, SHARD, str(out))
    assert "reused" not in rewritten
    assert path.read_bytes() == written
