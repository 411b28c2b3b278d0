"""The statistics-source protocol: subscribe, take each backward once, close."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grabkit.stats import PerSampleStats, SketchedStats, StatisticsSource


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()


@pytest.mark.parametrize("kind", ["exact", "sketch"])
def test_each_subscription_takes_every_backward_once(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    stats = PerSampleStats(model) if kind == "exact" else SketchedStats(model, dim=16)
    assert isinstance(stats, StatisticsSource)
    if kind == "sketch":
        assert not hasattr(stats, "statistics")  # the protocol, not an alias, is what is read
    heard: list[int] = []
    first = stats.subscribe(lambda: heard.append(first.take().size))
    second = stats.subscribe()
    assert first.take() is None  # no backward yet
    _backward(model, torch.randn(5, 3))
    assert second.take().size == 5 and second.take() is None  # once per backward
    _backward(model, torch.randn(6, 3))  # the next forward hands the 5 to the listener first
    assert heard == [5]
    assert second.take().size == 6
    first.close()
    _backward(model, torch.randn(7, 3))
    assert heard == [5]  # closed: no longer called
    assert first.take().size == 7  # still readable on demand
    stats.close()
