"""Sketched statistics on steps the identity check does not check (after the warm-up, with the
budget at 0): the seams the parameters' ``AccumulateGrad`` hooks cover (which backwards belong
to the step, the trainable set) hold there too, against the explicit map on per-example
autograd gradients (float64). A guard for any change to how those hooks are placed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import identity
from grabkit.stats.sketch import SketchedStats

pytestmark = pytest.mark.usefixtures("float64")

B, DIM = 6, 32


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, generator=gen), torch.randint(0, 3, (B,), generator=gen)


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def expected_sketches(stats: SketchedStats, net: nn.Module, x, y) -> torch.Tensor:
    """(B, k): the stats' map applied to each example's own gradient (trainable parameters)."""
    params = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        loss = per_example_loss(net(x[i : i + 1]), y[i : i + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows) @ stats.sketch.matrix().T


def warm_up(stats: SketchedStats, net: nn.Module) -> None:
    """The identity check's warm-up steps (each checked, so its parameters hooked)."""
    for step in range(identity.WARMUP_STEPS + 1):
        x, y = data(100 + step)
        per_example_loss(net(x), y).mean().backward()
        stats.sketches()


@pytest.fixture
def unchecked(monkeypatch):
    """After the warm-up, no step is checked: the parameters are never hooked."""
    monkeypatch.setattr(identity, "BUDGET", 0.0)


def assert_unchecked_step(stats: SketchedStats, checked_before: int) -> None:
    assert stats.engine._identity.checked_steps == checked_before  # this step was not checked


def assert_an_unchecked_step_is_exact(stats: SketchedStats, net: nn.Module, seed: int) -> None:
    """One more step, which the identity check does not check: sketched as per-example
    autograd sketches it."""
    checked = stats.engine._identity.checked_steps
    x, y = data(seed)
    per_example_loss(net(x), y).mean().backward()
    sketches = stats.sketches()
    assert_unchecked_step(stats, checked)
    assert stats.backward_seen and stats.parameter_gradients_seen
    torch.testing.assert_close(sketches, expected_sketches(stats, net, x, y))


@pytest.mark.usefixtures("unchecked")
def test_a_plain_step_is_sketched():
    net = model()
    with SketchedStats(net, dim=DIM) as stats:
        warm_up(stats, net)
        assert_an_unchecked_step_is_exact(stats, net, seed=0)


@pytest.mark.usefixtures("unchecked")
def test_unfreezing_a_layer_whose_only_parameter_was_frozen_is_followed():
    """The last layer's parameters are frozen at attach: one unfrozen later, its layer joins
    (the trainable set is read at the next forward), on unchecked steps too; another frozen,
    it leaves."""
    net = model()
    net[4].bias.requires_grad_(False)
    net[4].weight.requires_grad_(False)
    with SketchedStats(net, dim=DIM) as stats:
        warm_up(stats, net)
        net[4].weight.requires_grad_(True)
        warm_up(stats, net)  # a new trainable set: a new warm-up
        assert_an_unchecked_step_is_exact(stats, net, seed=1)
        assert "4.weight" in stats.engine.param_shapes

        net[0].weight.requires_grad_(False)
        warm_up(stats, net)
        assert_an_unchecked_step_is_exact(stats, net, seed=2)
        assert "0.weight" not in stats.engine.param_shapes


@pytest.mark.usefixtures("unchecked")
@pytest.mark.parametrize("inputs", ["some parameters", "parameters and input"])
def test_autograd_grad_of_parameters_before_the_backward_is_not_counted(inputs):
    """A look-ahead ``torch.autograd.grad(loss, params)`` (and one with the input among its
    inputs) before ``loss.backward()``: its output gradients are not the step's, on an
    unchecked step as on a checked one."""
    net = model()
    with SketchedStats(net, dim=DIM) as stats:
        warm_up(stats, net)
        checked = stats.engine._identity.checked_steps
        x, y = data(3)
        x.requires_grad_(True)
        loss = per_example_loss(net(x), y).mean()
        wanted = [net[0].weight, net[2].bias]
        if inputs == "parameters and input":
            wanted.append(x)
        torch.autograd.grad(loss, wanted, retain_graph=True)
        loss.backward()
        sketches = stats.sketches()
        assert_unchecked_step(stats, checked)
        torch.testing.assert_close(sketches, expected_sketches(stats, net, x.detach(), y))


@pytest.mark.usefixtures("unchecked")
def test_backward_with_inputs_reads_only_the_parameters_it_accumulates_into():
    """``loss.backward(inputs=[...])`` accumulates into those parameters only: the others'
    parts of the sketches are left out."""
    net = model()
    with SketchedStats(net, dim=DIM) as stats:
        warm_up(stats, net)
        checked = stats.engine._identity.checked_steps
        x, y = data(4)
        per_example_loss(net(x), y).mean().backward(inputs=[net[2].weight, net[4].weight])
        factors, _, _ = stats.engine.step_factors()
        assert_unchecked_step(stats, checked)
        assert {name for name, f in factors.items() if f is not None} == {"2.weight", "4.weight"}


@pytest.mark.usefixtures("unchecked")
def test_a_weight_used_outside_its_uncalled_layer_is_refused_on_unchecked_steps():
    """A layer not called, its weight used functionally (the watch off) in a backward that
    also runs through other layers: refused on every step, checked or not."""

    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(torch.tanh(self.first(x)), self.second.weight)

    torch.manual_seed(0)
    net = Outside()
    with SketchedStats(net, dim=DIM, functional_uses=False) as stats:
        for step in range(identity.WARMUP_STEPS + 1):
            x, y = data(step)
            per_example_loss(net(x), y).mean().backward()
            with pytest.raises(RuntimeError, match="used outside its layer"):
                stats.sketches()
