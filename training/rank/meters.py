"""What a rank measures while it trains, each a Keras callback of its own: each epoch's wall
time (:class:`EpochTimer`), the bytes it hands to allreduce (:class:`AllreduceMeter`, fed by
:func:`counting_compression`), the bytes it sends on the interfaces (:class:`WireMeter`); and
:class:`EpochPublisher`, which hands rank 0 every rank's input figures after each epoch (the
input meter itself is training.input_metrics.step_meter)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from training.input_metrics import EpochLog, epoch_line


class EpochTimer(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """Each epoch's wall time, in ``.seconds``."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._started = 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def counting_compression(compression: Any, counter: Any) -> Any:
    """Horovod compression that adds the bytes of every tensor it hands to allreduce (after
    compression) to ``counter``: the allreduce payload, measured where Horovod sends it."""

    class Counting(compression):  # type: ignore[misc]  # Horovod is untyped
        @staticmethod
        def compress(tensor: Any) -> Any:
            compressed, context = compression.compress(tensor)
            size = tf.cast(tf.size(compressed), tf.int64) * compressed.dtype.size
            counter.assign_add(size)
            return compressed, context

        @staticmethod
        def decompress(tensor: Any, context: Any) -> Any:
            return compression.decompress(tensor, context)

    return Counting


class AllreduceMeter(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """The counter's growth over each epoch, in ``.per_epoch``."""

    def __init__(self, counter: Any) -> None:
        super().__init__()
        self.counter = counter
        self.per_epoch: list[int] = []
        self._start = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = int(self.counter.numpy())

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.per_epoch.append(int(self.counter.numpy()) - self._start)


def interface_counters(interfaces: Sequence[str]) -> tuple[int, int] | None:
    """(bytes, packets) sent so far on ``interfaces`` of this process's network namespace,
    summed; None when one of them is not there.

    psutil reads them from /proc/net/dev, which (unlike /sys/class/net) always shows the
    calling process's namespace (``psutil._pslinux.net_io_counters``)."""
    import psutil

    sent = psutil.net_io_counters(pernic=True)
    if not all(name in sent for name in interfaces):
        return None
    return (
        sum(sent[n].bytes_sent for n in interfaces),
        sum(sent[n].packets_sent for n in interfaces),
    )


Sample = tuple[tuple[int, int] | None, float]


class WireMeter(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """What this rank sent on ``interfaces`` over each epoch (``.bytes_by_epoch``,
    ``.packets_by_epoch``, ``.seconds_by_epoch``, from the interface counters at the epoch's
    boundaries) and before training, while only Horovod's control loop talks (``.idle``:
    bytes, packets, seconds from :meth:`start` to the first batch)."""

    def __init__(self, interfaces: Sequence[str]) -> None:
        super().__init__()
        self.interfaces = list(interfaces)
        self.bytes_by_epoch: list[int] = []
        self.packets_by_epoch: list[int] = []
        self.seconds_by_epoch: list[float] = []
        self.idle: tuple[int, int, float] | None = None
        self._start: Sample = (None, 0.0)

    @classmethod
    def started(cls, network_interface: str | None) -> WireMeter | None:
        """A meter on the comma-separated ``network_interface``, started; None without one."""
        if not network_interface:
            return None
        meter = cls(network_interface.split(","))
        meter.start()
        return meter

    def _sample(self) -> Sample:
        return interface_counters(self.interfaces), time.perf_counter()

    def start(self) -> None:
        self._start = self._sample()

    def on_train_begin(self, logs: Any = None) -> None:
        (before, started), (after, now) = self._start, self._sample()
        if before is not None and after is not None:
            self.idle = (after[0] - before[0], after[1] - before[1], now - started)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = self._sample()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        (before, started), (after, now) = self._start, self._sample()
        if before is not None and after is not None:
            self.bytes_by_epoch.append(after[0] - before[0])
            self.packets_by_epoch.append(after[1] - before[1])
            self.seconds_by_epoch.append(now - started)

    def report(self) -> dict[str, Any]:
        return {
            "bytes_by_epoch": self.bytes_by_epoch,
            "packets_by_epoch": self.packets_by_epoch,
            "seconds_by_epoch": self.seconds_by_epoch,
            "idle_bytes": self.idle[0] if self.idle else None,
            "idle_packets": self.idle[1] if self.idle else None,
            "idle_seconds": self.idle[2] if self.idle else None,
        }


class EpochPublisher:
    """The input meter's ``on_epoch``: every rank's figures of an epoch to rank 0, which
    rewrites the per-epoch file and says so (the launcher's caller reads it while training
    goes on)."""

    def __init__(
        self, rank: int, path: Path, allgather_object: Callable[[Any, str], list[Any]]
    ) -> None:
        self.rank = rank
        self.log = EpochLog(path)
        self.allgather_object = allgather_object

    def __call__(self, epoch: int, record: dict[str, Any]) -> None:
        # Horovod: every rank's figures of this epoch, in rank order.
        gathered = self.allgather_object(record, "input_epoch")
        if self.rank == 0:
            self.log.add(epoch, gathered)
            print(epoch_line(epoch, self.log.path), flush=True)
