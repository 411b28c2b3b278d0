"""NoiseScaleTracker and Fieller's interval: invariants, coverage, errors."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from grabkit.noise import BiasCorrectedEMA, NoiseScaleTracker, ratio_interval

finite = st.floats(-1e3, 1e3, allow_nan=False)
variance = st.floats(0.0, 1e3, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    t=finite,
    g=finite,
    vt=variance,
    vg=variance,
    rho=st.floats(-1.0, 1.0),
    conf=st.floats(0.5, 0.99),
)
@example(t=2.47e-143, g=2.47e-143, vt=0.0, vg=2.6e-286, rho=0.0, conf=0.5)  # squares underflow
def test_a_bounded_interval_contains_the_point_estimate(t, g, vt, vg, rho, conf):
    low, high = ratio_interval(t, g, vt, vg, rho * math.sqrt(vt * vg), conf)
    if math.isfinite(low):
        ratio = t / g
        tol = 1e-9 * (1.0 + abs(ratio))
        assert low - tol <= ratio <= high + tol
    else:
        assert (low, high) == (-math.inf, math.inf)


def test_interval_without_denominator_noise_is_the_normal_interval():
    z = NormalDist().inv_cdf(0.975)
    low, high = ratio_interval(6.0, 2.0, 4.0, 0.0, 0.0, 0.95)
    assert (low, high) == pytest.approx((3.0 - z, 3.0 + z))


@pytest.mark.slow  # convergence: many simulated steps
def test_interval_covers_the_true_ratio_at_its_nominal_rate():
    gen = torch.Generator().manual_seed(0)
    covered, trials = 0, 300
    for _ in range(trials):
        tracker = NoiseScaleTracker(update_rate=0.05)
        g = 1.0 + 0.5 * torch.randn(100, generator=gen, dtype=torch.float64)
        t = 20.0 + 4.0 * torch.randn(100, generator=gen, dtype=torch.float64) + 3.0 * (g - 1.0)
        for gi, ti in zip(g, t, strict=True):
            tracker.update(gi, ti, 8)
        low, high = tracker.result().interval
        covered += low < 20.0 < high
    assert 0.90 <= covered / trials <= 0.99


def test_effective_count_of_the_ema():
    tracker = NoiseScaleTracker(update_rate=1.0)
    tracker.update(1.0, 1.0, 4)
    tracker.update(1.0, 1.0, 4)
    assert tracker.effective_count == pytest.approx(1.0)  # rate 1 keeps only the newest
    slow = NoiseScaleTracker(update_rate=1e-6)
    for _ in range(10):
        slow.update(1.0, 1.0, 4)
    assert slow.effective_count == pytest.approx(10.0, rel=1e-4)  # a plain mean
    assert slow.result().interval == (-math.inf, math.inf) or slow.result().b_simple == 1.0


def test_negative_signal_reports_infinite_noise_scale_and_unbounded_interval():
    tracker = NoiseScaleTracker(update_rate=0.5)
    tracker.update(-1.0, 3.0, 4)
    tracker.update(-0.5, 2.0, 4)
    result = tracker.result()
    assert result.b_simple == math.inf
    assert not result.interval_is_bounded
    assert result.as_dict()["b_simple/all"] == math.inf


def test_ema_matches_alf_update_rate_meaning():
    ema = BiasCorrectedEMA(update_rate=0.1)
    avg, mass = 0.0, 0.0
    for x in (3.0, 1.0, 4.0, 1.0, 5.0):
        avg += 0.1 * (x - avg)
        mass += 0.1 * (1 - mass)
        assert float(ema.update(x)) == pytest.approx(avg / mass)


def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="confidence"):
        NoiseScaleTracker(0.1, confidence=1.0)
    with pytest.raises(ValueError, match="block_names"):
        NoiseScaleTracker(0.1, block_names=())
    tracker = NoiseScaleTracker(0.1, block_names=("a", "b"))
    with pytest.raises(RuntimeError, match="at least one step"):
        tracker.result()
    with pytest.raises(ValueError, match="2 block values"):
        tracker.update(1.0, 1.0, 4)
    with pytest.raises(ValueError, match="examples"):
        tracker.update(torch.ones(2), torch.ones(2), 0)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-10.0, 10.0), min_size=1, max_size=6),
    weight=st.integers(1, 4),
    rate=st.floats(0.01, 0.9),
)
def test_a_weighted_update_equals_repeated_updates(values, weight, rate):
    weighted, repeated = BiasCorrectedEMA(rate), BiasCorrectedEMA(rate)
    for v in values:
        weighted.update(v, weight=weight)
        for _ in range(weight):
            repeated.update(v)
    assert float(weighted.value) == pytest.approx(float(repeated.value), rel=1e-9, abs=1e-9)
