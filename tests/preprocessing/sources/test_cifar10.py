from __future__ import annotations

import contextlib
import io
import pickle
import re
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from data_catalog import Catalog, Manifest
from preprocessing.sources import cifar10
from preprocessing.sources.errors import SourceError


def decode_png(data: bytes) -> NDArray[Any]:
    """8-bit RGB/greyscale, non-interlaced PNG -> (h, w, c) uint8, with zlib and struct only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert header is not None
    width, height, depth, colour, _c, _f, interlace = header
    assert depth == 8 and interlace == 0 and colour in (0, 2)
    channels = 3 if colour == 2 else 1
    stride = width * channels
    raw = zlib.decompress(idat)
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        cur = np.zeros(stride, dtype=np.int32)
        for x in range(stride):
            a = cur[x - channels] if x >= channels else 0
            b = prev[x]
            c = prev[x - channels] if x >= channels else 0
            if kind == 0:
                pred = 0
            elif kind == 1:
                pred = a
            elif kind == 2:
                pred = b
            elif kind == 3:
                pred = (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
            cur[x] = (line[x] + pred) & 0xFF
        out[y] = cur
        prev = cur
    return out.astype(np.uint8).reshape(height, width, channels)


@pytest.fixture(scope="module")
def real_images(foolbox_wheel: Path) -> tuple[NDArray[Any], NDArray[Any]]:
    """The 20 real CIFAR-10 test images shipped in foolbox's wheel: (labels, HWC images)."""
    with zipfile.ZipFile(foolbox_wheel) as wheel:
        names = sorted(n for n in wheel.namelist() if "/cifar10_" in n and n.endswith(".png"))
        images = np.stack([decode_png(wheel.read(n)) for n in names])
    labels = np.array([int(n.rsplit("_", 1)[1][0]) for n in names], dtype=np.uint8)
    assert images.shape == (20, 32, 32, 3)
    try:
        from PIL import Image
    except ImportError:
        pass
    else:  # the hand-written decoder agrees with Pillow's
        with zipfile.ZipFile(foolbox_wheel) as wheel:
            pillow = np.stack([np.asarray(Image.open(io.BytesIO(wheel.read(n)))) for n in names])
        assert np.array_equal(pillow, images)
    return labels, images


# Train batches get 2 images each, the test batch the last 10.
SPLIT = [(f"data_batch_{i}", slice(2 * (i - 1), 2 * i)) for i in range(1, 6)] + [
    ("test_batch", slice(10, 20))
]


def _planes(images: NDArray[Any]) -> NDArray[Any]:
    return images.transpose(0, 3, 1, 2).reshape(len(images), -1)


def write_binary(directory: Path, labels: NDArray[Any], images: NDArray[Any]) -> Path:
    directory.mkdir(parents=True)
    for name, part in SPLIT:
        records = np.concatenate([labels[part, None], _planes(images[part])], axis=1)
        (directory / f"{name}.bin").write_bytes(records.astype(np.uint8).tobytes())
    (directory / "batches.meta.txt").write_text("\n".join(cifar10.CLASS_NAMES) + "\n")
    return directory


def write_python(directory: Path, labels: NDArray[Any], images: NDArray[Any]) -> Path:
    directory.mkdir(parents=True)
    for name, part in SPLIT:
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(x) for x in labels[part]],
            b"data": np.ascontiguousarray(_planes(images[part])),
            b"filenames": [f"{i}.png".encode() for i in range(len(labels[part]))],
        }
        (directory / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {b"label_names": [n.encode() for n in cifar10.CLASS_NAMES], b"num_vis": 3072}
    (directory / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return directory


def tar_of(directory: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(directory, arcname=directory.name)
    return archive


def _pixels(catalog: Catalog, manifest: Manifest) -> tuple[NDArray[Any], NDArray[Any]]:
    by_name = {e.path: catalog.file_path(manifest, e) for e in manifest.files}
    parts = [
        cifar10.read_batch(by_name[n])
        for n in manifest.schema["train_files"] + manifest.schema["test_files"]
    ]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.mark.parametrize("archived", [False, True])
def test_both_formats_give_identical_pixels(
    tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]], archived: bool
) -> None:
    labels, images = real_images
    got = {}
    for fmt, writer in (("bin", write_binary), ("py", write_python)):
        folder = writer(tmp_path / f"cifar-10-batches-{fmt}", labels, images)
        source = tar_of(folder, tmp_path / f"{fmt}.tar.gz") if archived else tmp_path
        if not archived and fmt == "py":
            source = folder
        catalog = Catalog(tmp_path / f"catalog-{fmt}")
        manifest = cifar10.ingest(catalog, source=str(source))
        assert manifest.rows == 20
        assert manifest.statistics["train_rows"] == 10
        assert manifest.statistics["test_rows"] == 10
        assert len(manifest.files) == 7  # six batches and the meta file
        kept = {e.path: catalog.file_path(manifest, e).read_bytes() for e in manifest.files}
        for name, data in kept.items():
            assert data == (folder / name).read_bytes()  # exact bytes
        got[fmt] = _pixels(catalog, manifest)
    assert np.array_equal(got["bin"][0], labels) and np.array_equal(got["py"][0], labels)
    assert np.array_equal(got["bin"][1], images) and np.array_equal(got["py"][1], images)


def _no_version(catalog: Catalog) -> None:
    with pytest.raises(Exception):  # noqa: B017 - NotFound
        catalog.get("cifar10")


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch /tmp/shardflow-cifar10-pwned",))


def test_hostile_pickle_is_refused(
    tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]]
) -> None:
    folder = write_python(tmp_path / "cifar-10-batches-py", *real_images)
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    catalog = Catalog(tmp_path / "catalog")
    with pytest.raises(SourceError, match=r"data_batch_3: .*posix.system is not allowed"):
        cifar10.ingest(catalog, source=str(folder))
    assert not Path("/tmp/shardflow-cifar10-pwned").exists()
    _no_version(catalog)


@pytest.mark.parametrize("archived", [False, True])
def test_a_hostile_meta_pickle_is_refused(
    tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]], archived: bool
) -> None:
    """Issue #29 item 21: batches.meta was stored unchecked; now it is read with the batches'
    restricted unpickler, whether the batches come as a folder or an archive."""
    folder = write_python(tmp_path / "cifar-10-batches-py", *real_images)
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": _Evil()}))
    source = tar_of(folder, tmp_path / "py.tar.gz") if archived else folder
    catalog = Catalog(tmp_path / "catalog")
    with pytest.raises(SourceError, match=r"batches.meta: .*posix.system is not allowed"):
        cifar10.ingest(catalog, source=str(source))
    assert not Path("/tmp/shardflow-cifar10-pwned").exists()
    _no_version(catalog)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("batches.meta", pickle.dumps([1, 2, 3]), "not a CIFAR-10 dict"),
        ("batches.meta", pickle.dumps({b"label_names": [b"a"]}), "list of 10 class names"),
        ("batches.meta", pickle.dumps({b"other": 1}), "unexpected key"),
    ],
)
def test_a_meta_file_that_is_not_cifar10s_is_refused(
    tmp_path: Path,
    real_images: tuple[NDArray[Any], NDArray[Any]],
    name: str,
    content: bytes,
    needle: str,
) -> None:
    folder = write_python(tmp_path / "cifar-10-batches-py", *real_images)
    (folder / name).write_bytes(content)
    with pytest.raises(SourceError, match=needle):
        cifar10.ingest(Catalog(tmp_path / "catalog"), source=str(folder))


def test_missing_batch_and_bad_sizes(
    tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]]
) -> None:
    folder = write_binary(tmp_path / "b", *real_images)
    catalog = Catalog(tmp_path / "catalog")
    (folder / "data_batch_4.bin").unlink()
    with pytest.raises(SourceError, match=r"lacks data_batch_4\.bin"):
        cifar10.ingest(catalog, source=str(folder))
    (folder / "data_batch_4.bin").write_bytes(b"\x01" * 3073 + b"\x00")
    with pytest.raises(SourceError, match="not a whole number of 3,073-byte records"):
        cifar10.ingest(catalog, source=str(folder))
    (folder / "data_batch_4.bin").write_bytes(b"\x0a" + b"\x00" * 3072)
    with pytest.raises(SourceError, match=r"label 10 outside 0\.\.9"):
        cifar10.ingest(catalog, source=str(folder))
    _no_version(catalog)


def _hostile_tar(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tarfile.TarInfo("cifar/../../data_batch_1.bin"), "climbs out"),
        (lambda: tarfile.TarInfo("/tmp/data_batch_1.bin"), "absolute path"),
        (lambda: _link(tarfile.SYMTYPE, "/etc/passwd"), "is a link"),
        (lambda: _link(tarfile.LNKTYPE, "other"), "is a link"),
        (lambda: _link(tarfile.CHRTYPE, ""), "device or special"),
        (lambda: _link(tarfile.FIFOTYPE, ""), "device or special"),
    ],
)
def test_unsafe_archive_members_are_refused(tmp_path: Path, make: object, message: str) -> None:
    member = make()  # type: ignore[operator]
    data = b"\x00" * 3073 if member.isfile() else b""
    member.size = len(data)
    archive = _hostile_tar(tmp_path / "evil.tar.gz", member, data)
    catalog = Catalog(tmp_path / "catalog")
    with pytest.raises(SourceError, match=message):
        cifar10.ingest(catalog, source=str(archive))
    _no_version(catalog)
    assert not (tmp_path.parent / "data_batch_1.bin").exists()


def _link(kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo("cifar-10-batches-bin/data_batch_1.bin")
    info.type = kind
    info.linkname = target
    return info


def test_not_an_archive(tmp_path: Path) -> None:
    (tmp_path / "x.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(SourceError, match="unreadable archive"):
        cifar10.ingest(Catalog(tmp_path / "catalog"), source=str(tmp_path / "x.tar.gz"))
    with pytest.raises(SourceError, match="no such file"):
        cifar10.ingest(Catalog(tmp_path / "catalog"), source=str(tmp_path / "nope"))


def test_archive_over_http(tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]]) -> None:
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    folder = write_python(tmp_path / "cifar-10-batches-py", *real_images)
    served = tmp_path / "www"
    served.mkdir()
    tar_of(folder, served / "cifar-10-python.tar.gz")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=served))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz"
        catalog = Catalog(tmp_path / "catalog")
        cache = tmp_path / "downloads"
        manifest = cifar10.ingest(catalog, source=url, download_cache=cache)
        assert list(cache.iterdir()) == []  # committed: the cache entry is forgotten
        with pytest.raises(SourceError, match=re.escape(url) + r"\.missing: HTTP 404"):
            cifar10.ingest(catalog, source=url + ".missing", download_cache=cache)
        assert list(cache.iterdir()) == []
    finally:
        server.shutdown()
        server.server_close()
    assert manifest.rows == 20
    assert {s["uri"] for s in manifest.sources} == {url}
    assert all(len(s["archive_sha256"]) == 64 for s in manifest.sources)
    assert sorted(e.path for e in manifest.files) == sorted(p.name for p in folder.iterdir())
    labels, images = _pixels(catalog, manifest)
    assert np.array_equal(labels, real_images[0])
    assert np.array_equal(images, real_images[1])


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300) | st.binary(max_size=200).map(lambda b: b"\x80\x02" + b))
def test_pickle_fuzz_raises_only_source_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(data)
    with contextlib.suppress(SourceError):
        cifar10.read_batch(path)


@pytest.mark.parametrize("archived", [False, True])
def test_read_cifar10_both_formats(
    tmp_path: Path, real_images: tuple[NDArray[Any], NDArray[Any]], archived: bool
) -> None:
    labels, images = real_images
    for fmt, writer in (("bin", write_binary), ("py", write_python)):
        folder = writer(tmp_path / f"cifar-10-batches-{fmt}", labels, images)
        source = tar_of(folder, tmp_path / f"{fmt}.tar.gz") if archived else folder
        splits = cifar10.read_cifar10(source)
        assert set(splits) == {"train", "test"}
        train_images, train_labels = splits["train"]
        test_images, test_labels = splits["test"]
        assert train_images.dtype == np.uint8 and train_images.shape == (10, 32, 32, 3)
        assert train_labels.dtype == np.uint8 and train_labels.shape == (10,)
        assert np.array_equal(np.concatenate([train_images, test_images]), images)
        assert np.array_equal(np.concatenate([train_labels, test_labels]), labels)


def _batch(**changes: object) -> dict[bytes, object]:
    batch: dict[bytes, object] = {
        b"batch_label": b"training batch 1 of 5",
        b"labels": [3, 8],
        b"data": np.zeros((2, 3072), dtype=np.uint8),
        b"filenames": [b"a.png", b"b.png"],
    }
    for key, value in changes.items():
        if value is None:
            del batch[key.encode()]
        else:
            batch[key.encode()] = value
    return batch


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (_batch(), None),
        (_batch(batch_label=None, filenames=None), None),
        ([1, 2], "pickle holds a list, not a CIFAR-10 dict"),
        (_batch(extra=b"x"), "unexpected key"),
        (_batch(labels=None), "lacks CIFAR-10's 'labels'"),
        (_batch(labels=[True, False]), "labels are not a list of integers"),
        (_batch(labels=(3, 8)), "labels are not a list of integers"),
        (_batch(labels=[3]), "1 labels for 2 images"),
        (_batch(labels=[3, 300]), r"labels outside 0\.\.9"),
        (_batch(labels=[3, 10]), r"label 10 outside 0\.\.9"),
        (_batch(data=np.zeros((2, 3072), dtype=np.int16)), "expected uint8"),
        (_batch(data=np.zeros((2, 3071), dtype=np.uint8)), "expected uint8"),
        (_batch(data=[[0] * 3072] * 2), "expected uint8"),
        (_batch(filenames=[b"a.png"]), "1 filenames for 2 images"),
        (_batch(filenames=[1, 2]), "filenames are not a list of texts"),
        (_batch(batch_label=7), "batch_label is not text"),
    ],
)
def test_pickle_structure_is_checked(tmp_path: Path, batch: object, message: str | None) -> None:
    path = tmp_path / "data_batch_1"
    for protocol in (2, 4):
        path.write_bytes(pickle.dumps(batch, protocol=protocol))
        if message is None:
            labels, images = cifar10.read_batch(path)
            assert labels.tolist() == [3, 8] and images.shape == (2, 32, 32, 3)
        else:
            with pytest.raises(SourceError, match=rf"data_batch_1: .*{message}"):
                cifar10.read_batch(path)


def test_codecs_encode_only_for_latin1(tmp_path: Path) -> None:
    # _codecs.encode(b"...", "hex") style tricks: the one non-numpy global is tied to latin-1.
    payload = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x06\x00\x00\x00base64\x86R."
    path = tmp_path / "data_batch_1"
    path.write_bytes(payload)
    with pytest.raises(SourceError, match="allowed for latin-1 text only"):
        cifar10.read_batch(path)
    for module, name in (("builtins", "eval"), ("numpy", "load"), ("subprocess", "Popen")):
        path.write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"q\x00.")
        with pytest.raises(SourceError, match=rf"global {module}\.{name} is not allowed"):
            cifar10.read_batch(path)


def test_synthetic_cifar10_from_the_real_images(
    real_images: tuple[NDArray[Any], NDArray[Any]], tmp_path: Path
) -> None:
    from preprocessing.sources.synth_images import write_cifar10_set

    labels, images = real_images
    pool = write_binary(tmp_path / "pool", labels, images)
    out = tmp_path / "synthetic"
    write_cifar10_set(str(pool), out, train_rows=50, test_rows=10, seed=1)
    made = cifar10.read_cifar10(out)
    assert made["train"][0].shape == (50, 32, 32, 3)
    assert made["test"][0].shape == (10, 32, 32, 3)
    real = {image.tobytes() for image in images}
    assert not any(image.tobytes() in real for image in made["train"][0])  # no copies
    assert set(made["train"][1]) <= set(labels)

    manifest = cifar10.ingest(Catalog(tmp_path / "catalog"), source=str(out))
    assert manifest.rows == 60
    assert manifest.statistics["provenance"] == "synthetic"
