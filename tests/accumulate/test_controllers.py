"""Each stepping rule against a hand computation, and the estimators against references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grabkit.accumulate import (
    MetricHypothesisTest,
    NoiseScaleController,
    NormTest,
    NormThreshold,
    Observation,
    RelativeNormThreshold,
    ScheduledBatch,
    window_noise_estimates,
)
from grabkit.accumulate.student_t import student_t_quantile
from grabkit.noise.identities import two_batch_estimates

f64 = torch.float64


def t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=f64)


def feed(controller, counts, micro_sq, mean_sq_after_each, metrics=None):
    """Observe a window microbatch by microbatch; return the ready flags."""
    flags, total = [], 0.0
    for k, (c, m, mean_sq) in enumerate(zip(counts, micro_sq, mean_sq_after_each, strict=True)):
        total += c
        obs = Observation(
            count=t(c),
            total_count=t(total),
            draws=k + 1,
            mean_norm_sq=t(mean_sq),
            microbatch_norm_sq=t(m),
            metric=None if metrics is None else t(metrics[k]),
        )
        controller.observe(obs)
        flags.append(bool(controller.ready(obs)))
    return flags, obs


def test_norm_threshold_steps_at_or_below_threshold():
    rule = NormThreshold(0.5)
    flags, _ = feed(rule, [1, 1, 1], [0, 0, 0], [0.36, 0.25, 0.09])
    assert flags == [False, True, True]  # |m| = 0.6, 0.5 (equal: steps), 0.3


def test_relative_threshold_hand_computation():
    # counts 1, 3; |g|^2 = 4, 1 -> weighted RMS^2 = (4 + 3) / 4 = 1.75
    rule = RelativeNormThreshold(ratio=0.5)
    flags, _ = feed(rule, [1, 3], [4.0, 1.0], [4.0, 0.43])
    assert flags == [False, True]  # 0.43 <= 0.25 * 1.75 = 0.4375
    rule = RelativeNormThreshold(ratio=0.5)
    assert feed(rule, [1, 3], [4.0, 1.0], [4.0, 0.44])[0] == [False, False]


def test_norm_test_hand_computation():
    # k = 2, counts 2, 2, |g|^2 = 5, 3, |m|^2 = 2: trace = (2*5 + 2*3 - 4*2) / 1 = 8; 8/4 = 2
    assert feed(NormTest(theta=1.0), [2, 2], [5, 3], [5, 2.0])[0] == [False, True]
    assert feed(NormTest(theta=0.99), [2, 2], [5, 3], [5, 2.0])[0] == [False, False]


def test_window_estimates_equal_two_batch_identity_for_equal_counts():
    micro = [3.0, 5.0, 4.0]
    c, k, mean_sq = 8.0, 3, 2.5
    grad_sq, trace = window_noise_estimates(t(c * sum(micro)), k, t(c * k), t(mean_sq))
    ref_grad_sq, ref_trace = two_batch_estimates(sum(micro) / k, c, mean_sq, c * k)
    assert math.isclose(float(grad_sq), ref_grad_sq, rel_tol=1e-12)
    assert math.isclose(float(trace), ref_trace, rel_tol=1e-12)


def test_window_estimates_are_unbiased_with_unequal_counts():
    """Monte Carlo: Gaussian per-example gradients, known |G|^2 and tr(Sigma)."""
    gen = torch.Generator().manual_seed(0)
    dim, counts, trials = 6, [1, 3, 7], 20000
    g_true = torch.linspace(-1, 1, dim, dtype=f64)
    sigma_diag = torch.linspace(0.5, 2.0, dim, dtype=f64)
    est_g, est_tr = torch.zeros((), dtype=f64), torch.zeros((), dtype=f64)
    for _ in range(trials // 100):
        micro = [
            g_true + torch.randn(100, dim, generator=gen, dtype=f64) * (sigma_diag / c).sqrt()
            for c in counts
        ]
        total = sum(counts)
        mean = sum(c * m for c, m in zip(counts, micro, strict=True)) / total
        weighted = sum(c * m.square().sum(1) for c, m in zip(counts, micro, strict=True))
        grad_sq, trace = window_noise_estimates(
            weighted, len(counts), t(total), mean.square().sum(1)
        )
        est_g += grad_sq.sum()
        est_tr += trace.sum()
    assert float(est_g / trials) == pytest.approx(float(g_true.square().sum()), rel=0.03)
    assert float(est_tr / trials) == pytest.approx(float(sigma_diag.sum()), rel=0.03)


def test_noise_scale_controller_steps_at_k_times_b_simple():
    # window of counts 4, 4 with |g|^2 = 3, 1 and |m|^2 = 1.5:
    # trace = (4*3 + 4*1 - 8*1.5) / 1 = 4; |G|^2 = 1.5 - 4/8 = 1 -> B_simple = 4 <= 8 = count
    rule = NoiseScaleController(noise_multiplier=2.0)
    flags, obs = feed(rule, [4, 4], [3, 1], [3, 1.5])
    assert flags == [False, True]  # 8 >= 2 * 4
    rule = NoiseScaleController(noise_multiplier=2.01)
    assert feed(rule, [4, 4], [3, 1], [3, 1.5])[0] == [False, False]
    rule.end_window(obs)  # the EMA now holds B_simple = 4 and decides the next windows
    assert rule.noise_scale == pytest.approx(4.0)


def test_noise_scale_controller_never_steps_on_negative_signal():
    # |G|^2 estimate <= 0 (pure noise): keep accumulating
    rule = NoiseScaleController()
    assert feed(rule, [1, 1], [4, 4], [4, 1.0])[0] == [False, False]


def test_hypothesis_test_hand_computation():
    # running average 10 (first metric), window metrics 10, 10.2, 9.9
    rule = MetricHypothesisTest(confidence=0.9, error_tolerance=0.03)
    flags, _ = feed(rule, [1, 1, 1], [0, 0, 0], [0, 0, 0], metrics=[10.0, 10.2, 9.9])
    samples = [10.0, 10.2, 9.9]
    for k in (2, 3):
        s = torch.tensor([10.0, *samples[:k]], dtype=f64)
        half = student_t_quantile(0.95, k) * float(s.std() / math.sqrt(k + 1))
        assert flags[k - 1] == (half <= 0.03 * float(s.mean()))
    assert flags[0] is False
    assert flags == [False, True, True]


def test_hypothesis_test_uses_absolute_mean_for_negative_metrics():
    rule = MetricHypothesisTest(confidence=0.9, error_tolerance=0.03)
    assert feed(rule, [1, 1, 1], [0] * 3, [0] * 3, metrics=[-10.0, -10.1, -9.9])[0][-1]


def test_hypothesis_running_average_moves_by_ema_alpha():
    rule = MetricHypothesisTest(ema_alpha=0.5)
    _, obs = feed(rule, [1, 1], [0, 0], [0, 0], metrics=[2.0, 4.0])
    rule.end_window(obs)
    assert float(rule.running_avg_metric) == pytest.approx(0.5 * 3.0 + 0.5 * 2.0)


def test_scheduled_batch_rounds_like_gqc():
    rule = ScheduledBatch(physical_batch_size=8, target_logical_batch_size=30)
    assert rule.target_draws == 4  # round(3.75)
    assert feed(rule, [8] * 4, [0] * 4, [0] * 4)[0] == [False, False, False, True]
    assert ScheduledBatch(8, 2).target_draws == 1


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 1, 12.706204736), (0.95, 5, 2.015048373), (0.99, 30, 2.457261542)],
)
def test_student_t_quantile_table(p, df, expected):
    assert student_t_quantile(p, df) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.51, 0.9999), st.integers(1, 200))
def test_student_t_quantile_matches_scipy(p, df):
    stats = pytest.importorskip("scipy.stats")
    assert student_t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: NormThreshold(-1.0), "norm_threshold"),
        (lambda: RelativeNormThreshold(0), "ratio"),
        (lambda: NormTest(theta="1"), "theta"),
        (lambda: NoiseScaleController(min_draws=1), "min_draws"),
        (lambda: NoiseScaleController(noise_multiplier=0), "noise_multiplier"),
        (lambda: MetricHypothesisTest(confidence=1.0), "confidence"),
        (lambda: MetricHypothesisTest(ema_alpha=0), "ema_alpha"),
        (lambda: ScheduledBatch(0, 8), "physical_batch_size"),
        (lambda: student_t_quantile(0.4, 3), "probability"),
    ],
)
def test_bad_arguments_are_rejected_clearly(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_controller_state_round_trip_and_rejects_foreign_state():
    rule = NoiseScaleController(noise_multiplier=3.0)
    _, obs = feed(rule, [1, 1], [3, 1], [3, 1.5])
    rule.end_window(obs)
    copy = NoiseScaleController()
    copy.load_state_dict(rule.state_dict())
    assert copy.noise_multiplier == 3.0 and copy.noise_scale == rule.noise_scale
    with pytest.raises(ValueError, match="different controller"):
        NormThreshold().load_state_dict(rule.state_dict())
