"""The rank's reader (pyarrow's row groups in petastorm's plan, training.row_groups) against
petastorm's own reader of the same split: the same rows in the same order, for plain Parquet,
the Petastorm format (make_reader, NdarrayCodec) and files whose last row group is shorter;
and so the same batches out of ``epoch_batches``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_catalog.layout import ProcessedLayout
from preprocessing.config import JobOptions
from preprocessing.driver import run_locally
from preprocessing.images import plan_job
from preprocessing.plan import PlanConfig
from tests.conftest import ingest_random_mnist
from training.input import (
    READERS,
    InputSpec,
    as_url,
    epoch_batches,
    epoch_seed,
    load_split,
    row_group_chunks,
)
from training.row_groups import binary_pixels, cache_memory, direct_io_wanted, split_files

ROWS = 1_500


@pytest.fixture(scope="module")
def image_splits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, InputSpec]]:
    """The training split of one raw version processed as Parquet and as Petastorm."""
    root = tmp_path_factory.mktemp("row-groups")
    catalog = ingest_random_mnist(root, ROWS, seed=11)
    splits = {}
    for fmt in ("parquet", "petastorm"):
        options = JobOptions(
            format=fmt,
            plan=PlanConfig(rank_multiple=8, target_rows_per_group=90, target_rows_per_shard=500),
            validation_fraction=0,
        )
        job = plan_job(catalog, catalog.get("mnist"), options)
        done = run_locally(job, root / f"work-{fmt}")
        with catalog.stage(job.name, kind="processed") as stage:
            manifest = job.commit(stage, done, root / f"work-{fmt}")
        directory = catalog.split_dir(manifest, "train")
        assert len(list(directory.glob("*.parquet"))) > 1
        splits[fmt] = (str(as_url(directory)), InputSpec.of(ProcessedLayout.of(manifest)))
    return splits


@pytest.fixture(scope="module")
def uneven_split(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, InputSpec]:
    """SDSS's layout: per-piece files of 40-row groups whose last group is shorter."""
    directory = tmp_path_factory.mktemp("uneven") / "train"
    directory.mkdir()
    rng = np.random.default_rng(2)
    start = 0
    for piece, rows in enumerate((130, 95, 161)):
        table = pa.table(
            {
                "u": rng.random(rows),
                "g": rng.random(rows),
                "label": np.arange(start, start + rows) % 3,
            }
        )
        pq.write_table(table, directory / f"piece-{piece:03d}.parquet", row_group_size=40)
        start += rows
    spec = InputSpec(kind="tabular", feature_columns=["u", "g"], label_column="label")
    return str(as_url(directory)), spec


def _chunks(reader: str, url: str, spec: InputSpec, **plan: int) -> list[tuple[Any, Any]]:
    return [(np.array(x), np.array(y)) for x, y in READERS[reader](url, spec, **plan)]


def _same(a: list[tuple[Any, Any]], b: list[tuple[Any, Any]]) -> None:
    assert [len(y) for _x, y in a] == [len(y) for _x, y in b]
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype and xa.shape == xb.shape
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


@pytest.mark.parametrize("fmt", ["parquet", "petastorm"])
@pytest.mark.parametrize(("rank", "num_ranks"), [(0, 1), (1, 2), (2, 4)])
def test_pyarrow_reads_petastorms_rows_in_petastorms_order(
    image_splits: dict[str, tuple[str, InputSpec]], fmt: str, rank: int, num_ranks: int
) -> None:
    url, spec = image_splits[fmt]
    for epoch in (0, 1):
        plan = {"rank": rank, "num_ranks": num_ranks, "seed": epoch_seed(4, epoch)}
        ours = _chunks("pyarrow", url, spec, **plan)
        assert ours and ours[0][0].shape[1:] == (28, 28, 1)
        _same(ours, _chunks("petastorm", url, spec, **plan))


def test_shorter_last_row_groups_read_alike(uneven_split: tuple[str, InputSpec]) -> None:
    url, spec = uneven_split
    assert [g.rows for g in split_files(url).groups] == [40] * 3 + [10] + [40] * 2 + [15] + [
        40
    ] * 4 + [1]
    for num_ranks in (1, 3):
        for rank in range(num_ranks):
            plan = {"rank": rank, "num_ranks": num_ranks, "seed": epoch_seed(1, 2)}
            ours = _chunks("pyarrow", url, spec, **plan)
            assert ours[0][0].shape[1:] == (2,)
            _same(ours, _chunks("petastorm", url, spec, **plan))


def test_a_list_of_file_urls_reads_as_the_folder(
    image_splits: dict[str, tuple[str, InputSpec]],
) -> None:
    url, spec = image_splits["parquet"]
    files = sorted(f"file://{p}" for p in Path(url.removeprefix("file://")).glob("*.parquet"))
    plan = {"rank": 1, "num_ranks": 2, "seed": 9}
    _same(_chunks("pyarrow", url, spec, **plan), _chunks("pyarrow", files, spec, **plan))  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["parquet", "petastorm"])
def test_epoch_batches_are_the_same_with_either_reader(
    image_splits: dict[str, tuple[str, InputSpec]], fmt: str
) -> None:
    url, spec = image_splits[fmt]

    def batches(reader: str) -> list[tuple[Any, Any]]:
        return [
            (np.array(x), np.array(y))
            for x, y in epoch_batches(
                url,
                spec,
                rank=1,
                num_ranks=2,
                seed=3,
                epoch=1,
                batch_size=16,
                steps=40,
                shuffle_buffer=200,
                reader=reader,
            )
        ]

    ours = batches("pyarrow")
    assert sum(len(y) for _x, y in ours) == 40 * 16
    _same(ours, batches("petastorm"))


def test_the_evaluation_split_of_a_petastorm_dataset_loads_whole(
    image_splits: dict[str, tuple[str, InputSpec]],
) -> None:
    url, spec = image_splits["petastorm"]
    inputs, labels = load_split(url, spec)
    # Pixels as stored: image models scale them (training.models).
    assert inputs.shape == (len(labels), 28, 28, 1) and inputs.dtype == np.uint8
    assert len(labels) == sum(g.rows for g in split_files(url).groups)
    assert inputs.max() > 1


def test_pixels_are_a_view_of_the_column_and_odd_lengths_are_refused() -> None:
    column = pa.array([bytes(range(4)), bytes(range(4, 8))], pa.binary())
    pixels = binary_pixels(column, 4)
    assert pixels.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not pixels.flags.owndata
    with pytest.raises(ValueError, match="not all 4 bytes"):
        binary_pixels(pa.array([b"abc", b"defgh"], pa.binary()), 4)


@pytest.mark.parametrize("fmt", ["parquet", "petastorm"])
def test_direct_io_reads_the_same_rows_as_the_page_cache(
    image_splits: dict[str, tuple[str, InputSpec]], fmt: str
) -> None:
    url, spec = image_splits[fmt]
    plan = {"rank": 0, "num_ranks": 2, "seed": 5}
    buffered = [
        (np.array(x), np.array(y)) for x, y in row_group_chunks(url, spec, direct=False, **plan)
    ]
    direct = [
        (np.array(x), np.array(y)) for x, y in row_group_chunks(url, spec, direct=True, **plan)
    ]
    assert sum(len(y) for _x, y in direct) > 0
    _same(direct, buffered)


def test_direct_io_is_chosen_only_for_local_splits_larger_than_the_cache(
    image_splits: dict[str, tuple[str, InputSpec]],
) -> None:
    files = split_files(image_splits["parquet"][0])
    paths = {group.path for group in files.groups}
    assert files.nbytes == sum(Path(path).stat().st_size for path in paths)
    assert direct_io_wanted(files, memory=files.nbytes - 1)
    assert not direct_io_wanted(files, memory=files.nbytes)
    assert not direct_io_wanted(files)  # this host's memory holds a test's split
    assert 0 < cache_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_large_rows_are_gathered_one_by_one_into_the_same_batches(tmp_path: Path) -> None:
    """Rows of 24 KB take the row-by-row gather (one copy each); rows of 768 bytes the window's
    concatenation; both give the batches of ``x[permutation]``."""
    rng = np.random.default_rng(4)
    shapes = {"large": [64, 128, 3], "small": [16, 16, 3]}
    for name, shape in shapes.items():
        directory = tmp_path / name
        directory.mkdir()
        rows = 700
        pixels = rng.integers(0, 256, (rows, int(np.prod(shape))), dtype=np.uint8)
        table = pa.table({"image": [p.tobytes() for p in pixels], "label": np.arange(rows) % 10})
        pq.write_table(table, directory / "part-0.parquet", row_group_size=60)
        spec = InputSpec(kind="images", format="parquet", image_shape=shape)
        got = list(
            epoch_batches(
                as_url(directory),
                spec,
                rank=0,
                num_ranks=1,
                seed=2,
                epoch=3,
                batch_size=32,
                steps=20,
                shuffle_buffer=100,
            )
        )
        assert sum(len(y) for _x, y in got) == 20 * 32
        by_label_row = {int(i): pixels[i].reshape(shape) for i in range(rows)}
        seen = set()
        for x, y in got:
            assert x.ctypes.data % 64 == 0 and x.flags.c_contiguous
            for image, label in zip(x, y, strict=True):
                # Labels are i % 10: find the row among those with that label.
                same = range(int(label), rows, 10)
                match = [i for i in same if np.array_equal(by_label_row[i], image)]
                assert len(match) == 1
                seen.add(match[0])
        assert len(seen) == 20 * 32  # no row twice
