"""Signed sums from the batch gradient (the two-valued shortcut) and in-place accumulation.

GraB's running-sum updates are weighted sums with weights +-1; for large Linear weights the engine
takes them as b * (batch gradient) + (a - b) * (sum over the rarer rows). These tests force that
path on small models (threshold patched to 1) and compare with torch.func references in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import grabkit.stats.step as step_module
from grabkit.stats import PerSampleStats
from grabkit.stats.factors import OuterProductFactor

pytestmark = pytest.mark.usefixtures("float64")

B = 6


@pytest.fixture
def every_linear_takes_the_shortcut(monkeypatch):
    monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)


def classification_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def sequence_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(dim=1)


class SequenceMLP(nn.Module):
    """Linear layers over (B, T, f) inputs: several positions per example."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def mlp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
    return model, torch.randn(B, 5), torch.randint(0, 4, (B,)), classification_loss


def sequence_case():
    torch.manual_seed(1)
    return SequenceMLP(), torch.randn(B, 3, 4), torch.randint(0, 3, (B, 3)), sequence_loss


def grouped_conv_case():  # grouped weights fall back to the ordinary weighted sum
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(4, 6, 3, groups=2), nn.Flatten(), nn.Linear(18, 3))
    return model, torch.randn(B, 4, 5), torch.randint(0, 3, (B,)), classification_loss


@pytest.mark.usefixtures("every_linear_takes_the_shortcut")
@pytest.mark.parametrize("case", [mlp_case, sequence_case, grouped_conv_case])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_signed_sums_match_reference(case, reduction, reference_tools):
    model, x, y, loss_fn = case()
    reference = reference_tools.per_sample(model, loss_fn, x, y)
    with PerSampleStats(model, loss_reduction=reduction) as stats:
        losses = loss_fn(model(x), y)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        assert stats.statistics()._large_outer_products  # the shortcut is in play
        reference_tools.assert_matches(stats, reference)
        batch = stats.gradient_batch()
        for weights in (
            torch.ones(B),  # one value: the batch gradient alone
            torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, 1.0]),  # +1 the rarer value
            torch.tensor([0.0, 2.0, 0.0, 0.0, 2.0, 0.0]),  # +-1 and 0 alike: any two values
            torch.tensor([1.0, -1.0, 0.5, 1.0, -1.0, 1.0]),  # three values: no shortcut
        ):
            expected = reference.T @ weights
            err = reference_tools.relative_error(batch.weighted_sum(weights), expected)
            assert err <= 1e-10, (weights, err)
            start = torch.randn(batch.dim)
            running = start.clone()
            batch.add_weighted_sum_to(running, weights)
            err = reference_tools.relative_error(running, start + expected)
            assert err <= 1e-10, (weights, err)


def test_add_weighted_sum_to_takes_k_columns(reference_tools):
    model, x, y, loss_fn = mlp_case()
    reference = reference_tools.per_sample(model, loss_fn, x, y)
    with PerSampleStats(model) as stats:
        loss_fn(model(x), y).mean().backward()
        batch = stats.gradient_batch()
        weights = torch.randn(B, 2)
        running = torch.randn(2, batch.dim)
        expected = running + weights.T @ reference
        batch.add_weighted_sum_to(running, weights)
        assert reference_tools.relative_error(running, expected) <= 1e-10


def test_add_weighted_sum_to_rejects_a_target_of_the_wrong_size():
    model, x, y, loss_fn = mlp_case()
    with PerSampleStats(model) as stats:
        loss_fn(model(x), y).mean().backward()
        batch = stats.gradient_batch()
        with pytest.raises(ValueError, match="contiguous tensor of 2 x"):
            batch.add_weighted_sum_to(torch.zeros(batch.dim), torch.ones(B, 2))
        with pytest.raises(ValueError, match="contiguous tensor of 1 x"):
            batch.add_weighted_sum_to(torch.zeros(2, batch.dim)[:, 0], torch.ones(B))
        with pytest.raises(ValueError, match="`weights` should have shape"):
            batch.add_weighted_sum_to(torch.zeros(batch.dim), torch.ones(B + 1))


def test_accumulate_needs_out():
    model, x, y, loss_fn = mlp_case()
    with PerSampleStats(model) as stats:
        loss_fn(model(x), y).mean().backward()
        with pytest.raises(ValueError, match="needs `out`"):
            stats.statistics().weighted_sum_stacked(torch.ones(B, 1), accumulate=True)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 5),
    t=st.integers(1, 3),
    p=st.integers(1, 5),
    q=st.integers(1, 5),
    alpha=st.floats(-3, 3),
    beta=st.floats(-3, 3),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_two_valued_sum_matches_materialised(b, t, p, q, alpha, beta, accumulate, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(b, t, 1, p, generator=gen)
    d = torch.randn(b, t, 1, q, generator=gen)
    dense = torch.einsum("btgq,btgp->bgqp", d, a).reshape(b, q, p)
    total = torch.randn(q, p, generator=gen)
    rows = torch.nonzero(torch.rand(b, generator=gen) < 0.5).squeeze(1)
    factor = OuterProductFactor(a, d, torch.Size([q, p]))
    start = torch.randn(1, q, p, generator=gen)
    out = start.clone()
    returned = factor.two_valued_sum(rows, alpha, total, beta, out=out, accumulate=accumulate)
    expected = beta * total + alpha * dense[rows].sum(0)
    torch.testing.assert_close(out[0], expected + (start[0] if accumulate else 0))
    assert returned is out
    if not accumulate:
        torch.testing.assert_close(factor.two_valued_sum(rows, alpha, total, beta)[0], expected)


def test_two_valued_sum_declines_what_it_cannot_do():
    a, d = torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 5)
    grouped = OuterProductFactor(a, d, torch.Size([10, 4]))
    assert grouped.two_valued_sum(torch.arange(2), 1.0, torch.zeros(10, 4), 1.0) is None
    plain = OuterProductFactor(a[:, :, :1], d[:, :, :1], torch.Size([5, 4]))
    single = torch.zeros(5, 4, dtype=torch.float32)
    assert plain.two_valued_sum(torch.arange(2), 1.0, single, 1.0) is None
    strided = torch.zeros(1, 5, 8)[:, :, :4]
    assert plain.two_valued_sum(torch.arange(2), 1.0, torch.zeros(5, 4), 1.0, strided) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_host_weights_scaled_as_torch_scales_them(dtype):
    """The signed-sum shortcut's host copy of the scaled weights (read without a tensor
    operation where numpy has the dtype) holds the numbers torch's product gives, bitwise."""
    gen = torch.Generator().manual_seed(6)
    weights = (torch.randn(64, 2, generator=gen) * 3).to(dtype)
    for scale in (1.0, 64.0, 3001.0, 0.1, 1 / 3):
        expected = (weights[:, 0] * scale).to(torch.float64).numpy()
        column = step_module._scaled_column(weights, scale)
        assert column.dtype == expected.dtype
        assert (column.view("int64") == expected.view("int64")).all()
