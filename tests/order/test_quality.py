"""Balancing works: herding bounds fall well below random reshuffling's on fixed vectors."""

from __future__ import annotations

import statistics

import pytest
import torch
from tests.order.reference import own_options

from grabkit.order import GraBSampler, herding_bound

N, D, BATCH, EPOCHS = 512, 8, 64, 5


@pytest.fixture(scope="module")
def vectors() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def epoch_bounds(X: torch.Tensor, scale: float = 1.0, **kwargs) -> list[float]:
    """The herding bound of every epoch's order, in units of the unscaled vectors."""
    sampler = GraBSampler(range(N), seed=1, **kwargs)
    bounds = []
    for _ in range(EPOCHS):
        order = list(sampler)
        bounds.append(herding_bound(X, order))
        for start in range(0, N, BATCH):
            sampler.step(scale * X[order[start : start + BATCH]])
    return bounds


@pytest.fixture(scope="module")
def random_reshuffling(vectors) -> float:
    return statistics.mean(epoch_bounds(vectors, balance_type="rr"))


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive"])
def test_grab_herding_bound_well_below_random_reshuffling(vectors, random_reshuffling, kind):
    bounds = epoch_bounds(vectors, balance_type=kind, **own_options(kind, depth=2))
    assert bounds[-1] < 0.35 * random_reshuffling, (kind, bounds, random_reshuffling)


@pytest.mark.parametrize("scale", [1e-3, 1e3])
@pytest.mark.parametrize("kind", ["mean", "pair"])
def test_probabilistic_balancing_beats_random_reshuffling_at_any_scale(
    vectors, random_reshuffling, scale, kind
):
    bounds = epoch_bounds(vectors, scale, balance_type=kind, prob_balance=True)
    assert bounds[-1] < 0.5 * random_reshuffling, (scale, bounds, random_reshuffling)


def test_scale_aware_constant_makes_the_walk_scale_free(vectors):
    small = GraBSampler(range(N), prob_balance=True, seed=4)
    large = GraBSampler(range(N), prob_balance=True, seed=4)
    for _ in range(3):
        order = list(small)
        assert list(large) == order
        for start in range(0, N, BATCH):
            small.step(1e-3 * vectors[order[start : start + BATCH]])
            large.step(1e3 * vectors[order[start : start + BATCH]])
    assert list(small) == list(large)


def test_greedy_is_better_than_online_mean_on_fixed_vectors(vectors, random_reshuffling):
    greedy = epoch_bounds(vectors, balance_type="greedy")
    assert greedy[-1] < 0.2 * random_reshuffling
