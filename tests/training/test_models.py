"""Models by name: the right input, logits out, normalisation inside, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

from training import models


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("cnn", (28, 28, 1)),
        ("mobilenetv2", (32, 32, 3)),
        ("mobilenetv2", (28, 28, 1)),
        ("resnet50", (32, 32, 3)),
    ],
)
def test_image_models_give_logits_per_class(name: str, shape: tuple[int, ...]) -> None:
    model = models.build(
        name, input_shape=shape, num_classes=10, mean=[0.5] * shape[-1], std=[0.25] * shape[-1]
    )
    out = model.predict(np.zeros((2, *shape), np.uint8), verbose=0)
    assert out.shape == (2, 10)


def test_image_models_take_uint8_pixels_and_scale_them() -> None:
    # The reader hands over pixels as stored; the model's first layer makes them pixel / 255,
    # which the Normalization layer's statistics are of.
    model = models.build("cnn", input_shape=(12, 12, 1), num_classes=3, mean=[0.5], std=[0.25])
    assert model.inputs[0].dtype == "uint8"
    pixels = np.array([0, 51, 255, 128] * 36, np.uint8).reshape(1, 12, 12, 1)
    scale, normalise = model.layers[1], model.layers[2]
    np.testing.assert_allclose(
        normalise(scale(pixels)).numpy().ravel(), ((pixels / 255 - 0.5) / 0.25).ravel(), atol=1e-6
    )


def test_dnn_normalises_its_features() -> None:
    mean, std = [10.0, -3.0, 100.0], [2.0, 1.0, 50.0]
    model = models.build("dnn", input_shape=(3,), num_classes=3, mean=mean, std=std)
    normalise = model.layers[1]
    x = np.array([[12.0, -3.0, 0.0]], np.float32)
    np.testing.assert_allclose(normalise(x).numpy(), [[1.0, 0.0, -2.0]], rtol=1e-5)
    assert model.predict(x, verbose=0).shape == (1, 3)


def test_a_model_must_suit_the_data() -> None:
    with pytest.raises(ValueError, match="does not take tabular data; for tabular use: dnn"):
        models.check("resnet50", "tabular")
    with pytest.raises(ValueError, match="for images use: cnn, mobilenetv2, resnet50"):
        models.check("dnn", "images")


def test_each_rank_draws_its_own_dropout_masks_from_the_seed() -> None:
    def masks(rank: int) -> tuple[np.ndarray, list[np.ndarray]]:
        model = models.build("dnn", input_shape=(3,), num_classes=3)
        models.seed_random_layers(model, seed=5, rank=rank)
        dropout = next(layer for layer in model.layers if layer.name.startswith("dropout"))
        drawn = dropout(np.ones((64, 128), np.float32), training=True).numpy() == 0
        return drawn, models.random_counters(model)

    (rank_0, counters_0), (again, _), (rank_1, counters_1) = masks(0), masks(0), masks(1)
    assert np.array_equal(rank_0, again)
    assert not np.array_equal(rank_0, rank_1) and 0 < rank_1.mean() < 0.3
    # The same draws move every rank's counter alike: rank 0's stand for all of them.
    assert [c.tolist() for c in counters_0] == [c.tolist() for c in counters_1] != [[0, 0]]
