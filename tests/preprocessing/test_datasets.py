"""The dataset registry: every dataset declared once, and everything else reads it."""

from __future__ import annotations

import pytest

from data_catalog.errors import ShardflowError
from preprocessing import datasets
from training import models


def test_every_dataset_has_a_known_model_and_format() -> None:
    for spec in datasets.DATASETS.values():
        models.check(spec.default_model, spec.kind)  # raises if the model does not fit
        assert spec.default_format in ("parquet", "petastorm")
        assert spec.name in datasets.NAMES


def test_sdss_trains_dnn_and_images_cnn() -> None:
    assert datasets.dataset("sdss").default_model == "dnn"
    assert {datasets.dataset(n).default_model for n in ("mnist", "fashion-mnist", "cifar10")} == {
        "cnn"
    }


def test_unknown_dataset_is_one_line() -> None:
    with pytest.raises(ShardflowError, match="unknown dataset 'imagenet'; known: mnist"):
        datasets.dataset("imagenet")


def test_the_cli_offers_exactly_the_registry() -> None:
    from flows.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[union-attr]
    for command in ("ingest", "preprocess", "train", "run", "synth"):
        dataset = next(a for a in commands[command]._actions if a.dest == "dataset")
        assert tuple(dataset.choices) == datasets.NAMES
