"""The ring allreduce model of data-parallel scaling: fit it to measured allreduce times, check
it on points it was not fitted to, and predict images/s and scaling efficiency for N GPUs.

    measured points (N, link Mbit/s or None, bytes S, seconds)
      │ fit (weighted least squares, every coefficient >= 0, relative errors)
      ▼
    t(N, S, B) = alpha + lam * 2(N-1) + 2(N-1)/N * S / (eta * B) + c / B   a link of B bytes/s
    t(N, S)    = alpha + lam * 2(N-1) + N * 2(N-1)/N * S / machine       no rate limit, N >= 3
    t(2, S)    = alpha + lam * 2 + S / veth_pair                           no rate limit, N = 2
      │ predict (published per-GPU step times, 10/25/100 Gbit/s links)
      ▼
    step(N) = t_compute + allreduces * (alpha + lam * 2(N-1) + c / B) + 2(N-1)/N * S / (eta * B)
    efficiency(N) = t_compute / step(N); images/s = N * batch / step(N)

- ``2(N-1)/N * S`` is what each rank sends in a ring allreduce (reduce-scatter, then
  allgather) of S bytes; every rank's link carries it at once, so time is bytes / link rate.
- ``eta``: the share of a link's rate that carries allreduce payload in a ring of three or more
  (Ethernet, IP and TCP headers, ACKs, and the pauses of a ring whose every step forwards what
  the previous one brought). ``eta_pair``: the same for N = 2, fitted apart when points of both
  are given (measured here: about 0.91 for two ranks, 0.82 for three and four).
- ``alpha``: a fixed cost per allreduce (Horovod's negotiation cycle, the op's dispatch);
  ``lam``: a cost per ring step (2(N-1) steps, each a message hop and a wake-up of a rank).
- ``c``: bytes on the wire per allreduce besides its payload (Horovod's negotiation messages,
  Gloo's headers), which cost time only on a slow link (at 1 Mbit/s, 1 kB is 8 ms).
- The fit's spread: ``bootstrap`` redoes it on resamples of each point's repeats (drawn with
  replacement, their median taken), so every coefficient and every prediction made from it has
  a 5-95 % range (``spread``): the uncertainty the repeats leave, on the machine they ran on.
- ``machine``: with no rate limit the namespaced hosts are not on a network but on this
  machine's shared CPU cores (every segment through the kernel's stack). Three or more ranks
  together move what the cores can: the time goes with the bytes *all* ranks send,
  N * 2(N-1)/N * S, over what the machine moves per second. ``veth_pair``: two ranks stay
  below that (each rank's one peer is both of its ring neighbours; measured on an idle machine:
  2 ranks moved about 580 Mbit/s of payload in all, 3 and 4 ranks about 1 Gbit/s), so N = 2
  has a per-rank rate of its own, fitted apart when points of both are given, as ``eta_pair``
  is. Properties of the machine, not of a network: fitted, never predicted with.

Pure functions: no I/O, no Horovod.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Horovod's default fusion buffer (HOROVOD_FUSION_THRESHOLD, 64 MiB): gradients are
# allreduced in buffers of up to this size, each a collective with its own latency.
FUSION_THRESHOLD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Point:
    """One measured allreduce: the median time of ``bytes`` over ``num_ranks`` ranks."""

    num_ranks: int
    mbit: float | None
    """The links' rate limit in Mbit/s; None: no limit."""
    bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Fit:
    """The fitted model (see the module docstring)."""

    alpha: float
    """Seconds per allreduce."""
    lam: float
    """Seconds per ring step (2(N-1) per allreduce)."""
    eta: float | None
    """Payload share of a rate-limited link in a ring of 3 or more (of all rings when no
    ``eta_pair``); None: no rate-limited points."""
    overhead_bytes: float
    """Bytes on a rate-limited link per allreduce besides the payload (c)."""
    unlimited_bytes_per_second: float | None
    """What all ranks together send per second with no rate limit, on this machine
    (``machine``; of every N when no ``veth_pair``); None: no unlimited points."""
    points: int
    """How many points it was fitted on."""
    eta_pair: float | None = None
    """Payload share of a rate-limited link for N = 2; None: ``eta`` holds for N = 2 too."""
    veth_pair: float | None = None
    """Payload bytes per second of each rank with no rate limit for N = 2; None: ``machine``
    holds for N = 2 too."""

    def link_share(self, num_ranks: int) -> float | None:
        return self.eta_pair if num_ranks == 2 and self.eta_pair else self.eta


@dataclass(frozen=True, kw_only=True)
class Repeats:
    """One measured allreduce with every repeat's time: a ``Point`` before its median."""

    num_ranks: int
    mbit: float | None
    bytes: int
    seconds: tuple[float, ...]

    def point(self, seconds: Sequence[float] | None = None) -> Point:
        """The point of the median of ``seconds`` (default: of every repeat)."""
        chosen = self.seconds if seconds is None else seconds
        if len(chosen) == 0:
            raise ValueError(f"no repeats of {self.bytes} bytes over {self.num_ranks} ranks")
        return Point(num_ranks=self.num_ranks, mbit=self.mbit, bytes=self.bytes,
                     seconds=float(np.median(chosen)))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Spread:
    """The median and a percentile range of one figure over bootstrap resamples."""

    median: float
    low: float
    high: float
    low_percent: float = 5.0
    high_percent: float = 95.0

    @property
    def width(self) -> float:
        return self.high - self.low


def spread(values: Sequence[float], low_percent: float = 5.0, high_percent: float = 95.0) -> Spread:
    """Median and ``low_percent``-``high_percent`` range of ``values``."""
    if not values:
        raise ValueError("no values to take a spread of")
    array = np.asarray(values, dtype=float)
    low, median, high = np.percentile(array, [low_percent, 50.0, high_percent])
    return Spread(median=float(median), low=float(low), high=float(high),
                  low_percent=low_percent, high_percent=high_percent)  # fmt: skip


def ring_bytes(num_ranks: int, size: float) -> float:
    """Bytes each rank sends in a ring allreduce of ``size`` bytes over ``num_ranks`` ranks."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    return 2 * (num_ranks - 1) / num_ranks * size


def link_bytes_per_second(mbit: float) -> float:
    return mbit * 1e6 / 8


def allreduce_seconds(fit: Fit, num_ranks: int, size: float, mbit: float | None) -> float:
    """The model's time of one allreduce of ``size`` bytes."""
    if num_ranks == 1:
        return 0.0
    latency = fit.alpha + fit.lam * 2 * (num_ranks - 1)
    if mbit is None:
        if num_ranks == 2 and fit.veth_pair:
            return latency + ring_bytes(num_ranks, size) / fit.veth_pair
        if not fit.unlimited_bytes_per_second:
            raise ValueError("the fit has no unlimited-link throughput")
        return latency + num_ranks * ring_bytes(num_ranks, size) / fit.unlimited_bytes_per_second
    share = fit.link_share(num_ranks)
    if not share:
        raise ValueError("the fit has no link efficiency (no rate-limited points)")
    rate = link_bytes_per_second(mbit)
    return latency + ring_bytes(num_ranks, size) / (share * rate) + fit.overhead_bytes / rate


# Columns of the fit: their coefficients are alpha, lam, 1/eta, 1/machine, c, 1/eta_pair,
# 1/veth_pair.
_ALPHA, _LAM, _ETA, _MACHINE, _OVERHEAD, _ETA_PAIR, _VETH_PAIR = range(7)
_COLUMNS = 7


def _features(point: Point, pair_apart: bool, veth_pair_apart: bool = False) -> list[float]:
    row = [0.0] * _COLUMNS
    row[_ALPHA] = 1.0
    row[_LAM] = 2.0 * (point.num_ranks - 1)
    transfer = ring_bytes(point.num_ranks, point.bytes)
    if point.mbit is None:
        if veth_pair_apart and point.num_ranks == 2:
            row[_VETH_PAIR] = transfer
        else:
            row[_MACHINE] = point.num_ranks * transfer
        return row
    rate = link_bytes_per_second(point.mbit)
    row[_ETA_PAIR if pair_apart and point.num_ranks == 2 else _ETA] = transfer / rate
    row[_OVERHEAD] = 1 / rate
    return row


def fit(points: Sequence[Point]) -> Fit:
    """Least squares on relative errors with every coefficient >= 0 (the best of all subsets
    of the optional coefficients whose unconstrained solution is non-negative: exact NNLS for
    so few).

    ``eta_pair`` is fitted apart when the rate-limited points hold N = 2 and N >= 3, and
    ``veth_pair`` when the unlimited ones do; the coefficients the points cannot tell (no
    limited or no unlimited points) are left None."""
    if not points:
        raise ValueError("no points to fit")
    if any(p.seconds <= 0 or p.bytes <= 0 for p in points):
        raise ValueError("every point needs positive seconds and bytes")
    limited = [p for p in points if p.mbit is not None]
    pair_apart = {p.num_ranks == 2 for p in limited} == {True, False}
    unlimited = [p for p in points if p.mbit is None]
    veth_pair_apart = {p.num_ranks == 2 for p in unlimited} == {True, False}
    features = np.array([_features(p, pair_apart, veth_pair_apart) for p in points])
    seconds = np.array([p.seconds for p in points])
    weighted = features / seconds[:, None]
    target = np.ones(len(points))
    # Every bandwidth column the points have stays in: without it those points have none.
    required = {c for c in (_ETA, _MACHINE, _ETA_PAIR, _VETH_PAIR) if features[:, c].any()}
    optional = [c for c in (_ALPHA, _LAM, _OVERHEAD) if features[:, c].any()]
    best: tuple[float, Any] | None = None
    for count in range(len(optional) + 1):
        for chosen in itertools.combinations(optional, count):
            columns = sorted(required | set(chosen))
            solution, *_ = np.linalg.lstsq(weighted[:, columns], target, rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(_COLUMNS)
            coefficients[columns] = solution
            residual = float(np.sum((weighted @ coefficients - target) ** 2))
            if best is None or residual < best[0] - 1e-15:
                best = (residual, coefficients)
    if best is None:
        raise ValueError("no non-negative fit: the points do not grow with bytes")
    found = best[1]

    def inverse(column: int) -> float | None:
        return float(1 / found[column]) if found[column] > 0 else None

    return Fit(
        alpha=float(found[_ALPHA]),
        lam=float(found[_LAM]),
        eta=inverse(_ETA),
        eta_pair=inverse(_ETA_PAIR) if pair_apart else None,
        overhead_bytes=float(found[_OVERHEAD]),
        unlimited_bytes_per_second=inverse(_MACHINE),
        veth_pair=inverse(_VETH_PAIR) if veth_pair_apart else None,
        points=len(points),
    )


def bootstrap(measured: Sequence[Repeats], *, resamples: int, seed: int) -> list[Fit]:
    """The fit redone ``resamples`` times, each on every point's repeats resampled with
    replacement (as many as it has) and their median taken; ``seed`` fixes the draws. Points
    measured with no spread between their repeats give the same fit every time."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not measured:
        raise ValueError("no points to fit")
    generator = np.random.default_rng(seed)
    fits = []
    for _ in range(resamples):
        points = [
            m.point(generator.choice(np.asarray(m.seconds), size=len(m.seconds)).tolist())
            for m in measured
        ]
        fits.append(fit(points))
    return fits


def split_for_check(points: Sequence[Point]) -> tuple[list[Point], list[Point]]:
    """(points to fit on, points to check on). With three or more rank counts, the smallest
    and the largest are fitted and the ones between checked (the model must carry from N to
    N); with fewer, the middle sizes of each (N, rate) are checked (none when there is no
    middle size: every point is then fitted, and the check is in-sample)."""
    counts = sorted({p.num_ranks for p in points})
    if len(counts) >= 3:
        ends = {counts[0], counts[-1]}
        return [p for p in points if p.num_ranks in ends], [
            p for p in points if p.num_ranks not in ends
        ]
    fitted: list[Point] = []
    checked: list[Point] = []
    groups: dict[tuple[int, float | None], list[Point]] = {}
    for point in points:
        groups.setdefault((point.num_ranks, point.mbit), []).append(point)
    for group in groups.values():
        sizes = sorted({p.bytes for p in group})
        middle = set(sizes[1:-1])
        for point in group:
            (checked if point.bytes in middle else fitted).append(point)
    return fitted, checked


def relative_error(fit: Fit, point: Point) -> float:
    """(model - measured) / measured."""
    predicted = allreduce_seconds(fit, point.num_ranks, point.bytes, point.mbit)
    return (predicted - point.seconds) / point.seconds


def allreduces_per_step(
    gradient_bytes: float, fusion_threshold: int = FUSION_THRESHOLD_BYTES
) -> int:
    """Fused allreduces per step: gradients go in buffers of up to ``fusion_threshold``."""
    return max(1, math.ceil(gradient_bytes / fusion_threshold))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    num_ranks: int
    gbit: float
    step_seconds: float
    allreduce_seconds: float
    images_per_second: float
    efficiency: float
    """t_compute / step: images/s over N times one GPU's."""
    bandwidth_only_efficiency: float
    """The same with no latency terms (alpha = lam = c = 0): what the link alone allows."""


def predict(
    fit: Fit,
    *,
    compute_seconds: float,
    batch_size: int,
    gradient_bytes: float,
    num_ranks: int,
    gbit: float,
) -> Prediction:
    """A data-parallel step on ``num_ranks`` GPUs, one per ring position on links of ``gbit``
    Gbit/s: compute, then the step's gradients allreduced in fused buffers, nothing of the
    allreduce hidden behind backprop (the exposed time is all of it: a lower bound of
    efficiency when Horovod overlaps them)."""
    if compute_seconds <= 0 or batch_size < 1 or gradient_bytes <= 0 or gbit <= 0:
        raise ValueError("compute_seconds, batch_size, gradient_bytes and gbit must be > 0")
    if fit.eta is None:
        raise ValueError("predictions need the link efficiency of rate-limited points")
    mbit = gbit * 1000
    transfer = 0.0
    latency = 0.0
    if num_ranks > 1:
        share = fit.link_share(num_ranks) or fit.eta
        transfer = ring_bytes(num_ranks, gradient_bytes) / (share * link_bytes_per_second(mbit))
        overhead = fit.overhead_bytes / link_bytes_per_second(mbit)
        latency = allreduces_per_step(gradient_bytes) * (
            fit.alpha + fit.lam * 2 * (num_ranks - 1) + overhead
        )
    allreduce = transfer + latency
    step = compute_seconds + allreduce
    return Prediction(
        num_ranks=num_ranks,
        gbit=gbit,
        step_seconds=step,
        allreduce_seconds=allreduce,
        images_per_second=num_ranks * batch_size / step,
        efficiency=compute_seconds / step,
        bandwidth_only_efficiency=compute_seconds / (compute_seconds + transfer),
    )
