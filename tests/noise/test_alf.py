"""The ALF-compatible estimator: ALF's formulas, odd batches, unbiasedness, averaging, errors."""

from __future__ import annotations

import io

import pytest
import torch
from tests.noise.helpers import Z_LIMIT, linear_losses, problem, z_score

import grabkit
from grabkit.noise import GradientNoiseScaleEstimator


class _AlfReference:
    """ALF's forward, transcribed: its formulas and ScalarEMAverager, nothing shared."""

    def __init__(self, mode, ratio, rate, clip):
        self.mode, self.ratio, self.rate, self.clip = (
            mode,
            (ratio if mode == "paper" else 0.5),
            rate,
            clip,
        )
        self.avg = [0.0, 0.0]
        self.mass = 0.0
        self.last = torch.zeros(())

    def _norm(self, loss, tensors):
        grads = torch.autograd.grad(loss.mean(), tensors, retain_graph=True)
        if self.clip is not None:
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            grads = [g * self.clip / max(float(norm), self.clip) for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads])
        return (flat * flat).sum(), flat

    def __call__(self, loss, tensors):
        B = loss.shape[-1]
        shuffled = loss[..., torch.randperm(B)]
        b = max(1, int(B * self.ratio))
        B -= b
        B_norm2, B_grads = self._norm(shuffled[..., b:], tensors)
        b_norm2, b_grads = self._norm(shuffled[..., :b], tensors)
        if self.mode == "paper":
            gradient_norm = (B * B_norm2 - b * b_norm2) / (B - b)
            var_trace = (b_norm2 - B_norm2) / (1.0 / b - 1.0 / B)
        else:
            var_trace = (B_norm2 + b_norm2) / 2.0
            gradient_norm = (B_grads * b_grads).sum()
        self.mass += self.rate * (1 - self.mass)
        self.avg = [
            a + self.rate * (float(x) - a)
            for a, x in zip(self.avg, (gradient_norm, var_trace), strict=True)
        ]
        gns = torch.tensor(
            self.avg[1]
            / max(self.mass, self.rate)
            / (self.avg[0] / max(self.mass, self.rate) + 1e-8)
        )
        if self.mode == "alternative":
            gns = (gns - 1) * B
        if gns < 0:
            return self.last
        self.last = gns
        return gns


@pytest.mark.parametrize(
    ("mode", "clip", "time_major"),
    [
        ("alternative", None, False),
        ("paper", None, False),
        ("paper", 0.05, True),
        ("alternative", 0.05, True),
    ],
)
def test_matches_a_transcription_of_alf(mode, clip, time_major):
    prob = problem(10)
    ours = GradientNoiseScaleEstimator(
        batch_size_ratio=0.2, update_rate=0.1, gradient_norm_clip=clip, mode=mode
    )
    reference = _AlfReference(mode, 0.2, 0.1, clip)
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        loss, weights = linear_losses(prob, torch.randint(prob.n, (40,), generator=gen))
        if time_major:  # [T, B]: the mean runs over time steps too
            loss = torch.stack([loss, 0.5 * loss])
        tensors = list(weights.values())
        torch.manual_seed(step)
        got = ours(loss, tensors)
        torch.manual_seed(step)
        want = reference(loss, tensors)
        assert float(got) == pytest.approx(float(want), rel=1e-5), step
        assert not got.requires_grad


@pytest.mark.slow  # convergence: many simulated steps
@pytest.mark.parametrize(("mode", "batch"), [("alternative", 33), ("paper", 40)])
def test_per_call_estimates_are_unbiased_and_the_average_converges(mode, batch):
    prob = problem(10)
    true_g, true_t = prob.truth()  # draws are with replacement: no finite-population correction
    est = GradientNoiseScaleEstimator(batch_size_ratio=0.25, update_rate=0.003, mode=mode)
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    g_draws, t_draws = [], []
    for _ in range(1000):
        loss, weights = linear_losses(prob, torch.randint(prob.n, (batch,), generator=gen))
        gns = est(loss, weights)
        g, t = est._tracker.last_observation
        g_draws.append(g.sum())
        t_draws.append(t.sum())
    assert abs(z_score(torch.stack(g_draws), float(true_g.sum()))) < Z_LIMIT
    assert abs(z_score(torch.stack(t_draws), float(true_t.sum()))) < Z_LIMIT
    truth = prob.b_simple()
    assert abs(float(gns) - truth) < 0.1 * truth
    result = est.result()
    assert result.block_names == tuple(sorted(prob.names))  # dict keys in sorted order, as ALF
    assert abs(result.b_simple - truth) < 0.1 * truth
    assert result.interval[0] < truth < result.interval[1]


def test_negative_estimates_return_the_last_valid_one():
    w = torch.zeros((), requires_grad=True)
    est = GradientNoiseScaleEstimator(update_rate=1.0)
    opposite = w * torch.tensor([1.0, -1.0])  # halves with opposite gradients: alpha < 0
    assert float(est(opposite, w)) == 0.0
    agreeing = w * torch.tensor([1.0, 3.0])  # alpha = 3, beta = 5: (5/3 - 1) * 1
    assert float(est(agreeing, [w])) == pytest.approx(2.0 / 3.0, rel=1e-6)
    assert float(est(opposite, (w,))) == pytest.approx(2.0 / 3.0, rel=1e-6)


def test_accepts_parameters_and_nests_and_is_exported_at_top_level():
    assert grabkit.GradientNoiseScaleEstimator is GradientNoiseScaleEstimator
    model = torch.nn.Linear(3, 2)
    x = torch.randn(6, 3)
    loss = model(x).pow(2).sum(1)
    est = GradientNoiseScaleEstimator()
    est(loss, model.parameters())
    assert est.result().block_names == ("0", "1")
    with pytest.raises(ValueError, match="tensors changed"):
        est(loss, {"weight": model.weight})
    nested = GradientNoiseScaleEstimator()
    nested(loss, {"b": [model.bias], "a": model.weight})
    assert nested.result().block_names == ("a", "b.0")


def test_state_dict_round_trips_through_weights_only_load():
    prob = problem(10)
    gen = torch.Generator().manual_seed(5)
    batches = [linear_losses(prob, torch.randint(prob.n, (20,), generator=gen)) for _ in range(6)]
    whole = GradientNoiseScaleEstimator(update_rate=0.2)
    first = GradientNoiseScaleEstimator(update_rate=0.2)
    for i, (loss, weights) in enumerate(batches):
        torch.manual_seed(i)
        expected = whole(loss, weights)
        if i < 3:
            torch.manual_seed(i)
            first(loss, weights)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradientNoiseScaleEstimator(update_rate=0.2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for i, (loss, weights) in enumerate(batches[3:], start=3):
        torch.manual_seed(i)
        got = resumed(loss, weights)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert resumed.result().b_simple == pytest.approx(whole.result().b_simple, rel=1e-9)


def test_bad_input_is_rejected_with_a_clear_message():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="mode"):
        GradientNoiseScaleEstimator(mode="fast")
    with pytest.raises(ValueError, match="batch_size_ratio"):
        GradientNoiseScaleEstimator(batch_size_ratio=0.5, mode="paper")
    with pytest.raises(ValueError, match="gradient_norm_clip"):
        GradientNoiseScaleEstimator(gradient_norm_clip=0.0)
    est = GradientNoiseScaleEstimator()
    with pytest.raises(ValueError, match=r"\[B\] or \[T, B\]"):
        est((w * 2).sum(), w)
    with pytest.raises(ValueError, match="at least 2 examples"):
        est(w[:1], w)
    with pytest.raises(ValueError, match="larger batch"):
        GradientNoiseScaleEstimator(mode="paper")(w * 1.0, w)
    with pytest.raises(TypeError, match="tensors should be"):
        est(w * 1.0, 3)
    with pytest.raises(RuntimeError, match="no estimate yet"):
        est.result()
