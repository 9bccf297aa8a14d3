"""The IDX reader on good files and on each kind of damage a download can do."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preprocessing.sources import idx

RNG = np.random.default_rng(7)


def write_pair(directory: Path, n: int = 12, *, compress: bool = False) -> tuple[Path, Path]:
    images = RNG.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = RNG.integers(0, 10, size=n, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    image_path = directory / f"train-images-idx3-ubyte{suffix}"
    label_path = directory / f"train-labels-idx1-ubyte{suffix}"
    idx.write(image_path, images, compress=compress)
    idx.write(label_path, labels, compress=compress)
    return image_path, label_path


@pytest.mark.parametrize("compress", [False, True])
def test_good_pair_round_trips(tmp_path: Path, compress: bool) -> None:
    image_path, label_path = write_pair(tmp_path, 12, compress=compress)
    pair = idx.check_pair(image_path, label_path, num_classes=10)
    assert pair.count == 12
    assert pair.image_shape == (28, 28)
    whole = idx.read_records(image_path)
    assert whole.shape == (12, 28, 28)
    np.testing.assert_array_equal(idx.read_records(image_path, 5, 3), whole[5:8])
    blocks = list(idx.iter_records(label_path, batch=5))
    assert [start for start, _ in blocks] == [0, 5, 10]
    np.testing.assert_array_equal(
        np.concatenate([b for _, b in blocks]), idx.read_records(label_path)
    )


def test_gzip_output_is_deterministic(tmp_path: Path) -> None:
    array = np.arange(100, dtype=np.uint8)
    idx.write(tmp_path / "a.gz", array, compress=True)
    idx.write(tmp_path / "b.gz", array, compress=True)
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()


def test_truncated_raw_file(tmp_path: Path) -> None:
    image_path, label_path = write_pair(tmp_path)
    image_path.write_bytes(image_path.read_bytes()[:-100])
    with pytest.raises(idx.IdxError, match=r"truncated"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_truncated_gzip_file(tmp_path: Path) -> None:
    image_path, label_path = write_pair(tmp_path, compress=True)
    image_path.write_bytes(image_path.read_bytes()[:-200])
    with pytest.raises(idx.IdxError, match=r"truncated|corrupt"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_wrong_magic(tmp_path: Path) -> None:
    image_path, label_path = write_pair(tmp_path)
    image_path.write_bytes(b"<html>Not Found</html>" + b"\0" * 100)
    with pytest.raises(idx.IdxError, match=r"not an IDX file"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_wrong_type_code(tmp_path: Path) -> None:
    path = tmp_path / "floats"
    path.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 2) + b"\0" * 8)
    with pytest.raises(idx.IdxError, match=r"type float, expected ubyte"):
        idx.inspect(path, num_dims=1)


def test_wrong_dimensions(tmp_path: Path) -> None:
    _image_path, label_path = write_pair(tmp_path)
    with pytest.raises(idx.IdxError, match=r"1-dimensional IDX, expected 3"):
        idx.check_pair(label_path, label_path, num_classes=10)


def test_count_size_mismatch(tmp_path: Path) -> None:
    image_path, label_path = write_pair(tmp_path, 12)
    data = bytearray(image_path.read_bytes())
    data[4:8] = struct.pack(">I", 13)  # header claims one image more than the file holds
    image_path.write_bytes(bytes(data))
    with pytest.raises(idx.IdxError, match=r"declares 13 records"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_trailing_bytes(tmp_path: Path) -> None:
    image_path, label_path = write_pair(tmp_path, 12)
    image_path.write_bytes(image_path.read_bytes() + b"\0" * 784)
    with pytest.raises(idx.IdxError, match=r"declares 12 records"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_image_label_count_mismatch(tmp_path: Path) -> None:
    image_path, _ = write_pair(tmp_path, 12)
    label_path = tmp_path / "labels"
    idx.write(label_path, np.zeros(11, dtype=np.uint8), compress=False)
    with pytest.raises(idx.IdxError, match=r"12 images but .* 11 labels"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_label_out_of_range(tmp_path: Path) -> None:
    image_path, _ = write_pair(tmp_path, 12)
    labels = np.zeros(12, dtype=np.uint8)
    labels[7] = 10
    label_path = tmp_path / "labels.gz"
    idx.write(label_path, labels, compress=True)
    with pytest.raises(idx.IdxError, match=r"label 10 at record 7 is outside 0..9"):
        idx.check_pair(image_path, label_path, num_classes=10)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    with pytest.raises(idx.IdxError, match=r"truncated"):
        idx.inspect(path, num_dims=1)


def test_gzip_of_garbage(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01")[:10] + b"garbage")
    with pytest.raises(idx.IdxError):
        idx.inspect(path, num_dims=1)


VALID = idx.encode(np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=200),
        # Valid files with bytes flipped, cut short or extended: the likely damage.
        st.tuples(
            st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=4),
            st.integers(0, len(VALID) + 8),
        ).map(lambda edits: _damaged(*edits)),
    ),
    compress=st.booleans(),
)
def test_fuzzed_files_give_records_or_one_idx_error(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, compress: bool
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "file"
    path.write_bytes(gzip.compress(data) if compress else data)
    try:
        header = idx.inspect(path, num_dims=3)
    except idx.IdxError as exc:
        assert "\n" not in str(exc)
        return
    records = idx.read_records(path)
    assert records.shape == header.shape


def _damaged(edits: list[tuple[int, int]], length: int) -> bytes:
    data = bytearray(VALID + b"\0" * 8)[:length]
    for position, value in edits:
        if position < len(data):
            data[position] = value
    return bytes(data)
