"""The models shardflow trains, by name.

Every model starts with a Normalization layer holding the processed version's statistics
(mean and standard deviation over the training split, per channel or per feature), so a saved
model takes what the reader gives it: pixel/255 or raw SDSS features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

IMAGE_MODELS = ("cnn", "mobilenetv2", "resnet50")
TABULAR_MODELS = ("dnn",)
MODELS = (*IMAGE_MODELS, *TABULAR_MODELS)
# Keras applications need at least 32 x 32 pixels; smaller images (MNIST's 28 x 28) are padded.
_APPLICATION_MIN_SIDE = 32


def check(name: str, kind: str) -> None:
    """Raise ValueError unless model ``name`` suits a dataset of ``kind``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    suited = IMAGE_MODELS if kind == "images" else TABULAR_MODELS
    if name not in suited:
        raise ValueError(
            f"model {name!r} does not take {kind} data; for {kind} use: {', '.join(suited)}"
        )


def build(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    augment: bool = False,
) -> Any:
    """A Keras model ending in logits.

    ``augment`` adds random shifts of up to 2 pixels while training (inactive at inference):
    never flips, which would turn some digits into others.
    """
    import tensorflow as tf

    layers = tf.keras.layers
    shape = tuple(int(d) for d in input_shape)
    inputs = layers.Input(shape=shape)
    x = inputs
    if mean is not None and std is not None:
        variance = [max(float(s), 1e-6) ** 2 for s in std]
        x = layers.Normalization(axis=-1, mean=list(mean), variance=variance)(x)
    if name == "dnn":
        x = layers.Dense(128, activation="relu")(x)
        x = layers.Dropout(0.1)(x)
        x = layers.Dense(64, activation="relu")(x)
        x = layers.Dense(32, activation="relu")(x)
        return tf.keras.Model(inputs, layers.Dense(num_classes)(x), name=name)
    if augment:
        shift = 2 / shape[0]
        x = layers.RandomTranslation(shift, shift, fill_mode="constant")(x)
    if name == "cnn":
        x = layers.Conv2D(32, 3, activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(64, 3, activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Flatten()(x)
        x = layers.Dense(128, activation="relu")(x)
        return tf.keras.Model(inputs, layers.Dense(num_classes)(x), name=name)
    if name in ("mobilenetv2", "resnet50"):
        side = max(_APPLICATION_MIN_SIDE, shape[0], shape[1])
        pad_rows, pad_cols = side - shape[0], side - shape[1]
        if pad_rows or pad_cols:
            x = layers.ZeroPadding2D(
                (
                    (pad_rows // 2, pad_rows - pad_rows // 2),
                    (pad_cols // 2, pad_cols - pad_cols // 2),
                )
            )(x)
        application = (
            tf.keras.applications.MobileNetV2
            if name == "mobilenetv2"
            else tf.keras.applications.ResNet50
        )
        # Random initialisation (weights=None): ImageNet weights expect 3 channels and far
        # larger images than these.
        backbone = application(
            input_shape=(side, side, shape[2]),
            weights=None,
            include_top=True,
            classes=num_classes,
            classifier_activation=None,
        )
        return tf.keras.Model(inputs, backbone(x), name=name)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
