"""training.pipeline_parallel: the split, and that pipelined training is the unsplit maths."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from data_catalog.errors import ConfigError
from training import models
from training import pipeline_parallel as pp
from training.config import LaunchConfig, TrainConfig, check_launch

SHAPE = (32, 32, 3)


@pytest.fixture(scope="module")
def devices() -> list[str]:
    """Two logical CPU devices when this test module is the first to start TensorFlow; when
    another test started it already, the one CPU twice (placement does not change the maths,
    and test_logical_devices checks the devices in a process of its own)."""
    try:
        return pp.configure_devices(2)
    except RuntimeError:
        return ["/CPU:0", "/CPU:0"]


def _build(name: str, seed: int = 0) -> Any:
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    return models.build(name, input_shape=SHAPE, num_classes=10, mean=[0.5] * 3, std=[0.25] * 3)


def _batches(steps: int, batch: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(1)
    return [
        (rng.integers(0, 256, (batch, *SHAPE), dtype=np.uint8), rng.integers(0, 10, batch))
        for _ in range(steps)
    ]


def _compiled(model: Any) -> Any:
    import tensorflow as tf

    model.compile(
        optimizer=tf.keras.optimizers.legacy.SGD(0.05),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _train(model: Any, batches: list[tuple[Any, Any]]) -> list[float]:
    return [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in batches]


@pytest.mark.parametrize("name", ["cnn", "mobilenetv2"])
def test_split_covers_every_layer_once_and_shares_the_variables(
    name: str, devices: list[str]
) -> None:
    model = _build(name)
    stages = pp.split(model, 2)
    assert [s.index for s in stages] == [0, 1]
    # Consecutive: stage 0's output is stage 1's input.
    assert stages[0].model.output.shape[1:] == stages[1].model.input.shape[1:]
    assert stages[1].model.output.shape[1:] == (10,)
    # Every variable of the model is in exactly one stage: the very same objects.
    in_stages = [id(v) for s in stages for v in s.model.weights]
    assert sorted(in_stages) == sorted(id(v) for v in model.weights)
    assert sum(s.parameters for s in stages) == model.count_params()
    # Balanced by FLOPs: MobileNetV2's many blocks split near half; the cnn's second
    # convolution alone outweighs all before it, so the cut falls just before it.
    flops = [s.flops for s in stages]
    if name == "mobilenetv2":
        assert max(flops) < 0.55 * sum(flops)
    else:
        assert stages[1].layers[0].startswith("conv2d")
    # The pipelined forward pass is the model's.
    x = _batches(1, 4)[0][0]
    joined = pp.pipelined(stages, devices=devices, micro_batches=1)
    np.testing.assert_allclose(joined(x, training=False), model(x, training=False), atol=1e-5)


def test_parameter_balance_and_modelled_memory(devices: list[str]) -> None:
    stages = pp.split(_build("mobilenetv2"), 2, balance="parameters")
    parameters = [s.parameters for s in stages]
    assert max(parameters) < 0.75 * sum(parameters)
    rows = pp.modelled_memory(stages, batch_size=16, devices=devices)
    assert [r["device"] for r in rows] == devices
    for row, stage in zip(rows, stages, strict=True):
        assert row["weight_bytes"] == 4 * stage.parameters
        assert row["optimizer_bytes"] == 2 * row["gradient_bytes"]
        assert row["activation_bytes"] == 4 * 16 * stage.activation_values
        assert row["total_bytes"] == sum(
            row[k]
            for k in ("weight_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes")
        )
    # Stage 0 sends its output forward and receives its gradient back; the last sends nothing.
    assert rows[0]["sent_bytes_per_step"] == 2 * 4 * 16 * stages[0].output_values
    assert rows[-1]["sent_bytes_per_step"] == 0


def test_refusals() -> None:
    with pytest.raises(ValueError, match="'dnn' cannot be split into stages; splittable: cnn"):
        pp.split(models.build("dnn", input_shape=(8,), num_classes=3), 2)
    with pytest.raises(ValueError, match="it splits into 1 to 9 stages, not 10"):
        pp.split(_build("cnn"), 10)
    with pytest.raises(ValueError, match="balance must be one of flops, parameters"):
        pp.split(_build("cnn"), 2, balance="bytes")


def test_one_micro_batch_trains_as_the_unsplit_model(devices: list[str]) -> None:
    """MobileNetV2 (BatchNorm included), one micro-batch: the same weights, moving averages
    too, after a few steps."""
    batches = _batches(3, 8)
    whole = _compiled(_build("mobilenetv2"))
    split_source = _build("mobilenetv2")
    split_source.set_weights(whole.get_weights())
    stages = pp.split(split_source, 2)
    joined = _compiled(pp.pipelined(stages, devices=devices, micro_batches=1))
    np.testing.assert_allclose(_train(joined, batches), _train(whole, batches), rtol=1e-4)
    for got, want in zip(split_source.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_micro_batches_train_as_one_batch_without_batchnorm(devices: list[str]) -> None:
    """The cnn has no BatchNorm: 4 micro-batches give the weights of 1 (summing gradients in
    another order is all that differs), and the loss Keras reports is the batch's."""
    batches = _batches(3, 16)
    losses, weights = [], []
    for count in (1, 4):
        stages = pp.split(_build("cnn"), 2)
        joined = _compiled(pp.pipelined(stages, devices=devices, micro_batches=count))
        losses.append(_train(joined, batches))
        weights.append(joined.get_weights())
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for got, want in zip(weights[1], weights[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # And it did train: the weights moved.
    assert not all(
        np.allclose(a, b) for a, b in zip(weights[0], _build("cnn").get_weights(), strict=True)
    )


def test_batchnorm_normalises_each_micro_batch(devices: list[str]) -> None:
    """MobileNetV2 with 2 micro-batches: the loss Keras reports is the mean of the two
    micro-batches' losses, each computed with its own BatchNorm statistics (so it differs
    from the whole batch's, as the module docstring says)."""
    x, y = _batches(1, 8)[0]
    import tensorflow as tf

    whole = _build("mobilenetv2")
    source = _build("mobilenetv2")
    source.set_weights(whole.get_weights())
    joined = _compiled(pp.pipelined(pp.split(source, 2), devices=devices, micro_batches=2))
    # Training-mode losses (BatchNorm on the statistics of what it is given), before any step.
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_half = [float(loss(y[i : i + 4], whole(x[i : i + 4], training=True))) for i in (0, 4)]
    whole_batch = float(loss(y, whole(x, training=True)))
    reported = float(joined.train_on_batch(x, y, return_dict=True)["loss"])
    np.testing.assert_allclose(reported, np.mean(per_half), rtol=1e-4)
    assert abs(reported - whole_batch) > 1e-4


def test_logical_devices_in_a_fresh_process(tmp_path: Any) -> None:
    """configure_devices makes two logical CPU devices, and stage 1's ops run on the second."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(
        "from training import pipeline_parallel as pp\n"
        "devices = pp.configure_devices(2)\n"
        "import tensorflow as tf\n"
        "print(devices, len(tf.config.list_logical_devices('CPU')))\n"
        "with tf.device(devices[1]):\n"
        "    x = tf.ones([2, 2]) @ tf.ones([2, 2])\n"
        "print(x.device)\n"
        "pp.configure_devices(2)\n"
        "try:\n"
        "    pp.configure_devices(3)\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"},
        cwd=str(pp.__file__).rsplit("/training/", 1)[0],
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "['/CPU:0', '/CPU:1'] 2"
    assert lines[1].endswith("device:CPU:1")
    assert lines[2].startswith("refused: TensorFlow started before 3 logical CPU devices")


def test_config_flags_are_checked_and_part_of_the_identity() -> None:
    hybrid = TrainConfig(model="mobilenetv2", batch_size=32, model_stages=2, micro_batches=4)
    assert hybrid.parameters()["model_stages"] == 2
    assert hybrid.parameters()["micro_batches"] == 4
    assert hybrid.parameters() != TrainConfig(model="mobilenetv2", batch_size=32).parameters()
    cases = {
        "must divide --batch-size 32 into equal micro-batches, got 5": dict(
            model_stages=2, micro_batches=5
        ),
        "needs --model-stages 2 or more": dict(micro_batches=2),
        "splits only cnn, mobilenetv2 into stages, not 'resnet50'": dict(
            model="resnet50", model_stages=2
        ),
        "must be at least 1, got 0": dict(model_stages=0),
        "is not supported with --model-stages 2": dict(model_stages=2, backward_passes_per_step=2),
    }
    for message, fields in cases.items():
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**{"batch_size": 32, **fields})  # type: ignore[arg-type]
    # Pipelined runs cannot resume yet: refused from the launch, by the launch's field.
    launches: dict[str, Any] = {"resume": True, "checkpoint_every": 10}
    for field, value in launches.items():
        with pytest.raises(ConfigError, match="is not supported with --model-stages 2") as raised:
            check_launch(TrainConfig(model_stages=2), LaunchConfig(**{field: value}))
        assert raised.value.field == field
        check_launch(TrainConfig(), LaunchConfig(**{field: value}))


def test_train_flags_give_the_hybrid_config() -> None:
    from flows.cli import build_parser
    from flows.options import build, command_line

    hybrid = TrainConfig(model="mobilenetv2", batch_size=32, model_stages=2, micro_batches=4)
    flags = command_line(hybrid, "train")
    # --batch-size 32 is the default: no flag.
    assert flags == ["--model", "mobilenetv2", "--model-stages", "2", "--micro-batches", "4"]
    args = build_parser().parse_args(["train", "cifar10", *flags])
    assert build(TrainConfig, args, "train", environ={}) == hybrid
    args = build_parser().parse_args(["train", "cifar10", "--micro-batches", "3"])
    with pytest.raises(ConfigError, match="must divide --batch-size 32"):
        build(TrainConfig, args, "train", environ={})
