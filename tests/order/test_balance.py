"""The batched sign recursion takes exactly the decisions of a plain sequential loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.order.reference import ReferenceBalancer, own_options

import grabkit.order.balance as balance_module
from grabkit.order import GraBSampler
from grabkit.order.balance import BlockPolicy, SignRule, run_recursion

BALANCERS = ["mean", "pair", "recursive", "recursive-pair", "batch", "ema", "adamean", "adaema",
             "sign"]  # fmt: skip

# uneven batch sizes, odd ones included (pairs then span batches); the last epoch stops early
SIZES = [[5, 3, 7, 1, 7], [4, 4, 4, 4, 4, 3], [6, 2, 9]]
N, D = 23, 6


def run_against_reference(
    kind: str, probabilistic: bool, c, seed: int = 3, policy: BlockPolicy | None = None
) -> None:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64) + 0.3
    sampler = GraBSampler(
        range(N), balance_type=kind, prob_balance=probabilistic, prob_balance_c=c,
        seed=seed, **own_options(kind, depth=2), block_policy=policy,
    )  # fmt: skip
    ref = ReferenceBalancer(kind, probabilistic=probabilistic, c=c, seed=seed, depth=2)
    if kind == "adamean":
        second_moment = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
        sampler.update_v(second_moment)
        ref.v_scale = second_moment.sqrt() + 1e-8
    order = list(sampler)
    for epoch, sizes in enumerate(SIZES):
        expected = ref.epoch(X, order, sizes, epoch)
        start = 0
        for b in sizes:
            sampler.step(X[order[start : start + b]])
            start += b
        order = list(sampler)  # starts the next epoch
        assert order == expected, f"{kind}: epoch {epoch + 1} order differs"


@pytest.fixture(
    params=["cpu-one-gram", "cpu-blocks", "cpu-3-row-blocks", "cpu-1-row-blocks", "one-transfer"]
)
def balancing_path(request):
    """Run a test through every CPU block shape and the one-transfer (device) path."""
    return {
        "cpu-one-gram": BlockPolicy(),  # short rows: pair's differences all at once
        "cpu-blocks": BlockPolicy(one_gram_macs=0),
        "one-transfer": BlockPolicy(rows=0),
        "cpu-3-row-blocks": BlockPolicy(rows=3, one_gram_macs=0),
        # what long gradients get: one row a block
        "cpu-1-row-blocks": BlockPolicy(max_bytes=1, one_gram_macs=0),
    }[request.param]


@pytest.mark.parametrize("kind", BALANCERS)
def test_deterministic_decisions_equal_sequential_loop(kind, balancing_path):
    run_against_reference(kind, probabilistic=False, c=None, policy=balancing_path)


@pytest.mark.parametrize("kind", BALANCERS)
@pytest.mark.parametrize("c", [None, 0.5])
def test_probabilistic_decisions_equal_sequential_loop(kind, c, balancing_path):
    run_against_reference(kind, probabilistic=True, c=c, policy=balancing_path)


def test_run_recursion_matches_explicit_tree_walk():
    rng = np.random.default_rng(0)
    Z = rng.normal(size=(12, 4))
    S = rng.normal(size=(7, 4))  # a depth-2 tree of running sums
    signs, leaves, coef = run_recursion(Z @ S.T, Z @ Z.T, SignRule(), depth=2)
    sums = S.copy()
    for i, z in enumerate(Z):
        node = 0
        for level in range(3):
            eps = 1.0 if sums[node] @ z < 0 else -1.0
            assert signs[i, level] == eps
            sums[node] += eps * z
            if level < 2:
                node = 2 * node + 1 if eps > 0 else 2 * node + 2
        assert leaves[i] == node
    np.testing.assert_allclose(S + coef @ Z, sums)


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive", "recursive-pair", "batch", "ema"])
def test_one_host_transfer_per_batch(kind, monkeypatch):
    """Each step moves the batch's inner products to the host once (not once per example)."""
    calls = []
    real = balance_module.fetch_inner_products

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(balance_module, "fetch_inner_products", counting)
    import grabkit.order.orderings.pair as pair_module
    import grabkit.order.orderings.recursive_pair as rp_module

    monkeypatch.setattr(pair_module, "fetch_inner_products", counting)
    monkeypatch.setattr(rp_module, "fetch_inner_products", counting)
    X = torch.randn(32, 10)
    one_transfer = BlockPolicy(rows=0)  # as for device batches
    sampler = GraBSampler(range(32), balance_type=kind, block_policy=one_transfer)
    order = list(sampler)
    for start in range(0, 32, 8):
        sampler.step(X[order[start : start + 8]])
    assert len(calls) == 4


def test_rule_rejects_bad_constant():
    with pytest.raises(ValueError, match="prob_balance_c"):
        SignRule(True, c=0.0)
    with pytest.raises(ValueError, match="prob_balance_c"):
        SignRule(True, c="big")


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["mean", "pair", "recursive", "sign", "adamean", "norm", "greedy"]),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    probabilistic=st.booleans(),
    seed=st.integers(0, 100),
)
def test_sequential_orderings_ignore_how_an_epoch_is_cut_into_batches(
    kind, cuts, probabilistic, seed
):
    """The sequential rule sees one example at a time, so batch boundaries cannot matter."""
    n = sum(cuts)
    X = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    whole = GraBSampler(
        range(n), balance_type=kind, prob_balance=probabilistic, **own_options(kind, depth=2)
    )
    pieces = GraBSampler(
        range(n), balance_type=kind, prob_balance=probabilistic, **own_options(kind, depth=2)
    )
    for _ in range(3):
        order = list(whole)
        assert list(pieces) == order
        whole.step(X[order])
        start = 0
        for b in cuts:
            pieces.step(X[order[start : start + b]])
            start += b
    assert list(whole) == list(pieces)


@pytest.mark.parametrize("probabilistic", [False, True])
def test_flat_recursion_gives_the_numbers_of_a_scalar_loop(probabilistic):
    """The vectorised row updates add the same floating-point numbers in the same order."""
    rng = np.random.default_rng(1)
    Z = rng.normal(size=(40, 7))
    values = rng.normal(size=(40, 1)) * 1e-3
    kernel = Z @ Z.T
    rule = SignRule(probabilistic=probabilistic)
    rule.start_epoch(0, 0)
    uniforms = rule.uniforms(40)
    signs, _, _ = run_recursion(values, kernel, rule, uniforms=uniforms)
    reference = SignRule(probabilistic=probabilistic)
    pending = values[:, 0].tolist()
    for i in range(40):
        eps = reference.decide(pending[i], None if uniforms is None else float(uniforms[i]))
        assert signs[i, 0] == eps
        for later in range(i + 1, 40):
            pending[later] += eps * kernel[i, later]
