"""The hook-statistics path of balancing: products with the fixed vectors given apart, and running
sums updated in place, against the dense path on the same gradients."""

from __future__ import annotations

import copy
import pickle
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.order import GraBSampler
from grabkit.order.balance import FixedGram, apply_update, fetch_inner_products
from grabkit.order.orderings.centred import _CentreRow
from grabkit.stats import PerSampleStats
from grabkit.stats.gradient_batch import DenseGradientBatch


def test_fixed_vectors_given_apart_equal_stacked():
    gen = torch.Generator().manual_seed(0)
    batch = DenseGradientBatch(torch.randn(5, 7, generator=gen, dtype=torch.float64))
    sums = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    fixed = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    stacked = fetch_inner_products(batch, torch.cat([sums, fixed]), num_fixed=3)
    apart = fetch_inner_products(batch, sums, fixed=fixed)
    np.testing.assert_allclose(apart.gram, stacked.gram)
    np.testing.assert_allclose(apart.xv, stacked.xv)
    np.testing.assert_allclose(apart.fv, stacked.fv)
    assert apart.xv.shape == (5, 5) and apart.fv.shape == (3, 5)


def test_hook_batch_products_and_update_equal_dense():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    with PerSampleStats(model) as stats:
        F.cross_entropy(model(x), y).backward()
        hook = stats.gradient_batch()
        dense = DenseGradientBatch(hook.weighted_sum(torch.eye(8, dtype=torch.float64)))
    gen = torch.Generator().manual_seed(1)
    sums = torch.randn(1, hook.dim, generator=gen, dtype=torch.float64)
    centre = torch.randn(1, hook.dim, generator=gen, dtype=torch.float64)
    expected = fetch_inner_products(dense, torch.cat([sums, centre]), num_fixed=1)
    actual = fetch_inner_products(hook, sums, fixed=centre)
    np.testing.assert_allclose(actual.xv, expected.xv, rtol=1e-10)
    np.testing.assert_allclose(actual.fv, expected.fv, rtol=1e-10)
    signs = np.where(np.arange(8) % 3 == 0, 1.0, -1.0)[:, None]
    on_hook, on_dense = sums.clone(), sums.clone()
    apply_update(on_hook, hook, signs, centre, np.array([[-2.0]]))
    apply_update(on_dense, dense, signs, centre, np.array([[-2.0]]))
    torch.testing.assert_close(on_hook, on_dense)


def test_fixed_gram_is_formed_once_per_centre_and_again_after_any_change():
    gen = torch.Generator().manual_seed(2)
    centre = torch.randn(1, 9, generator=gen, dtype=torch.float64)
    gram = FixedGram()
    first = gram(centre)
    assert torch.equal(first, centre @ centre.T)
    assert gram(centre) is first  # the same centre: not formed again
    assert gram(centre.reshape(1, -1)) is first  # a new view of the same numbers
    centre.mul_(3.0)  # changed in place: formed again
    assert torch.equal(gram(centre), centre @ centre.T)
    other = centre.clone().add_(1.0)  # another tensor
    assert torch.equal(gram(other), other @ other.T)
    assert torch.equal(gram(other.float()), other.float() @ other.float().T)


def test_fixed_gram_keeps_no_centre_alive():
    gram = FixedGram()
    centre = torch.randn(1, 9)
    gram(centre.reshape(1, -1))
    held = weakref.ref(centre)
    del centre
    assert held() is None  # a rolled centre is freed as before
    fresh = torch.randn(1, 9)  # possibly at the old one's address: never taken for it
    assert torch.equal(gram(fresh), fresh @ fresh.T)


def test_hook_products_with_a_kept_centre_gram_are_those_formed_each_batch():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    gen = torch.Generator().manual_seed(4)
    centre = None
    gram = FixedGram()
    with PerSampleStats(model) as stats:
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            hook = stats.gradient_batch()
            if centre is None:
                centre = torch.randn(1, hook.dim, generator=gen)
            sums = torch.randn(1, hook.dim, generator=gen)
            fresh = fetch_inner_products(hook, sums, fixed=centre)
            kept = fetch_inner_products(hook, sums, fixed=centre, fixed_gram=gram)
            for a, b in [(fresh.gram, kept.gram), (fresh.xv, kept.xv), (fresh.fv, kept.fv)]:
                np.testing.assert_array_equal(a, b)


def test_centre_row_kept_for_a_centre_seen_twice_and_never_for_one_made_per_batch():
    rows = _CentreRow()
    centre = torch.randn(9)
    first = rows(centre)
    assert torch.equal(first, centre.reshape(1, -1))
    kept = rows(centre)
    assert rows(centre) is kept  # the same view object: its per-parameter cuts are kept
    centre.mul_(2.0)
    assert torch.equal(rows(centre), centre.reshape(1, -1))  # a view: sees in-place changes
    made = torch.randn(9)  # a centre made for one batch (an EMA): not held
    rows(made)
    held = weakref.ref(made)
    del made
    assert held() is None
    rows(centre)
    rows(centre)
    held = weakref.ref(centre)
    assert copy.deepcopy(rows)._row is None and pickle.loads(pickle.dumps(rows))._row is None
    rows.clear()
    del centre, first, kept
    assert held() is None  # cleared: the centre is freed


def test_hook_mode_stale_mean_frees_the_rolled_centre():
    """The previous epoch's mean is freed when the next one rolls in (nothing keeps it)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    sampler = GraBSampler(range(8), model=model, balance_type="mean", batch_size=4)
    held = None
    for _ in range(3):
        for batch in torch.tensor(list(sampler)).split(4):
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            sampler.step()
            model.zero_grad()
        mean = sampler.ordering.mean.value
        if held is not None:
            assert held() is None  # the centre of two epochs ago
        held = None if mean is None else weakref.ref(mean)
        del mean
    sampler.close()
