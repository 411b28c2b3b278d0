"""Factor algebra against explicitly materialised per-example gradients (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grabkit.stats.factors import EmbeddingFactor, OuterProductFactor, PerExampleFactor

SETTINGS = settings(max_examples=25, deadline=None)


def check_factor(factor, dense: torch.Tensor, seed: int) -> None:
    """All four reads of ``factor`` against the dense (B, *shape) per-example gradients."""
    gen = torch.Generator().manual_seed(seed)
    b = dense.shape[0]
    flat = dense.reshape(b, -1)
    vectors = torch.randn(3, *dense.shape[1:], generator=gen, dtype=dense.dtype)
    weights = torch.randn(b, 2, generator=gen, dtype=dense.dtype)
    torch.testing.assert_close(factor.norms_squared(), (flat * flat).sum(1))
    torch.testing.assert_close(factor.gram(), flat @ flat.T)
    torch.testing.assert_close(factor.dot(vectors), flat @ vectors.reshape(3, -1).T)
    expected = (weights.T @ flat).reshape(2, *dense.shape[1:])
    torch.testing.assert_close(factor.weighted_sum(weights), expected)
    torch.testing.assert_close(factor.weighted_sum(weights[:, :1]), expected[:1])
    # into views of a larger flat buffer, as HookGradientBatch does: contiguous for k = 1,
    # strided for k = 2
    n = flat.shape[1]
    for k in (1, 2):
        buffer = torch.full((k, n + 3), float("nan"), dtype=dense.dtype)
        view = buffer[:, 1 : n + 1].view(k, *dense.shape[1:])
        returned = factor.weighted_sum(weights[:, :k], out=view)
        torch.testing.assert_close(view, expected[:k])
        torch.testing.assert_close(returned, expected[:k])
        assert buffer[:, 0].isnan().all() and buffer[:, n + 1 :].isnan().all()


@SETTINGS
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    g=st.integers(1, 3),
    p=st.integers(1, 6),
    q=st.integers(1, 6),
    strategy=st.sampled_from(["auto", "ghost", "materialise"]),
    seed=st.integers(0, 2**16),
)
def test_outer_product_factor_matches_materialised(b, t, g, p, q, strategy, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(b, t, g, p, generator=gen, dtype=torch.float64)
    d = torch.randn(b, t, g, q, generator=gen, dtype=torch.float64)
    dense = torch.einsum("btgq,btgp->bgqp", d, a).reshape(b, g * q, p)
    factor = OuterProductFactor(a, d, torch.Size([g * q, p]), strategy=strategy)
    check_factor(factor, dense, seed)


@SETTINGS
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    rows=st.integers(1, 5),
    dim=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_embedding_factor_matches_materialised(b, t, rows, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (b, t), generator=gen)  # few rows: repeats are common
    d = torch.randn(b, t, dim, generator=gen, dtype=torch.float64)
    dense = torch.zeros(b, rows, dim, dtype=torch.float64)
    for i in range(b):
        dense[i].index_add_(0, idx[i], d[i])
    check_factor(EmbeddingFactor(idx, d, torch.Size([rows, dim])), dense, seed)


def test_embedding_gram_chunks_agree(monkeypatch):
    import grabkit.stats.factors as factors

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 4, (6, 3), generator=gen)
    d = torch.randn(6, 3, 2, generator=gen, dtype=torch.float64)
    whole = EmbeddingFactor(idx, d, torch.Size([4, 2])).gram()
    monkeypatch.setattr(factors, "_EMBEDDING_GRAM_CHUNK_ENTRIES", 40)  # two examples per chunk
    torch.testing.assert_close(EmbeddingFactor(idx, d, torch.Size([4, 2])).gram(), whole)


def test_merge_adds_per_example_gradients():
    gen = torch.Generator().manual_seed(1)
    a1, a2 = torch.randn(2, 3, 1, 4, generator=gen, dtype=torch.float64).unbind(0)
    d1, d2 = torch.randn(2, 3, 1, 5, generator=gen, dtype=torch.float64).unbind(0)
    first = OuterProductFactor(a1.unsqueeze(1), d1.unsqueeze(1), torch.Size([5, 4]))
    second = OuterProductFactor(a2.unsqueeze(1), d2.unsqueeze(1), torch.Size([5, 4]))
    dense = torch.einsum("bq,bp->bqp", d1[:, 0], a1[:, 0]) + torch.einsum(
        "bq,bp->bqp", d2[:, 0], a2[:, 0]
    )
    check_factor(first.merge(second), dense, 1)
    g1, g2 = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64).unbind(0)
    merged = PerExampleFactor(g1, torch.Size([4])).merge(PerExampleFactor(g2, torch.Size([4])))
    check_factor(merged, g1 + g2, 2)
    with pytest.raises(TypeError, match="cannot merge"):
        first.merge(merged)


def test_half_precision_inputs_accumulate_in_float32():
    a = torch.randn(2, 3, 1, 4).to(torch.bfloat16)
    d = torch.randn(2, 3, 1, 5).to(torch.bfloat16)
    factor = OuterProductFactor(a, d, torch.Size([5, 4]))
    assert factor.norms_squared().dtype == torch.float32
    assert factor.gram().dtype == torch.float32


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="`strategy` should be one of"):
        OuterProductFactor(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1), (1, 1), "fast")
