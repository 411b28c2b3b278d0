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


@SETTINGS
@given(
    b=st.integers(2, 4),
    t=st.integers(1, 6),
    rows=st.integers(1, 8),
    dim=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_embedding_factor_with_indices_shared_by_the_batch(b, t, rows, dim, seed):
    """Positions looked up once and expanded over the batch (stride 0): the (T, T) form."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, rows, (t,), generator=gen)  # repeats included
    idx = shared.unsqueeze(0).expand(b, t)
    d = torch.randn(b, t, dim, generator=gen, dtype=torch.float64)
    dense = torch.zeros(b, rows, dim, dtype=torch.float64)
    for i in range(b):
        dense[i].index_add_(0, shared, d[i])
    check_factor(EmbeddingFactor(idx, d, torch.Size([rows, dim])), dense, seed)


def test_linear_bias_shares_the_output_gram_of_its_weight():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 1, 1, 4, generator=gen, dtype=torch.float64)
    d = torch.randn(5, 1, 1, 3, generator=gen, dtype=torch.float64)
    weight = OuterProductFactor(a, d, torch.Size([3, 4]))
    bias = PerExampleFactor(d.reshape(5, 3), torch.Size([3]), output_of=weight)
    check_factor(bias, d.reshape(5, 3), 3)
    assert bias.gram() is weight.output_gram()  # computed once for both
    dense = torch.einsum("bq,bp->bqp", d[:, 0, 0], a[:, 0, 0])
    check_factor(weight, dense, 3)
    with pytest.raises(ValueError, match="one position and one group"):
        OuterProductFactor(a.expand(5, 2, 1, 4), d.expand(5, 2, 1, 3), (3, 4)).output_gram()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_plain_vectors_held_as_rows_read_as_their_4d_form(dtype):
    """A factor of one position and one group built from (B, p) and (B, q) tensors gives every
    read bitwise as the same factor built from their (B, 1, 1, f) forms."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(6, 4, generator=gen).to(dtype)
    d = torch.randn(6, 3, generator=gen).to(dtype)
    rows = OuterProductFactor(a, d, torch.Size([3, 4]))
    full = OuterProductFactor(a.reshape(6, 1, 1, 4), d.reshape(6, 1, 1, 3), torch.Size([3, 4]))
    assert rows.inputs.shape == (6, 1, 1, 4) and rows.output_grads.shape == (6, 1, 1, 3)
    assert rows.dtype == full.dtype == torch.promote_types(dtype, torch.float32)
    vectors = torch.randn(2, 3, 4, generator=gen, dtype=rows.dtype)
    weights = torch.randn(6, 2, generator=gen, dtype=rows.dtype)
    total = torch.randn(3, 4, generator=gen, dtype=rows.dtype)
    index = torch.tensor([1, 4])
    reads = [
        lambda f: f.norms_squared(),
        lambda f: f.gram(),
        lambda f: f.output_gram(),
        lambda f: f.dot(vectors[:1]),
        lambda f: f.dot(vectors),
        lambda f: f.weighted_sum(weights[:, :1]),
        lambda f: f.weighted_sum(weights),
        lambda f: f.two_valued_sum(index, -2.0, total, 1.0),
    ]
    for read in reads:
        assert torch.equal(read(rows), read(full))
    for k in (1, 2):
        targets = [torch.ones(k, 3, 4, dtype=rows.dtype) for _ in range(2)]
        rows.add_weighted_sum_to(weights[:, :k], targets[0])
        full.add_weighted_sum_to(weights[:, :k], targets[1])
        assert torch.equal(targets[0], targets[1])


@pytest.mark.parametrize("k", [1, 2])
def test_weighted_sums_added_in_place(k):
    """``add_weighted_sum_to`` adds into views of a flat buffer, touching nothing else."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(4, 2, 1, 3, generator=gen, dtype=torch.float64)
    d = torch.randn(4, 2, 1, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    weights = torch.randn(4, k, generator=gen, dtype=torch.float64)
    cases = [
        (OuterProductFactor(a, d, torch.Size([5, 3])), torch.einsum("btgq,btgp->bqp", d, a)),
        (PerExampleFactor(g, torch.Size([2, 3])), g.reshape(4, 2, 3)),
    ]
    for factor, dense in cases:
        n = dense[0].numel()
        buffer = torch.randn(k, n + 2, generator=gen, dtype=torch.float64)
        before = buffer.clone()
        target = buffer[:, 1 : n + 1].view(k, *dense.shape[1:])
        factor.add_weighted_sum_to(weights, target)
        expected = before[:, 1 : n + 1] + weights.T @ dense.reshape(4, -1)
        torch.testing.assert_close(buffer[:, 1 : n + 1], expected)
        torch.testing.assert_close(buffer[:, [0, n + 1]], before[:, [0, n + 1]])


def test_tied_embedding_and_head_norms_take_only_per_example_blocks():
    """The diagonal of the embedding x head cross term, computed per example, is exact."""
    from grabkit.stats.factors import SumFactor

    gen = torch.Generator().manual_seed(5)
    b, t, rows, dim = 3, 4, 6, 2
    idx = torch.randint(0, rows, (b, t), generator=gen)
    e = torch.randn(b, t, dim, generator=gen, dtype=torch.float64)
    a = torch.randn(b, t, 1, dim, generator=gen, dtype=torch.float64)
    d = torch.randn(b, t, 1, rows, generator=gen, dtype=torch.float64)
    dense = torch.einsum("btgq,btgp->bqp", d, a)
    for i in range(b):
        dense[i].index_add_(0, idx[i], e[i])
    tied = SumFactor(
        [
            EmbeddingFactor(idx, e, torch.Size([rows, dim])),
            OuterProductFactor(a, d, torch.Size([rows, dim])),
        ]
    )
    flat = dense.reshape(b, -1)
    torch.testing.assert_close(tied.norms_squared(), (flat * flat).sum(1))
    torch.testing.assert_close(tied.gram(), flat @ flat.T)
