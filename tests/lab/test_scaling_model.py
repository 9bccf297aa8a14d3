"""lab.scaling_model: the ring allreduce model, its fit and its predictions, on points
made by the model itself (so the truth is known) and on hand-worked cases."""

from __future__ import annotations

import math

import pytest

from lab import scaling_model
from lab.scaling_model import Fit, Point

TRUE = Fit(
    alpha=0.004,
    lam=0.0015,
    eta=0.95,
    overhead_bytes=2000.0,
    unlimited_bytes_per_second=40e6,
    points=0,
)


def _points(fit: Fit) -> list[Point]:
    points = []
    for num_ranks in (2, 3, 4):
        for mbit, sizes in ((1.0, (12_500, 50_000, 200_000)), (10.0, (125_000, 2_000_000)),
                            (None, (1_000_000, 16_000_000))):  # fmt: skip
            for size in sizes:
                seconds = scaling_model.allreduce_seconds(fit, num_ranks, size, mbit)
                points.append(Point(num_ranks=num_ranks, mbit=mbit, bytes=size, seconds=seconds))
    return points


def test_ring_bytes_are_2_n_minus_1_over_n_of_the_tensor() -> None:
    assert scaling_model.ring_bytes(1, 1000) == 0
    assert scaling_model.ring_bytes(2, 1000) == 1000
    assert scaling_model.ring_bytes(4, 1000) == 1500
    assert scaling_model.ring_bytes(256, 1000) == pytest.approx(2 * 255 / 256 * 1000)
    with pytest.raises(ValueError, match="at least 1"):
        scaling_model.ring_bytes(0, 1000)


def test_allreduce_seconds_by_hand() -> None:
    # 2 ranks, 1 MB at 10 Mbit/s with eta 0.95, 2 kB of overhead on the wire, 4 ms + 2 * 1.5 ms.
    seconds = scaling_model.allreduce_seconds(TRUE, 2, 1_000_000, 10.0)
    assert seconds == pytest.approx(1e6 / (0.95 * 1.25e6) + 2000 / 1.25e6 + 0.004 + 0.003)
    assert scaling_model.allreduce_seconds(TRUE, 1, 1_000_000, 10.0) == 0.0
    # Unlimited: all ranks' bytes (4 x 12 MB) through what this machine moves per second.
    assert scaling_model.allreduce_seconds(TRUE, 4, 8_000_000, None) == pytest.approx(
        0.004 + 6 * 0.0015 + 4 * 12e6 / 40e6
    )
    # ... but for a pair with a rate of its own: its ring bytes (8 MB) at that rate.
    pair = Fit(**{**TRUE.__dict__, "veth_pair": 10e6})
    assert scaling_model.allreduce_seconds(pair, 2, 8_000_000, None) == pytest.approx(
        0.004 + 2 * 0.0015 + 8e6 / 10e6
    )
    assert scaling_model.allreduce_seconds(pair, 3, 8_000_000, None) == pytest.approx(
        scaling_model.allreduce_seconds(TRUE, 3, 8_000_000, None)
    )


def test_the_fit_recovers_the_parameters_that_made_the_points() -> None:
    fitted = scaling_model.fit(_points(TRUE))
    assert fitted.alpha == pytest.approx(TRUE.alpha, rel=1e-6)
    assert fitted.lam == pytest.approx(TRUE.lam, rel=1e-6)
    assert fitted.eta == pytest.approx(TRUE.eta, rel=1e-6)
    assert fitted.overhead_bytes == pytest.approx(TRUE.overhead_bytes, rel=1e-5)
    # N = 2 and N >= 3 are rate-limited here: the pair's share is fitted apart (and equal).
    assert fitted.eta_pair == pytest.approx(TRUE.eta, rel=1e-6)
    assert fitted.unlimited_bytes_per_second == pytest.approx(40e6, rel=1e-6)
    # So is the unlimited pair's rate: half the machine's, each of the two ranks.
    assert fitted.veth_pair == pytest.approx(20e6, rel=1e-6)
    assert fitted.points == len(_points(TRUE))


def test_fitted_coefficients_are_never_negative() -> None:
    # Times below the pure bandwidth term: an unconstrained fit would want a negative latency.
    points = [
        Point(num_ranks=n, mbit=10.0, bytes=s, seconds=0.97 * s * 2 * (n - 1) / n / 1.25e6)
        for n in (2, 3, 4)
        for s in (100_000, 1_000_000)
    ]
    points[0] = Point(num_ranks=2, mbit=10.0, bytes=100_000, seconds=0.05)
    fitted = scaling_model.fit(points)
    assert fitted.alpha >= 0 and fitted.lam >= 0
    assert fitted.eta is not None and fitted.eta > 0
    assert fitted.unlimited_bytes_per_second is None  # no unlimited points


def test_fit_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="no points"):
        scaling_model.fit([])
    with pytest.raises(ValueError, match="positive"):
        scaling_model.fit([Point(num_ranks=2, mbit=1.0, bytes=1000, seconds=0.0)])


def test_split_holds_out_the_middle_rank_counts_or_the_middle_sizes() -> None:
    points = _points(TRUE)
    fitted, checked = scaling_model.split_for_check(points)
    assert {p.num_ranks for p in fitted} == {2, 4}
    assert {p.num_ranks for p in checked} == {3}
    assert len(fitted) + len(checked) == len(points)

    two = [p for p in points if p.num_ranks == 2]
    fitted, checked = scaling_model.split_for_check(two)
    # Only the 1 Mbit/s group has a middle size (50 kB); the others have two sizes.
    assert [(p.mbit, p.bytes) for p in checked] == [(1.0, 50_000)]
    assert len(fitted) == len(two) - 1


def test_relative_error_is_model_minus_measured_over_measured() -> None:
    point = Point(num_ranks=2, mbit=10.0, bytes=1_000_000, seconds=1.0)
    modelled = scaling_model.allreduce_seconds(TRUE, 2, 1_000_000, 10.0)
    assert scaling_model.relative_error(TRUE, point) == pytest.approx(modelled - 1.0)


def test_fused_allreduces_per_step() -> None:
    assert scaling_model.allreduces_per_step(1) == 1
    assert scaling_model.allreduces_per_step(64 * 1024 * 1024) == 1
    assert scaling_model.allreduces_per_step(102_334_368) == 2  # ResNet-50's gradients


def test_predict_step_images_and_efficiency() -> None:
    bandwidth_only = Fit(
        alpha=0.0, lam=0.0, eta=1.0, overhead_bytes=0.0, unlimited_bytes_per_second=None, points=0
    )
    # 2 GPUs, 100 MB of gradients on 10 Gbit/s: 100 MB / 1.25 GB/s = 0.08 s of transfer.
    two = scaling_model.predict(
        bandwidth_only, compute_seconds=0.2, batch_size=256, gradient_bytes=100e6,
        num_ranks=2, gbit=10.0,
    )  # fmt: skip
    assert two.allreduce_seconds == pytest.approx(0.08)
    assert two.step_seconds == pytest.approx(0.28)
    assert two.efficiency == pytest.approx(0.2 / 0.28)
    assert two.images_per_second == pytest.approx(2 * 256 / 0.28)
    assert two.bandwidth_only_efficiency == pytest.approx(two.efficiency)

    one = scaling_model.predict(
        TRUE, compute_seconds=0.2, batch_size=256, gradient_bytes=100e6, num_ranks=1, gbit=10.0
    )
    assert one.efficiency == 1.0 and one.images_per_second == pytest.approx(1280)

    # Latency: per fused buffer, alpha + lam * 2(N-1); efficiency falls with N, never rises.
    efficiencies = [
        scaling_model.predict(
            TRUE, compute_seconds=0.2, batch_size=256, gradient_bytes=102_334_368,
            num_ranks=n, gbit=25.0,
        ).efficiency
        for n in (8, 16, 32, 64, 128, 256, 512)
    ]  # fmt: skip
    assert efficiencies == sorted(efficiencies, reverse=True)
    at_512 = scaling_model.predict(
        TRUE, compute_seconds=0.2, batch_size=256, gradient_bytes=102_334_368,
        num_ranks=512, gbit=25.0,
    )  # fmt: skip
    transfer = 2 * 511 / 512 * 102_334_368 / (0.95 * 25e9 / 8)
    overhead = 2000 / (25e9 / 8)
    assert at_512.allreduce_seconds == pytest.approx(
        transfer + 2 * (0.004 + 0.0015 * 1022 + overhead)
    )
    assert math.isclose(at_512.bandwidth_only_efficiency, 0.2 / (0.2 + transfer))


def test_predict_needs_a_link_efficiency() -> None:
    unlimited_only = Fit(
        alpha=0.0, lam=0.0, eta=None, overhead_bytes=0.0, unlimited_bytes_per_second=1e8, points=1
    )
    with pytest.raises(ValueError, match="link efficiency"):
        scaling_model.predict(
            unlimited_only, compute_seconds=0.2, batch_size=1, gradient_bytes=1.0,
            num_ranks=2, gbit=10.0,
        )  # fmt: skip


def test_two_ranks_get_a_link_share_of_their_own() -> None:
    pair = Fit(
        alpha=0.002, lam=0.001, eta=0.82, eta_pair=0.92, overhead_bytes=3000.0,
        unlimited_bytes_per_second=None, points=0,
    )  # fmt: skip
    points = [p for p in _points(TRUE) if p.mbit is not None]
    points = [
        Point(num_ranks=p.num_ranks, mbit=p.mbit, bytes=p.bytes,
              seconds=scaling_model.allreduce_seconds(pair, p.num_ranks, p.bytes, p.mbit))
        for p in points
    ]  # fmt: skip
    fitted = scaling_model.fit(points)
    assert fitted.eta == pytest.approx(0.82, rel=1e-6)
    assert fitted.eta_pair == pytest.approx(0.92, rel=1e-6)
    assert fitted.link_share(2) == fitted.eta_pair and fitted.link_share(3) == fitted.eta
    # Predictions for many GPUs use the ring's share, not the pair's.
    many = scaling_model.predict(
        fitted, compute_seconds=0.2, batch_size=256, gradient_bytes=100e6, num_ranks=64,
        gbit=10.0,
    )  # fmt: skip
    transfer = 2 * 63 / 64 * 100e6 / (0.82 * 10e9 / 8)
    assert many.bandwidth_only_efficiency == pytest.approx(0.2 / (0.2 + transfer))
    # With only two ranks measured there is one share for all.
    only_pairs = scaling_model.fit([p for p in points if p.num_ranks == 2])
    assert only_pairs.eta_pair is None and only_pairs.eta == pytest.approx(0.92, rel=1e-6)


def test_two_ranks_get_an_unlimited_rate_of_their_own() -> None:
    # Measured on an idle machine: 2 ranks about 290 Mbit/s each, 3-4 ranks 1 Gbit/s in all.
    truth = Fit(
        alpha=0.0, lam=0.002, eta=None, overhead_bytes=0.0,
        unlimited_bytes_per_second=125e6, veth_pair=36e6, points=0,
    )  # fmt: skip
    points = [
        Point(num_ranks=p.num_ranks, mbit=None, bytes=p.bytes,
              seconds=scaling_model.allreduce_seconds(truth, p.num_ranks, p.bytes, None))
        for p in _points(TRUE)
        if p.mbit is None
    ]  # fmt: skip
    fitted = scaling_model.fit(points)
    assert fitted.unlimited_bytes_per_second == pytest.approx(125e6, rel=1e-6)
    assert fitted.veth_pair == pytest.approx(36e6, rel=1e-6)
    assert fitted.lam == pytest.approx(0.002, rel=1e-6)
    # With only two ranks measured there is one rate for all: the machine's, twice each rank's.
    only_pairs = scaling_model.fit([p for p in points if p.num_ranks == 2])
    assert only_pairs.veth_pair is None
    assert only_pairs.unlimited_bytes_per_second == pytest.approx(72e6, rel=1e-6)
