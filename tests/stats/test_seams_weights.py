"""Weights that are not what the layer's rule sees at read time, each checked against
per-example ``torch.autograd.grad`` in float64 (one backward per example):

1. parameters updated in place between the backward and the read (``optimizer.step()`` before
   ``sampler.step()``), for layers whose rules replay the layer from its weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grabkit.stats import PerSampleStats
from grabkit.stats.identity import WARMUP_STEPS

pytestmark = pytest.mark.usefixtures("float64")

B = 4


def per_example_rows(model: nn.Module, loss_of_example, count: int) -> torch.Tensor:
    """(count, d): gradient of ``loss_of_example(i)`` over the trainable parameters, one
    ``torch.autograd.grad`` per example, in ``named_parameters`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(count):
        grads = torch.autograd.grad(loss_of_example(i), params, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, grads, strict=True)
                ]
            )
        )
    return torch.stack(rows)


def squared_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


# -- 1. parameters updated between the backward and the read ---------------------------------
class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.attention(h, h, h, need_weights=False)[0]


class Cubed(nn.Module):
    """No rule of its own: the torch.func fallback replays it from its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight**3


REPLAYED = {
    "GRU": Recurrent,
    "MultiheadAttention": Attention,
    "torch.func fallback": lambda: nn.Sequential(nn.Linear(3, 3), Cubed()),
}


@pytest.mark.parametrize("kind", sorted(REPLAYED))
@pytest.mark.parametrize("steps_before", [0, WARMUP_STEPS + 2])
def test_a_read_after_an_optimizer_step_is_refused_where_the_rule_replays_the_weights(
    kind, steps_before
):
    """Their rules read the weights at read time: after ``optimizer.step()`` those are other
    weights. Past the identity check's first steps such a read returned the updated weights'
    statistics silently (7% off for the GRU)."""
    torch.manual_seed(0)
    model = REPLAYED[kind]()
    x = torch.randn(B, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with PerSampleStats(model, "sum", torch_func_fallback=True) as stats:
        for _ in range(steps_before):  # read before the update: exact, as documented
            model.zero_grad()
            squared_loss(model, x).backward()
            stats.norms_squared()
            optimizer.step()
        model.zero_grad()
        squared_loss(model, x).backward()
        optimizer.step()
        with pytest.raises(ValueError, match=r"(?s)changed in place since.*before optimizer"):
            stats.norms_squared()


def test_a_read_after_an_optimizer_step_stays_exact_where_the_rule_needs_no_weights(
    reference_tools,
):
    """Linear and LayerNorm factors are made of inputs and output gradients only: a read after
    the update is still the backward's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(B, 3)
    expected = per_example_rows(model, lambda i: squared_loss(model, x[i : i + 1]), B)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with PerSampleStats(model, "sum") as stats:
        squared_loss(model, x).backward()
        optimizer.step()
        assert torch.allclose(stats.norms_squared(), expected.square().sum(1), rtol=1e-10)


def test_a_read_before_the_step_is_kept_when_read_again_after_it(reference_tools):
    torch.manual_seed(0)
    model = Recurrent()
    x = torch.randn(B, 5, 3)
    expected = per_example_rows(model, lambda i: squared_loss(model, x[i : i + 1]), B)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with PerSampleStats(model, "sum") as stats:
        squared_loss(model, x).backward()
        stats.norms_squared()
        optimizer.step()
        reference_tools.assert_matches(stats, expected)
