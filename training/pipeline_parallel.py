"""Model parallelism within a rank: a Keras model split into consecutive stages on the rank's
devices, pipelined over micro-batches (GPipe), with Horovod data parallelism across ranks.

    batch of a rank ─ split into M micro-batches
        micro-batch m: stage 0 on device 0 ─ boundary tensor ─ stage 1 on device 1 ─ loss
        backward: stage 1 on device 1 ─ boundary gradient ─ stage 0 on device 0
    gradients of the M micro-batches summed ─ Horovod allreduce (the DistributedOptimizer's)
    ─ one optimizer step

All of a step is one ``tf.function`` (Keras's train function), so TensorFlow's executor runs
stage 1 of micro-batch m while stage 0 works on micro-batch m+1: nothing orders them, and the
inter-op pool has a thread per stage (:func:`inter_op_threads`). Devices are the rank's GPUs
when it sees ``num_stages`` of them (Horovod's pattern for model parallelism: each rank owns
a group of local GPUs), else ``num_stages`` logical CPU devices made before TensorFlow starts
(:func:`configure_devices`). The logical CPU devices share one allocator and one compute
pool: they show the placement and the overlap, not the memory split of separate devices.

The maths is the unsplit model's: with one micro-batch a step gives the same weights; with M,
the loss is the mean of the micro-batches' means (the batch mean, micro-batches being equal)
and the gradients their sum, as for the whole batch. BatchNorm is the exception, as in GPipe:
in training it normalises each micro-batch with that micro-batch's statistics and updates its
moving averages once per micro-batch (M times a step, each with the layer's momentum), so
MobileNetV2 with M > 1 trains like a batch of ``batch_size / M`` for BatchNorm only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Models this module knows how to split (every layer of theirs runs once per call, and each
# has layer boundaries that only one tensor crosses).
SPLITTABLE = ("cnn", "mobilenetv2")
BALANCES = ("flops", "parameters")
# float32 everywhere.
VALUE_BYTES = 4
# Adam (the worker's optimizer) keeps two slots per trainable value.
OPTIMIZER_SLOTS = 2


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a split model: its Keras model and what it costs."""

    index: int
    model: Any
    """A functional Keras model on the original model's layers (the same variables)."""
    layers: tuple[str, ...]
    """Names of its layers, in order."""
    flops: int
    """Multiply-adds per sample, forward (estimated from the layers' shapes)."""
    parameters: int
    trainable_parameters: int
    activation_values: int
    """Values of every layer output of the stage, per sample: what backward needs kept."""
    output_values: int
    """Values of the stage's output per sample: what crosses to the next stage."""


def configure_devices(num_stages: int, *, local_rank: int = 0) -> list[str]:
    """The devices stage 0..num_stages-1 of this rank run on, made visible before TensorFlow
    initialises: local GPUs ``local_rank * num_stages`` onwards when there are enough, else
    ``num_stages`` logical CPU devices. Raises RuntimeError when TensorFlow already started
    with fewer CPU devices (logical devices cannot be added afterwards)."""
    import tensorflow as tf

    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    gpus = tf.config.list_physical_devices("GPU")
    mine = gpus[local_rank * num_stages : (local_rank + 1) * num_stages]
    if len(mine) == num_stages:
        for gpu in mine:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(mine, "GPU")
        return [f"/GPU:{i}" for i in range(num_stages)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_stages)]
        )
    except RuntimeError:
        if len(tf.config.list_logical_devices("CPU")) < num_stages:
            raise RuntimeError(
                f"TensorFlow started before {num_stages} logical CPU devices could be made: "
                "call configure_devices before any TensorFlow op"
            ) from None
    return [f"/CPU:{i}" for i in range(num_stages)]


def inter_op_threads(num_stages: int, threads: int) -> int:
    """Inter-op threads a rank needs: a thread per stage, so that the stages overlap (the
    single-stage choice, ``min(2, threads)``, otherwise)."""
    return max(min(2, threads), num_stages)


@dataclass(frozen=True)
class _Op:
    layer: Any
    args: Any
    kwargs: Any
    inputs: tuple[int, ...]
    outputs: tuple[Any, ...]


def _is_symbolic(value: Any) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.keras.__internal__.KerasTensor)


def _is_functional(layer: Any) -> bool:
    import tensorflow as tf

    # Keras marks functional (graph) models so; subclassed models have no graph to replay.
    return isinstance(layer, tf.keras.Model) and bool(getattr(layer, "_is_graph_network", False))


def _replay(model: Any, inputs: Sequence[Any], ops: list[_Op]) -> list[Any]:
    """Call ``model``'s layers on ``inputs`` in its graph's order, nested functional models
    inlined; appends each call to ``ops``. Returns the outputs."""
    import tensorflow as tf

    values = {id(kt): t for kt, t in zip(model.inputs, inputs, strict=True)}

    def mapped(value: Any) -> Any:
        return values[id(value)] if _is_symbolic(value) else value

    # Keras's own execution order (Functional._run_internal_graph): deepest nodes first.
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if node.is_input:
                continue
            args = tf.nest.map_structure(mapped, node.call_args)
            kwargs = tf.nest.map_structure(mapped, node.call_kwargs)
            if _is_functional(node.layer):
                given = [t for t in tf.nest.flatten((args, kwargs)) if _is_symbolic(t)]
                outputs: Any = _replay(node.layer, given, ops)
            else:
                outputs = node.layer(*args, **kwargs)
                consumed = tuple(id(t) for t in tf.nest.flatten((args, kwargs)) if _is_symbolic(t))
                ops.append(_Op(node.layer, args, kwargs, consumed, tuple(tf.nest.flatten(outputs))))
            for kt, out in zip(
                tf.nest.flatten(node.outputs), tf.nest.flatten(outputs), strict=True
            ):
                values[id(kt)] = out
    return [values[id(kt)] for kt in model.outputs]


def _flat_ops(model: Any) -> tuple[Any, list[_Op], Any]:
    """(input, the layer calls in order, output) of ``model`` with nested models inlined."""
    import tensorflow as tf

    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(f"model {model.name!r} has several inputs or outputs: cannot split it")
    source = model.inputs[0]
    start = tf.keras.Input(shape=source.shape[1:], dtype=source.dtype)
    ops: list[_Op] = []
    (end,) = _replay(model, [start], ops)
    seen: set[int] = set()
    for op in ops:
        if id(op.layer) in seen:
            raise ValueError(f"layer {op.layer.name!r} runs twice: cannot split {model.name!r}")
        seen.add(id(op.layer))
    return start, ops, end


def cut_points(ops: Sequence[_Op], start: Any, end: Any) -> dict[int, Any]:
    """{k: the one tensor that crosses} for every boundary between call k-1 and call k that
    only one tensor crosses (a residual connection spanning it rules it out)."""
    produced = {id(start): -1}
    for index, op in enumerate(ops):
        for out in op.outputs:
            produced[id(out)] = index
    last_use = {id(start): -1}
    for index, op in enumerate(ops):
        for tensor in op.inputs:
            last_use[tensor] = index
    last_use[id(end)] = len(ops)
    by_id = {id(start): start, **{id(out): out for op in ops for out in op.outputs}}
    cuts = {}
    for k in range(1, len(ops)):
        live = [t for t, p in produced.items() if p < k <= last_use.get(t, -1)]
        if len(live) == 1:
            cuts[k] = by_id[live[0]]
    return cuts


def _values(shape: Any) -> int:
    return int(math.prod(int(d) for d in shape[1:]))


def layer_flops(layer: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
    """Multiply-adds per sample of one layer call, from its shapes: convolutions and dense
    layers by their kernels, everything else one per output value."""
    import tensorflow as tf

    out = sum(_values(t.shape) for t in outputs)
    layers = tf.keras.layers
    if isinstance(layer, layers.DepthwiseConv2D):
        height, width = layer.kernel_size
        return int(height * width * out)
    if isinstance(layer, layers.Conv2D):
        height, width = layer.kernel_size
        channels = int(inputs[0].shape[-1])
        return int(height * width * channels * out // max(1, layer.groups))
    if isinstance(layer, layers.Dense):
        return int(inputs[0].shape[-1]) * out
    return out


def split(model: Any, num_stages: int, *, balance: str = "flops") -> list[Stage]:
    """``model`` (built by training.models.build) as ``num_stages`` consecutive stages, cut at
    layer boundaries that one tensor crosses, each near an equal share of ``balance`` (the
    forward FLOPs, which set a stage's time, or the parameter count). The stages share the
    model's layers and variables: training them trains ``model``."""
    import tensorflow as tf

    if model.name not in SPLITTABLE:
        raise ValueError(
            f"model {model.name!r} cannot be split into stages; splittable: {', '.join(SPLITTABLE)}"
        )
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    if model.losses:
        raise ValueError(f"model {model.name!r} has regularisation losses: not supported")
    start, ops, end = _flat_ops(model)
    cuts = cut_points(ops, start, end)
    if num_stages < 1 or num_stages - 1 > len(cuts):
        raise ValueError(
            f"model {model.name!r} has {len(cuts)} boundaries one tensor crosses: it splits "
            f"into 1 to {len(cuts) + 1} stages, not {num_stages}"
        )
    by_id = {id(start): start, **{id(o): o for op in ops for o in op.outputs}}

    def cost(op: _Op) -> int:
        if balance == "parameters":
            return int(op.layer.count_params()) if op.layer.weights else 0
        return layer_flops(op.layer, [by_id[t] for t in op.inputs], op.outputs)

    costs = [cost(op) for op in ops]
    total = sum(costs)
    cumulative = [sum(costs[:k]) for k in range(len(ops) + 1)]
    chosen: list[int] = []
    for stage in range(1, num_stages):
        # The boundary nearest this stage's share, after the previous one, leaving enough
        # boundaries for the stages still to come.
        later = [k for k in sorted(cuts) if not chosen or k > chosen[-1]]
        usable = later[: len(later) - (num_stages - 1 - stage)]
        target = total * stage / num_stages
        chosen.append(min(usable, key=lambda k: abs(cumulative[k] - target)))
    bounds = [0, *chosen, len(ops)]
    stages = []
    for index in range(num_stages):
        first, last = bounds[index], bounds[index + 1]
        given = start if first == 0 else cuts[first]
        taken = end if last == len(ops) else cuts[last]
        stage_input = tf.keras.Input(shape=given.shape[1:], dtype=given.dtype)
        values = {id(given): stage_input}

        def mapped(value: Any, values: dict[int, Any] = values) -> Any:
            return values[id(value)] if _is_symbolic(value) else value

        for op in ops[first:last]:
            args = tf.nest.map_structure(mapped, op.args)
            kwargs = tf.nest.map_structure(mapped, op.kwargs)
            outputs = op.layer(*args, **kwargs)
            for kt, out in zip(op.outputs, tf.nest.flatten(outputs), strict=True):
                values[id(kt)] = out
        stage_model = tf.keras.Model(
            stage_input, values[id(taken)], name=f"{model.name}_stage_{index}"
        )
        part = ops[first:last]
        stages.append(
            Stage(
                index=index,
                model=stage_model,
                layers=tuple(op.layer.name for op in part),
                flops=sum(costs[first:last])
                if balance == "flops"
                else sum(
                    layer_flops(op.layer, [by_id[t] for t in op.inputs], op.outputs) for op in part
                ),
                parameters=int(sum(_size(w) for w in stage_model.weights)),
                trainable_parameters=int(sum(_size(w) for w in stage_model.trainable_weights)),
                activation_values=sum(_values(o.shape) for op in part for o in op.outputs),
                output_values=_values(taken.shape),
            )
        )
    return stages


def whole(model: Any) -> list[Stage]:
    """Any model (unsplit, its layers called once) as a single stage, for
    :func:`modelled_memory` of data parallelism alone."""
    import tensorflow as tf

    def leaves(outer: Any) -> list[Any]:
        found = []
        for layer in outer.layers:
            if _is_functional(layer):
                found += leaves(layer)
            elif not isinstance(layer, tf.keras.layers.InputLayer):
                found.append(layer)
        return found

    layers = leaves(model)
    return [
        Stage(
            index=0,
            model=model,
            layers=tuple(layer.name for layer in layers),
            flops=sum(
                layer_flops(layer, tf.nest.flatten(layer.input), tf.nest.flatten(layer.output))
                for layer in layers
            ),
            parameters=int(sum(_size(w) for w in model.weights)),
            trainable_parameters=int(sum(_size(w) for w in model.trainable_weights)),
            activation_values=sum(_values(layer.output.shape) for layer in layers),
            output_values=_values(model.output.shape),
        )
    ]


def _size(variable: Any) -> int:
    return int(math.prod(int(d) for d in variable.shape))


def modelled_memory(
    stages: Sequence[Stage], *, batch_size: int, devices: Sequence[str]
) -> list[dict[str, Any]]:
    """Bytes each device holds for its stage during a step, computed from shapes (float32):
    weights, gradients, Adam's two slots, and every layer output of the stage for the whole
    batch (GPipe keeps each micro-batch's activations until its backward pass, so all M are
    held at the peak). An upper bound for activations: TensorFlow frees outputs no gradient
    needs."""
    rows = []
    for stage, device in zip(stages, devices, strict=True):
        weights = stage.parameters * VALUE_BYTES
        gradients = stage.trainable_parameters * VALUE_BYTES
        optimizer = OPTIMIZER_SLOTS * stage.trainable_parameters * VALUE_BYTES
        activations = stage.activation_values * batch_size * VALUE_BYTES
        rows.append(
            {
                "stage": stage.index,
                "device": device,
                "layers": len(stage.layers),
                "first_layer": stage.layers[0],
                "last_layer": stage.layers[-1],
                "parameters": stage.parameters,
                "flops_per_sample": stage.flops,
                "weight_bytes": weights,
                "gradient_bytes": gradients,
                "optimizer_bytes": optimizer,
                "activation_bytes": activations,
                "total_bytes": weights + gradients + optimizer + activations,
                # Forward activations and backward gradients between this stage and the next.
                "sent_bytes_per_step": 2 * stage.output_values * batch_size * VALUE_BYTES
                if stage.index < len(stages) - 1
                else 0,
            }
        )
    return rows


def measured_memory(devices: Sequence[str]) -> dict[str, Any]:
    """What this process can measure of its memory: the peak resident set (always), and the
    allocator's peak bytes in use per device where TensorFlow tracks them (GPUs; on CPU only
    with ``TF_CPU_ALLOCATOR_USE_BFC=true``, and then every CPU device reports the one shared
    allocator, so the figure is the rank's, not a device's)."""
    import resource

    import tensorflow as tf

    allocator: dict[str, int] = {}
    for device in devices:
        # "Allocator stats not available": the default CPU allocator keeps none.
        with contextlib.suppress(ValueError):
            allocator[device] = int(
                tf.config.experimental.get_memory_info(device.lstrip("/"))["peak"]
            )
    shared = bool(allocator) and all(d.startswith("/CPU") for d in allocator)
    return {
        # ru_maxrss is in kilobytes on Linux.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "allocator_peak_bytes": allocator or None,
        "allocator_shared_by_devices": shared,
    }


def pipelined(stages: Sequence[Stage], *, devices: Sequence[str], micro_batches: int) -> Any:
    """A Keras model running ``stages`` on ``devices``, whose training step pipelines
    ``micro_batches`` micro-batches through them (see the module docstring); compile and fit
    it like any model. Its variables are the stages' (the split model's)."""
    import tensorflow as tf

    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages for {len(devices)} devices")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")

    class PipelinedModel(tf.keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(name=stages[0].model.name.rsplit("_stage_", 1)[0])
            self.stage_models = [s.model for s in stages]
            self.devices = list(devices)
            self.micro_batches = micro_batches

        def call(self, inputs: Any, training: Any = None) -> Any:
            x = inputs
            for stage, device in zip(self.stage_models, self.devices, strict=True):
                with tf.device(device):
                    x = stage(x, training=training)
            return x

        def train_step(self, data: Any) -> Any:
            x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
            if sample_weight is not None:
                raise ValueError("pipelined training takes no sample weights")
            count = self.micro_batches
            sums: list[list[Any]] = [
                [tf.zeros_like(v) for v in s.trainable_variables] for s in self.stage_models
            ]
            logits = []
            for x_part, y_part in zip(tf.split(x, count), tf.split(y, count), strict=True):
                tapes, ins, targets = [], [], []
                last = len(self.stage_models) - 1
                h = x_part
                # Forward, stage by stage, each on its device.
                for number, (stage, device) in enumerate(
                    zip(self.stage_models, self.devices, strict=True)
                ):
                    with tf.device(device), tf.GradientTape() as tape:
                        tape.watch(h)
                        out = stage(h, training=True)
                        # The last stage's target: the micro-batch's mean loss (this also
                        # feeds Keras's loss tracker, weighted by its rows) over M: summed over
                        # the micro-batches, the batch's mean loss.
                        target = (
                            self.compute_loss(x_part, y_part, out, None) / count
                            if number == last
                            else out
                        )
                    tapes.append(tape)
                    ins.append(h)
                    targets.append(target)
                    h = out
                logits.append(h)
                # Backward, last stage first, the boundary's gradient handed back.
                upstream = None
                for number in reversed(range(len(self.stage_models))):
                    stage, device = self.stage_models[number], self.devices[number]
                    sources = list(stage.trainable_variables)
                    if number > 0:
                        sources.append(ins[number])
                    with tf.device(device):
                        grads = tapes[number].gradient(
                            targets[number], sources, output_gradients=upstream
                        )
                        if number > 0:
                            upstream = grads.pop()
                        sums[number] = [
                            total if g is None else total + g
                            for total, g in zip(sums[number], grads, strict=True)
                        ]
            variables = [v for s in self.stage_models for v in s.trainable_variables]
            gradients = [g for stage_sums in sums for g in stage_sums]
            # Horovod: average across ranks with the DistributedOptimizer's own allreduce (what
            # its compute_gradients does after a tape; Keras's minimize takes one tape, not a
            # gradient per stage). Without Horovod's optimizer: the local gradients.
            allreduce = getattr(self.optimizer, "_allreduce", None)
            if allreduce is not None:
                gradients = allreduce(gradients, variables)
            self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
            return self.compute_metrics(x, y, tf.concat(logits, axis=0), None)

    model = PipelinedModel()
    return model
