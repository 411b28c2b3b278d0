"""Semantics of the individual orderings (the balancers' decisions are in test_balance.py)."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

import grabkit.order.orderings.store as store_module
from grabkit.order import GraBSampler
from grabkit.order.orderings.greedy import greedy_herding_order
from grabkit.order.orderings.ntk import eigen_order


def step_epoch(sampler: GraBSampler, X: torch.Tensor, batch_size: int = 4) -> list[int]:
    order = list(sampler)
    for start in range(0, len(order), batch_size):
        sampler.step(X[order[start : start + batch_size]])
    return order


def test_baselines_rr_so_fixed_flipflop():
    X = torch.randn(9, 2)
    rr = GraBSampler(range(9), balance_type="rr")
    assert step_epoch(rr, X) != step_epoch(rr, X)
    so = GraBSampler(range(9), balance_type="so")
    assert step_epoch(so, X) == step_epoch(so, X)
    fixed = GraBSampler(range(4), balance_type="fixed", orders=[2, 0, 3, 1])
    assert list(fixed) == [2, 0, 3, 1] == list(fixed)
    ff = GraBSampler(range(9), balance_type="flipflop")
    e0, e1, e2, e3 = (step_epoch(ff, X) for _ in range(4))
    assert e1 == e0[::-1] and e3 == e2[::-1] and e2 != e0


def test_norm_orders_by_gradient_norm():
    X = torch.tensor([[1.0], [5.0], [-3.0], [0.5], [2.0]])
    largest_first = GraBSampler(range(5), balance_type="norm")
    step_epoch(largest_first, X, 2)
    assert list(largest_first) == [1, 2, 4, 0, 3]
    smallest_first = GraBSampler(range(5), balance_type="norm", descending_norm=False)
    step_epoch(smallest_first, X, 2)
    assert list(smallest_first) == [3, 0, 4, 2, 1]


def test_norm_puts_unstepped_examples_last():
    X = torch.arange(1.0, 7.0).reshape(6, 1)
    sampler = GraBSampler(range(6), balance_type="norm", random_first_epoch=False)
    list(sampler)
    sampler.step(X[[0, 1, 2]])
    assert list(sampler) == [2, 1, 0, 3, 4, 5]


def test_recursive_depth_zero_is_mean_balance():
    X = torch.randn(15, 3, dtype=torch.float64)
    mean = GraBSampler(range(15), balance_type="mean", seed=3)
    rec = GraBSampler(range(15), balance_type="recursive", depth=0, seed=3)
    for _ in range(3):
        assert step_epoch(mean, X) == step_epoch(rec, X)


def test_adamean_with_unit_scale_centres_like_mean():
    X = torch.randn(15, 3, dtype=torch.float64) + 2.0  # a large mean: centring matters
    mean = GraBSampler(range(15), balance_type="mean", seed=3)
    ada = GraBSampler(range(15), balance_type="adamean", seed=3, eps=0.0)
    ada.update_v(torch.ones(3, dtype=torch.float64))
    for _ in range(3):
        assert step_epoch(mean, X) == step_epoch(ada, X)


def test_update_v_accepts_dicts_and_rejects_other_orderings():
    ada = GraBSampler(range(4), {"a": torch.zeros(2), "b": torch.zeros(1)}, balance_type="adamean")
    ada.update_v({"a": torch.ones(2), "b": torch.ones(1)})
    list(ada)
    with pytest.raises(ValueError, match="update_v"):
        ada.update_v(torch.ones(5))
        ada.step(torch.randn(2, 3))
    with pytest.raises(TypeError, match="adamean"):
        GraBSampler(range(4)).update_v(torch.ones(3))


def test_greedy_order_matches_brute_force_greedy():
    V = torch.randn(10, 4, dtype=torch.float64)
    Z = V - V.mean(0)
    s, left, expected = torch.zeros(4, dtype=torch.float64), list(range(10)), []
    for _ in range(10):
        j = min(left, key=lambda c: float((s + Z[c]).norm()))
        expected.append(j)
        left.remove(j)
        s = s + Z[j]
    assert greedy_herding_order(V).tolist() == expected


def test_ntk_eigen_orders_by_the_smallest_eigenvector():
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    K = torch.tensor(Q @ np.diag([0.1, 1, 2, 3, 4, 5]) @ Q.T)
    v = torch.tensor(Q[:, 0])
    v = v * torch.sign(v.sum())
    sampler = GraBSampler(range(6), balance_type="ntk-fixed-eigen", ntk_kernel=K)
    assert list(sampler) == torch.argsort(v, descending=True).tolist()
    largest = eigen_order(K, largest_eig=True, descending_eig=False, abs_eig=True)
    assert largest.tolist() == torch.argsort(torch.tensor(Q[:, 5]).abs()).tolist()


def test_ntk_fixed_from_features_or_kernel_is_one_fixed_permutation():
    F = torch.randn(12, 5, dtype=torch.float64)
    a = GraBSampler(range(12), balance_type="ntk-fixed", ntk_features=F, num_rounds=4)
    b = GraBSampler(range(12), balance_type="ntk-fixed", ntk_kernel=F @ F.T, num_rounds=4)
    first = step_epoch(a, F)
    assert sorted(first) == list(range(12)) and first == step_epoch(a, F) == list(b)
    with pytest.raises(ValueError, match="not both"):
        GraBSampler(range(12), balance_type="ntk-fixed", ntk_features=F, ntk_kernel=F @ F.T)
    with pytest.raises(ValueError, match="one row per example"):
        GraBSampler(range(11), balance_type="ntk-fixed", ntk_features=F)


def test_ntk_eigen_recomputes_from_observed_gradients():
    X = torch.randn(8, 12, dtype=torch.float64)  # full-rank kernel: a unique eigenvector
    sampler = GraBSampler(range(8), balance_type="ntk-eigen")
    step_epoch(sampler, X)
    expected = eigen_order(X @ X.T)
    assert list(sampler) == expected.tolist()


def test_memory_warning_for_kernels_and_gradient_tables(monkeypatch):
    monkeypatch.setattr(store_module, "MEMORY_WARNING_BYTES", 100)
    F = torch.randn(6, 2)
    with pytest.warns(ResourceWarning, match=r"\(6, 6\) float64 kernel"):
        GraBSampler(range(6), balance_type="ntk-fixed-eigen", ntk_features=F)
    sampler = GraBSampler(range(6), balance_type="greedy")
    list(sampler)
    with pytest.warns(ResourceWarning, match="one gradient per example"):
        sampler.step(torch.randn(3, 50))
    tree = GraBSampler(range(6), balance_type="recursive", depth=3)
    list(tree)
    with pytest.warns(ResourceWarning, match="15 running sums"):
        tree.step(torch.randn(3, 50))


def test_balance_type_accepts_an_enum_member():
    class BalanceType(enum.Enum):
        PAIR_BALANCE = "pair"

    assert GraBSampler(range(4), balance_type=BalanceType.PAIR_BALANCE).balance_type == "pair"


def test_stale_mean_running_sum_is_updated_in_place_but_never_a_loaded_one():
    from grabkit.order.orderings.centred import StaleMean

    mean = StaleMean()
    mean.add(torch.ones(3), 2)
    running = mean.running_sum
    mean.add(torch.ones(3), 2)
    assert mean.running_sum is running  # no new tensor per batch
    torch.testing.assert_close(running, torch.full((3,), 2.0))
    saved = mean.state_dict()
    other = StaleMean()
    other.load_state_dict(saved)
    other.add(torch.ones(3), 1)
    torch.testing.assert_close(saved["running_sum"], torch.full((3,), 2.0))
    mean.roll()
    torch.testing.assert_close(mean.value, torch.full((3,), 0.5))


def test_stale_mean_takes_hook_batches_without_forming_their_sum():
    from torch import nn

    from grabkit.order.orderings.centred import StaleMean
    from grabkit.stats import PerSampleStats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    direct, from_batches = StaleMean(), StaleMean()
    with PerSampleStats(model) as stats:
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(5, 3, generator=gen)
            model(x).square().mean().backward()
            batch = stats.gradient_batch()
            direct.add(batch.total(), 5)
            from_batches.add_batch(batch, 5)
            model.zero_grad()
    torch.testing.assert_close(from_batches.running_sum, direct.running_sum)
    assert from_batches.count == direct.count == 15
