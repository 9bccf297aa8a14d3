"""lab.scaling_model.bootstrap: the ring model's fit redone on resamples of each point's repeats,
on repeats drawn around a known truth (so whether the range holds it can be seen)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lab import scaling_model
from lab.experiments import scaling
from lab.scaling_model import Fit, Repeats

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results" / "scaling" / "results.json"
# About what the rate-limited links of 2 shared cores fit: 2 ms per allreduce, 0.4 ms per ring
# step, 85 % of the link, 3 kB of overhead.
TRUTH = Fit(
    alpha=0.002, lam=0.0004, eta=0.85, overhead_bytes=3000.0, unlimited_bytes_per_second=None,
    points=0,
)  # fmt: skip
# The experiment's plan in small: bandwidth-bound sizes at 1, 10, 100 Mbit/s and the
# latency-bound tiny tensors at 100 Mbit/s, on the host counts it fits (2 and 4).
PLAN = (
    (1.0, (12_500, 50_000, 200_000)),
    (10.0, (125_000, 500_000, 2_000_000)),
    (100.0, (1_250_000, 5_000_000, 20_000_000)),
    (100.0, (4, 1024, 16_384)),
)


def _measured(repeats: int, noise: float, seed: int = 7) -> list[Repeats]:
    """Each point's repeats: the truth's time times log-normal noise of median 1."""
    generator = np.random.default_rng(seed)
    measured = []
    for num_ranks in (2, 4):
        for mbit, sizes in PLAN:
            for size in sizes:
                seconds = scaling_model.allreduce_seconds(TRUTH, num_ranks, size, mbit)
                draws = seconds * generator.lognormal(0.0, noise, size=repeats)
                measured.append(Repeats(num_ranks=num_ranks, mbit=mbit, bytes=size,
                                        seconds=tuple(draws.tolist())))  # fmt: skip
    return measured


def _lam_spread(measured: list[Repeats]) -> scaling_model.Spread:
    fits = scaling_model.bootstrap(measured, resamples=200, seed=31)
    assert len(fits) == 200
    return scaling_model.spread([f.lam for f in fits])


def test_the_lam_range_holds_the_truth_and_narrows_with_more_repeats() -> None:
    few = _lam_spread(_measured(repeats=9, noise=0.15))
    many = _lam_spread(_measured(repeats=81, noise=0.15))
    for found in (few, many):
        assert found.low <= TRUTH.lam <= found.high
        assert found.low < found.median < found.high
    # Nine times the repeats: about a third of the width (the median's error goes as 1/sqrt).
    assert many.width < 0.6 * few.width


def test_the_range_of_every_coefficient_holds_the_truth() -> None:
    fits = scaling_model.bootstrap(_measured(repeats=40, noise=0.15), resamples=200, seed=31)
    alpha = scaling_model.spread([f.alpha for f in fits])
    eta = scaling_model.spread([f.eta or 0.0 for f in fits])
    assert alpha.low <= TRUTH.alpha <= alpha.high
    assert eta.low <= 0.85 <= eta.high and eta.width < 0.05


def test_repeats_without_noise_give_a_zero_width_spread() -> None:
    measured = _measured(repeats=9, noise=0.0)
    fits = scaling_model.bootstrap(measured, resamples=50, seed=31)
    on_medians = scaling_model.fit([m.point() for m in measured])
    for name in ("alpha", "lam", "eta", "overhead_bytes"):
        values = [getattr(f, name) for f in fits]
        found = scaling_model.spread(values)
        assert found.width == 0.0
        assert found.median == getattr(on_medians, name)
    assert on_medians.lam == pytest.approx(TRUTH.lam, rel=1e-6)


def test_the_same_seed_gives_the_same_fits() -> None:
    measured = _measured(repeats=9, noise=0.15)
    first = scaling_model.bootstrap(measured, resamples=20, seed=5)
    assert first == scaling_model.bootstrap(measured, resamples=20, seed=5)
    assert first != scaling_model.bootstrap(measured, resamples=20, seed=6)


def test_bootstrap_and_spread_refuse_what_they_cannot_do() -> None:
    with pytest.raises(ValueError, match="resamples"):
        scaling_model.bootstrap(_measured(repeats=3, noise=0.1), resamples=0, seed=1)
    with pytest.raises(ValueError, match="no points"):
        scaling_model.bootstrap([], resamples=10, seed=1)
    with pytest.raises(ValueError, match="no values"):
        scaling_model.spread([])
    with pytest.raises(ValueError, match="no repeats"):
        Repeats(num_ranks=2, mbit=1.0, bytes=4, seconds=()).point()


def test_the_committed_fit_is_redone_from_its_own_repeats() -> None:
    # docs/results/scaling/results.json keeps every repeat: its fit (and its spread, when the
    # run made one) follows from them, with no probe run.
    committed = json.loads(COMMITTED.read_text())
    redone = scaling.analyse(
        committed["compute"], scaling.runs_from_results(committed), quick=committed["quick"]
    )
    for key, value in committed["fit"].items():
        assert redone["fit"][key] == (pytest.approx(value) if isinstance(value, float) else value)
    # The same points, roles and modelled times (to the last bits of the solver's float sums).
    assert len(redone["measurements"]) == len(committed["measurements"])
    for mine, theirs in zip(redone["measurements"], committed["measurements"], strict=True):
        assert mine["seconds"] == theirs["seconds"] and mine["role"] == theirs["role"]
        assert mine["modelled_seconds"] == pytest.approx(theirs["modelled_seconds"])
    if "fit_spread" in committed:
        for key in ("alpha_seconds", "lam_seconds", "eta"):
            assert redone["fit_spread"][key] == pytest.approx(committed["fit_spread"][key])
        for mine, theirs in zip(redone["predictions"], committed["predictions"], strict=True):
            assert mine["efficiency_spread"] == pytest.approx(theirs["efficiency_spread"])
    spread = redone["fit_spread"]
    assert spread["resamples"] == scaling.RESAMPLES and spread["seed"] == scaling.SEED
    lam = spread["lam_seconds"]
    assert lam["low"] <= lam["median"] <= lam["high"]
    assert len(spread["efficiency_512"]) == len(scaling.PUBLISHED) * len(scaling.LINKS_GBIT)
    for row in spread["efficiency_512"]:
        # The bandwidth-only figure bounds the fitted-latency one in every resample.
        assert row["efficiency"]["high"] <= row["bandwidth_only_efficiency"]["high"]


def test_the_report_gives_the_spread_and_says_what_is_modelled() -> None:
    committed = json.loads(COMMITTED.read_text())
    report = scaling.render(committed)
    assert report == (COMMITTED.parent / "report.md").read_text()
    spread = committed["fit_spread"]
    lam = spread["lam_seconds"]
    assert (
        f"lam {1000 * lam['median']:.3f} ms (5-95 %: {1000 * lam['low']:.3f}-"
        f"{1000 * lam['high']:.3f})" in report
    )
    first = next(
        r for r in committed["predictions"]
        if r["gpu"] == scaling.PUBLISHED[0].label and r["gbit"] == 25.0 and r["gpus"] == 512
    )  # fmt: skip
    low, high = first["efficiency_spread"]["low"], first["efficiency_spread"]["high"]
    assert f"{100 * first['efficiency']:.0f} % (5-95 %: {100 * low:.0f}-{100 * high:.0f} %)" in (
        report
    )
    for said in ("**Measured**", "**Quoted**", "**Modelled**", "What this spread is",
                 "What it is not", "80bdb59", "9b68da8", "a414ed4"):  # fmt: skip
        assert said in report
    # One sensitivity row per choice of tiny tensors, the last the method before them.
    assert len(committed["latency_sensitivity"]) == len(scaling.LATENCY_SIZES) + 1
    assert committed["latency_sensitivity"][-1]["tiny_sizes_fitted"] == []


def test_a_full_ring_has_no_empty_gloo_segment() -> None:
    # Gloo cuts a tensor into 2N segments of whole float32 values and skips empty ones.
    assert not scaling.full_ring(2, 4)  # one value, four segments: three empty
    assert not scaling.full_ring(4, 16)  # four values, eight segments
    assert not scaling.full_ring(3, 32)  # eight values in six segments of two: the last empty
    assert scaling.full_ring(2, 16) and scaling.full_ring(4, 32) and scaling.full_ring(3, 64)
    for num_ranks in (2, 3, 4):
        assert all(scaling.full_ring(num_ranks, s) for s in scaling.LATENCY_SIZES[1:])
        assert not scaling.full_ring(num_ranks, scaling.LATENCY_SIZES[0])
    # The quick plan fits every tiny tensor it measures (its check is the middle size).
    quick = [p for p in scaling.QUICK.phases if p.mbit == scaling.LATENCY_MBIT]
    assert quick and all(scaling.full_ring(2, s) for p in quick for s in p.sizes)
