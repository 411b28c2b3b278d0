"""Layers through the torch.func fallback, activation checkpointing, and clear refusals,
against per-example gradients by one backward per example (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from grabkit.stats import PerSampleStats


def reference_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, d): example i's own loss ``model(x_i).square().sum()``, by its own backward."""
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        model(x[i : i + 1]).square().sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def run_and_compare(model, x, reference_tools, **options):
    reference = reference_rows(model, x)
    with PerSampleStats(model, "sum", **options) as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, reference)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first, self.inner, self.last = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(
            lambda z: torch.tanh(self.inner(z)), self.first(x), use_reentrant=self.reentrant
        )
        return self.last(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_statistics(float64, reference_tools, reentrant):
    torch.manual_seed(0)
    run_and_compare(Checkpointed(reentrant), torch.randn(3, 4), reference_tools)


class Pair(nn.Module):
    """A two-input layer (nn.Bilinear) fed a second input made from the first."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(4, 3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bilinear(x, torch.tanh(x[:, :3]))


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU()), (3, 4)),
        (lambda: nn.Conv3d(2, 3, 2), (3, 2, 3, 3, 3)),
        (lambda: nn.ConvTranspose1d(2, 3, 2), (3, 2, 5)),
        (lambda: nn.ConvTranspose2d(2, 3, 2), (3, 2, 4, 4)),
        (lambda: nn.Sequential(nn.Conv1d(2, 3, 1), nn.InstanceNorm1d(3, affine=True)), (3, 2, 5)),
        (Pair, (5, 4)),
    ],
)
def test_layers_through_the_fallback(float64, reference_tools, make, shape):
    torch.manual_seed(1)
    run_and_compare(make(), torch.randn(*shape), reference_tools, torch_func_fallback=True)


class OwnLSTM(nn.LSTM):
    """An LSTM subclass with its own forward: it inherits no rule (it may compute otherwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


def test_fallback_that_cannot_replay_a_layer_says_so(float64):
    # The fallback replays nn.LSTM's kernel in float32 but not in float64 (no vmap rule), and
    # says so rather than returning numbers.
    with pytest.raises(ValueError, match=r"'<root>' \(OwnLSTM\).*no rule"):
        PerSampleStats(OwnLSTM(4, 4, batch_first=True))
    model = OwnLSTM(4, 4, batch_first=True)
    with PerSampleStats(model, torch_func_fallback=True) as stats:
        model(torch.randn(3, 5, 4)).sum().backward()
        with pytest.raises(NotImplementedError, match="OwnLSTM"):
            stats.norms_squared()


@pytest.mark.slow
def test_resnet18_in_eval_mode(float64, reference_tools):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(2)
    model = torchvision.models.resnet18(num_classes=4).eval()  # BatchNorm on running statistics
    run_and_compare(model, torch.randn(2, 3, 32, 32), reference_tools)
