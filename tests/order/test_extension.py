"""Extending ordering from outside the package: one file, one registration; instances accepted."""

from __future__ import annotations

import pytest
import torch

from grabkit import GraBSampler
from grabkit.order import BALANCE_TYPES, Ordering, register_ordering
from grabkit.order.orderings import ORDERINGS
from grabkit.order.orderings.pair import PairBalance
from grabkit.stats.gradient_batch import GradientBatch


@register_ordering
class SmallestNormFirst(Ordering):
    """Toy: next epoch visits the examples by increasing gradient norm (unseen ones last)."""

    name = "toy-smallest-norm"

    def __init__(self, n: int, *, power: float = 2.0, **kwargs) -> None:
        super().__init__(n, **kwargs)
        if power <= 0:
            raise ValueError(f"`power` should be positive, but got power={power!r}")
        self.power = power
        self.norms: dict[int, float] = {}

    def start_epoch(self, epoch: int) -> None:
        self.norms.clear()

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        values = batch.norms_squared().pow(self.power / 2).tolist()
        self.norms.update(zip(indices.tolist(), values, strict=True))

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        seen = sorted(self.norms, key=self.norms.__getitem__)
        rest = [i for i in order.tolist() if i not in self.norms]
        return torch.tensor(seen + rest)


def test_a_registered_toy_ordering_runs_with_its_own_option():
    assert ORDERINGS["toy-smallest-norm"] is SmallestNormFirst
    assert SmallestNormFirst.option_names() == {"power": 2.0}
    X = torch.tensor([[3.0], [1.0], [2.0], [0.5]], dtype=torch.float64)
    sampler = GraBSampler(range(4), balance_type="toy-smallest-norm", power=1.0, seed=0)
    order = list(sampler)
    sampler.step(X[order])
    assert list(sampler) == [3, 1, 2, 0]
    assert sampler.state_dict()["config"]["power"] == 1.0
    assert "toy-smallest-norm" not in BALANCE_TYPES  # the built-in list is unchanged


def test_an_ordering_instance_is_accepted():
    X = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    by_name = GraBSampler(range(10), balance_type="pair", seed=4)
    by_instance = GraBSampler(range(10), ordering=PairBalance(10, seed=4))
    for _ in range(3):
        order = list(by_name)
        assert list(by_instance) == order
        for s in (by_name, by_instance):
            s.step(X[order])
    assert by_instance.balance_type == "pair"


def test_sampler_settings_an_instance_would_ignore_are_refused():
    for kwargs in ({"seed": 3}, {"prob_balance": True}, {"depth": 2}, {"balance_type": "mean2"}):
        with pytest.raises(ValueError, match="instance's own configuration"):
            GraBSampler(range(6), ordering=PairBalance(6), **kwargs)
    with pytest.raises(ValueError, match="built for n=5"):
        GraBSampler(range(6), ordering=PairBalance(5))
    sampler = GraBSampler(range(6), ordering=PairBalance(6, seed=3))
    assert sampler.seed == 3 and sampler.state_dict()["config"]["seed"] == 3
