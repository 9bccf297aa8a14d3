"""The models shardflow trains, by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MODELS = ("cnn",)


def build(name: str, *, image_shape: Sequence[int], num_classes: int, augment: bool = False) -> Any:
    """``augment`` adds random shifts of up to 2 pixels while training (inactive at
    inference): never flips, which would turn some digits into others."""
    import tensorflow as tf

    if name != "cnn":
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    layers = tf.keras.layers
    shift = 2 / image_shape[0]
    augmentation = [layers.RandomTranslation(shift, shift, fill_mode="constant")] if augment else []
    return tf.keras.Sequential(
        [
            layers.Input(shape=(*image_shape, 1)),
            *augmentation,
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
            layers.Dense(num_classes),
        ],
        name=name,
    )
