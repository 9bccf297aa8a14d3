"""The models shardflow trains, by name.

Every model holds the processed version's statistics in a Normalization layer (mean and
standard deviation over the training split, per channel or per feature), its first layer for
the dnn and, for an image model, right after the layer that scales uint8 pixels to pixel/255
(on the accelerator where there is one). So a saved model takes what the reader gives it:
uint8 pixels as they are stored, or raw SDSS features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

IMAGE_MODELS = ("cnn", "mobilenetv2", "resnet50")
TABULAR_MODELS = ("dnn",)
MODELS = (*IMAGE_MODELS, *TABULAR_MODELS)
# Keras applications need at least 32 x 32 pixels; smaller images (MNIST's 28 x 28) are padded.
_APPLICATION_MIN_SIDE = 32
# Moving-statistics momentum of the Keras applications' BatchNormalization layers (see build).
BATCH_NORM_MOMENTUM = 0.9
# Words of a Philox generator state that are its counter: the state is [counter (2), key (1)]
# (tensorflow/python/ops/stateful_random_ops.py, Generator._prepare_key_counter).
_COUNTER_WORDS = 2


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
    if name in IMAGE_MODELS:
        # uint8 pixels in, scaled in the model: the host hands over a quarter of float32's
        # bytes and does no arithmetic on them (docs/training.md, "Feeding accelerators").
        inputs = layers.Input(shape=shape, dtype="uint8")
        x = layers.Rescaling(1 / 255)(inputs)
    else:
        inputs = layers.Input(shape=shape)
        x = inputs
    if mean is not None and std is not None:
        variance = [max(float(s), 1e-6) ** 2 for s in std]
        x = layers.Normalization(axis=-1, mean=list(mean), variance=variance)(x)
    if name == "dnn":
        x = layers.Dense(128, activation="relu")(x)
        # A tf.random.Generator, not Keras's default TF1 stateful ops: their state lives in the
        # op kernels, where no checkpoint reaches it (see random_generators).
        x = layers.Dropout(0.1, rng_type="stateful")(x)
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
        # Keras's BatchNormalization keeps moving statistics with momentum 0.99: a mean over
        # the last ~100 steps. Trained from random weights on a few thousand images (a few
        # hundred steps), the weights move faster than that mean follows, and at inference
        # the stale statistics drive every image to one class (ResNet50 on MNIST: 84 %
        # training accuracy, 13 % validation, after two epochs). 0.9 follows the last ~10.
        for layer in backbone.layers:
            if isinstance(layer, layers.BatchNormalization):
                layer.momentum = BATCH_NORM_MOMENTUM
        return tf.keras.Model(inputs, backbone(x), name=name)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def random_generators(model: Any) -> list[Any]:
    """The ``tf.random.Generator`` of every random layer of ``model`` (Dropout,
    RandomTranslation), in a fixed order (``tf.Module.submodules``).

    Keras 2.15's random layers (``BaseRandomLayer``) draw through a ``backend.RandomGenerator``;
    with rng_type "stateful" (RandomTranslation forces it, ``build`` asks it of Dropout) that
    holds a ``tf.random.Generator`` whose whole state is one int64 variable. Keras keeps it out
    of ``model.weights`` and checkpoints on purpose (``BaseRandomLayer.__init__``), and offers no
    public accessor: hence ``_random_generator._generator``.
    """
    generators = []
    for layer in model.submodules:
        wrapper = getattr(layer, "_random_generator", None)
        if wrapper is None:
            continue
        wrapper._maybe_init()
        if wrapper._rng_type != "stateful":
            raise TypeError(
                f"layer {layer.name!r} draws with rng_type {wrapper._rng_type!r}, whose state "
                "cannot be saved; build it with rng_type='stateful'"
            )
        generators.append(wrapper._generator)
    return generators


def seed_random_layers(model: Any, *, seed: int, rank: int) -> None:
    """Give each random layer of ``model`` a Philox key of its own from (seed, rank, layer)
    and start its counter at 0.

    Each rank draws its own dropout masks and shifts (Keras would seed every rank's layers
    alike from ``set_random_seed``, masking the same positions of every rank's batch). The
    counter advances by an amount fixed by the shape drawn, the same on every rank at every
    step, so rank 0's counters are every rank's and are all a step checkpoint needs
    (:func:`random_counters`).
    """
    for index, generator in enumerate(random_generators(model)):
        key = np.random.SeedSequence([seed % 2**64, rank, index]).generate_state(1, np.uint64)
        generator.reset(np.concatenate([np.zeros(_COUNTER_WORDS, np.int64), key.view(np.int64)]))


def random_counters(model: Any) -> list[Any]:
    """The counter of each random layer's generator: where its stream stands."""
    return [g.state.numpy()[:_COUNTER_WORDS] for g in random_generators(model)]


def restore_random_counters(model: Any, counters: Sequence[Any]) -> None:
    """Set the random layers' counters (from :func:`random_counters`), keeping their keys."""
    generators = random_generators(model)
    if len(counters) != len(generators):
        raise ValueError(
            f"{len(counters)} random counters for the {len(generators)} random layers of "
            f"model {model.name!r}"
        )
    for generator, counter in zip(generators, counters, strict=True):
        key = generator.state.numpy()[_COUNTER_WORDS:]
        generator.reset(np.concatenate([np.asarray(counter, np.int64), key]))
