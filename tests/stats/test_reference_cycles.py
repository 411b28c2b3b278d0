"""A measured step leaves no reference cycles behind: what the hooks keep for a step is freed by
reference counting when the next step begins, not left for Python's cyclic garbage collector
(whose collections then land inside the next backward, and which holds the step's tensors until
it runs). A cycle a step leaves is found by counting what ``gc.collect()`` frees after steps run
with the collector off."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.order import GraBSampler
from grabkit.stats import PerSampleStats, SketchedStats


class TiedHead(nn.Module):
    """An embedding whose weight is also the output layer (a functional use of a tracked weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(20, 8), nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.lin(self.emb(tokens))), self.emb.weight)


class LastState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)),
        lambda: torch.randn(5, 4),
    ),
    "conv": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(48, 2)),
        lambda: torch.randn(5, 2, 6, 6),
    ),
    "norms": (
        lambda: nn.Sequential(
            nn.Linear(4, 6), nn.LayerNorm(6), nn.GroupNorm(2, 6), nn.Linear(6, 2)
        ),
        lambda: torch.randn(5, 4),
    ),
    "tied head": (TiedHead, lambda: torch.randint(0, 20, (5, 3))),
    "lstm": (LastState, lambda: torch.randn(5, 3, 4)),
}


def cyclic_garbage(step: Callable[[], None], steps: int = 10) -> int:
    """Objects that only the cyclic collector frees, left by ``steps`` calls of ``step``."""
    for _ in range(3):
        step()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            step()
        return gc.collect()
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["exact", "sketch"])
@pytest.mark.parametrize("model_name", MODELS)
def test_a_statistics_step_leaves_no_cycles(model_name, mode):
    torch.manual_seed(0)
    make_model, make_input = MODELS[model_name]
    model = make_model()
    stats = PerSampleStats(model) if mode == "exact" else SketchedStats(model, dim=16)
    read = stats.norms_squared if mode == "exact" else stats.sketches

    def step() -> None:
        model(make_input()).pow(2).sum().backward()
        read()

    with stats:
        assert cyclic_garbage(step) == 0


@pytest.mark.parametrize("statistics", ["exact", "sketch"])
def test_a_hook_mode_grab_step_leaves_no_cycles(statistics):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    extra = {"sketch_dim": 16} if statistics == "sketch" else {}
    sampler = GraBSampler(range(40), model=model, batch_size=4, statistics=statistics, **extra)
    order: list[int] = []

    def step() -> None:
        if not order:
            order.extend(iter(sampler))
        idx = order[:4]
        del order[:4]
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        sampler.step()

    try:
        assert cyclic_garbage(step) == 0
    finally:
        sampler.close()
