"""Training checks its input, through the library: a processed version of real Fashion-MNIST
whose bytes or manifest were changed after its commit is refused before anything is launched
or written, and a run that diverged leaves no model (the divergence guard on real Keras)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from data_catalog import Catalog, Manifest
from data_catalog.errors import ShardflowError
from data_catalog.layout import ProcessedLayout
from data_catalog.manifest import MANIFEST_NAME, ManifestEdited, content_sha256
from preprocessing import datasets
from preprocessing.config import JobOptions
from preprocessing.driver import serial_runner
from preprocessing.sources import mnist
from preprocessing.verify_processed import check_processed
from training import launcher
from training.config import LaunchConfig, TrainConfig
from training.rank.checkpointing import EpochCheckpoint
from training.rank.divergence import DivergenceGuard, divergence
from training.rank.run_dir import DIVERGED_NAME
from training.verify_input import verify_input

PROCESSED = "fashion-mnist-processed"


@pytest.fixture(scope="module")
def pristine(fashion_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A catalog with 2,000 real Fashion-MNIST training images, ingested and processed."""
    root = tmp_path_factory.mktemp("catalog")
    catalog = Catalog(root)
    mnist.ingest(catalog, "fashion-mnist", source=str(fashion_subset))
    datasets.dataset("fashion-mnist").preprocess(
        catalog, options=JobOptions(), runner=serial_runner
    )
    return root


@pytest.fixture
def catalog(pristine: Path, tmp_path: Path) -> Catalog:
    """A copy of the pristine catalog, for one test to damage."""
    return Catalog(shutil.copytree(pristine, tmp_path / "catalog"))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The run folders ``horovodrun`` would have been started on (it is not)."""
    started: list[Path] = []

    def run_ranks(
        config: TrainConfig, launch: LaunchConfig, run_dir: Path, progress: Callable[[str], None]
    ) -> None:
        started.append(run_dir)
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(launcher, "run_ranks", run_ranks)
    return started


def train(catalog: Catalog, runs_dir: Path) -> None:
    config = TrainConfig(model="cnn", num_ranks=1, epochs=1, batch_size=8)
    launcher.train(
        catalog, "fashion-mnist", config=config, launch=LaunchConfig(), runs_dir=runs_dir
    )


def train_file(catalog: Catalog) -> tuple[Manifest, Path]:
    manifest = catalog.get(PROCESSED)
    entry = next(e for e in manifest.files if e.path.startswith("split=train/"))
    return manifest, catalog.file_path(manifest, entry)


def edit_manifest(catalog: Catalog, edit: Callable[[dict[str, Any]], None], reseal: bool) -> Path:
    """Change the processed manifest's JSON by hand; ``reseal``: also record the digest of the
    changed content, as a forger would."""
    manifest = catalog.get(PROCESSED)
    path = catalog.version_dir(manifest.name, manifest.version) / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    if reseal:
        data["manifest_digest"] = content_sha256(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path


def set_train_file_rows(data: dict[str, Any]) -> None:
    entry = next(f for f in data["files"] if f["path"].startswith("split=train/"))
    entry["rows"] -= 1


def set_rows_per_group(data: dict[str, Any]) -> None:
    data["statistics"]["train"]["rows_per_group"] += 1


def rename_rows_per_group(data: dict[str, Any]) -> None:
    train = data["statistics"]["train"]
    train["group_rows"] = train.pop("rows_per_group")


def set_normalization_mean(data: dict[str, Any]) -> None:
    data["statistics"]["normalization"]["mean"][0] += 0.01


def test_an_intact_version_is_verified_with_its_size(catalog: Catalog) -> None:
    lines: list[str] = []
    manifest = catalog.get(PROCESSED)
    check = verify_input(catalog, manifest, lines.append)
    assert check.files == len(manifest.files) == 3
    assert check.bytes == sum(e.bytes for e in manifest.files)
    assert check.notes == ()
    assert lines == [
        f"verified {manifest.ref}: 3 files, {check.bytes / 1e6:.1f} MB in {check.seconds:.2f} s"
    ]


def test_a_flipped_byte_in_a_train_shard_launches_nothing(
    catalog: Catalog, launches: list[Path], tmp_path: Path
) -> None:
    _, path = train_file(catalog)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the row groups: the footer still reads
    path.write_bytes(bytes(data))

    with pytest.raises(ShardflowError) as raised:
        train(catalog, tmp_path / "runs")
    message = str(raised.value)
    assert "\n" not in message
    assert f"{path}: sha256 mismatch" in message
    assert "nothing was trained" in message
    assert launches == []
    assert not (tmp_path / "runs").exists()  # not even a worker config
    assert catalog.names() == ["fashion-mnist", PROCESSED]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (set_train_file_rows, "manifest field files[split=train/part-00000.parquet].rows is 1855"),
        (set_rows_per_group, "statistics.train.rows_per_group is 30"),
        (rename_rows_per_group, "(processed layout 1): statistics.train.rows_per_group is missing"),
    ],
)
def test_a_resealed_manifest_field_that_disagrees_with_the_files_launches_nothing(
    catalog: Catalog,
    launches: list[Path],
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    field: str,
) -> None:
    """A forger who records the digest of the edited manifest passes the digest check; the
    counts the launcher plans from are still checked against the Parquet footers."""
    edit_manifest(catalog, edit, reseal=True)
    with pytest.raises(ShardflowError) as raised:
        train(catalog, tmp_path / "runs")
    assert "is not what its manifest says" in str(raised.value)
    assert field in str(raised.value)
    assert launches == []
    assert not (tmp_path / "runs").exists()
    # `catalog verify` names the same field.
    problems = catalog.verify(PROCESSED, checks=[check_processed])
    assert any(field in p.reason for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (set_train_file_rows, "files[split=train/part-00000.parquet].rows is 1855"),
        (set_rows_per_group, "statistics.train.rows_per_group is 30"),
        (set_normalization_mean, "statistics.normalization.mean[0] is 0.2942"),
    ],
)
def test_a_hand_edited_manifest_is_named_by_verify_and_refused_by_train(
    catalog: Catalog,
    launches: list[Path],
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    field: str,
) -> None:
    path = edit_manifest(catalog, edit, reseal=False)
    problems = catalog.verify(PROCESSED, checks=[check_processed])
    assert [p.path for p in problems] == [str(path), *[p.path for p in problems[1:]]]
    assert "edited after it was committed" in problems[0].reason
    assert any(field in p.reason for p in problems[1:]), problems
    with pytest.raises(ManifestEdited) as raised:
        train(catalog, tmp_path / "runs")
    assert str(raised.value).startswith(f"{path}: ")
    assert "edited after it was committed" in str(raised.value)
    assert launches == []


def test_the_normalisation_statistics_are_recomputed_by_verify(catalog: Catalog) -> None:
    """The one field train does not recompute (a forger's resealed mean) is named by verify."""
    edit_manifest(catalog, set_normalization_mean, reseal=True)
    problems = catalog.verify(PROCESSED, checks=[check_processed])
    assert len(problems) == 1
    assert "statistics.normalization.mean[0] is 0.2942" in problems[0].reason


@pytest.mark.parametrize(
    ("losses", "reference", "reason"),
    [
        ([2.3, 2.2], 2.3, None),
        ([2.3, float("nan")], 2.3, "loss nan"),
        ([float("inf"), 2.2], 2.3, "loss inf"),
        ([2301.0, 2.2], 2.3, "loss 2301, over 1000 times the first step's 2.3"),
        ([1e9], None, None),  # the first step: nothing to compare with yet
    ],
)
def test_divergence_is_a_non_finite_or_exploded_loss_of_any_rank(
    losses: list[float], reference: float | None, reason: str | None
) -> None:
    assert divergence(losses, reference) == reason


def fit_one_rank(
    catalog: Catalog, learning_rate: float, checkpoints: Path, epochs: int = 1
) -> dict[str, Any] | None:
    """The worker's model on the processed training rows with the guard and the checkpoint
    in one process (the allgather of one rank is its own value); where it stopped, or None."""
    import tensorflow as tf

    from training import models
    from training.input import InputSpec, load_split

    manifest = catalog.get(PROCESSED)
    spec = InputSpec.of(ProcessedLayout.of(manifest))
    x, y = load_split(str(catalog.split_dir(manifest, "train")), spec)
    tf.keras.utils.set_random_seed(0)
    model = models.build("cnn", input_shape=spec.input_shape, num_classes=10)
    model.compile(
        optimizer=tf.keras.optimizers.legacy.Adam(learning_rate),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    guard = DivergenceGuard(lambda tensor, name: tensor.numpy())
    checkpoint = EpochCheckpoint(str(checkpoints / "epoch-{epoch:03d}.h5"), guard)
    model.fit(
        x[:512], y[:512], batch_size=32, epochs=epochs, callbacks=[guard, checkpoint], verbose=0
    )
    diverged: dict[str, Any] | None = guard.diverged
    return diverged


def test_a_huge_learning_rate_stops_training_at_the_second_step(
    catalog: Catalog, tmp_path: Path
) -> None:
    diverged = fit_one_rank(catalog, 1e30, tmp_path, epochs=2)
    assert diverged is not None
    assert (diverged["epoch"], diverged["step"]) == (1, 2)
    # NaN on one machine, about 5e29 on another (the same seed: the CPU's kernels differ);
    # both are divergence.
    assert re.fullmatch(
        r"loss nan|loss \S+, over 1000 times the first step's \S+", diverged["reason"]
    ), diverged
    assert list(tmp_path.glob("epoch-*.h5")) == []  # the diverged epoch is not checkpointed


def test_an_exploding_finite_loss_stops_training(catalog: Catalog, tmp_path: Path) -> None:
    diverged = fit_one_rank(catalog, 1e6, tmp_path)
    assert diverged is not None
    assert (diverged["epoch"], diverged["step"]) == (1, 2)
    assert "over 1000 times the first step's" in diverged["reason"]


def test_a_usual_learning_rate_trains_and_checkpoints(catalog: Catalog, tmp_path: Path) -> None:
    assert fit_one_rank(catalog, 0.001, tmp_path) is None
    assert [p.name for p in tmp_path.glob("epoch-*.h5")] == ["epoch-001.h5"]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_diverged_run_commits_nothing(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, checkpointed: bool
) -> None:
    """What rank 0 writes when the guard stopped the ranks becomes one line; the run folder
    goes or stays as after any failed launch: kept only with a checkpoint to resume from."""

    def diverging_launch(
        config: TrainConfig, launch: LaunchConfig, run_dir: Path, progress: Any
    ) -> None:
        if checkpointed:
            (run_dir / "checkpoints").mkdir()
            (run_dir / "checkpoints" / "epoch-001.h5").write_bytes(b"weights")
        where = {"epoch": 2, "step": 7, "reason": "loss nan"}
        (run_dir / DIVERGED_NAME).write_text(json.dumps(where))

    monkeypatch.setattr(launcher, "run_ranks", diverging_launch)
    with pytest.raises(ShardflowError) as raised:
        train(catalog, tmp_path / "runs")
    assert str(raised.value) == (
        "training diverged at epoch 2 step 7 (loss nan): nothing committed; "
        "lower the learning rate (--lr)"
    )
    assert catalog.names() == ["fashion-mnist", PROCESSED]
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == (1 if checkpointed else 0)
