"""Random projections: unbiased for inner products, deterministic, equal to explicit matrices."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grabkit.order.projection import (
    PROJECTION_KINDS,
    GaussianProjection,
    KroneckerProjection,
    SparseProjection,
    _bernoulli_positions,
    make_projection,
)


def explicit_matrix(projection) -> torch.Tensor:
    """(k, d) matrix of the map, read off by projecting the identity."""
    eye = torch.eye(projection.in_dim, dtype=torch.float64)
    return projection(eye).T


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_second_moment_is_identity_so_inner_products_are_unbiased(kind):
    # E[P^T P] = I is E[<Px, Py>] = <x, y> for every pair at once. d = 37 is prime (Kronecker
    # pads it) and k = 5 is not a product of near-equal factors (Kronecker truncates).
    d, k, seeds = 37, 5, 600
    moments = torch.stack(
        [
            (lambda P: P.T @ P)(
                explicit_matrix(make_projection(kind, d, k, seed=s, dtype=torch.float64))
            )
            for s in range(seeds)
        ]
    )
    mean = moments.mean(dim=0)
    standard_error = moments.std(dim=0) / math.sqrt(seeds)
    z = (mean - torch.eye(d, dtype=torch.float64)).abs() / standard_error
    assert z.max() < 5.0, f"{kind}: largest z-score {z.max():.2f} over {d * d} entries"


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_inner_product_of_correlated_pair_is_unbiased(kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=g)
    y = 0.6 * x + torch.randn(50, generator=g)
    xy = torch.stack([x, y])
    estimates = torch.stack(
        [(lambda p: p[0] @ p[1])(make_projection(kind, 50, 8, seed=s)(xy)) for s in range(500)]
    )
    standard_error = estimates.std() / math.sqrt(estimates.numel())
    assert abs(estimates.mean() - x @ y) < 5 * standard_error


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_same_seed_same_map_other_seed_other_map(kind):
    X = torch.randn(4, 30)
    a = make_projection(kind, 30, 6, seed=3)(X)
    b = make_projection(kind, 30, 6, seed=3)(X)
    c = make_projection(kind, 30, 6, seed=4)(X)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_same_numbers_in_every_dtype(kind):
    # drawn once in float32 on the CPU, then cast: float64 sees the float32 map exactly
    X = torch.randn(3, 40, dtype=torch.float64)
    single = make_projection(kind, 40, 6, seed=7)(X.float())
    double = make_projection(kind, 40, 6, seed=7, dtype=torch.float64)(X)
    torch.testing.assert_close(double.float(), single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_shapes_and_dtype_follow_input(kind):
    p = make_projection(kind, 30, 6, seed=0)
    assert p(torch.randn(4, 30)).shape == (4, 6)
    assert p(torch.randn(30)).shape == (6,)
    out = p(torch.randn(2, 30, dtype=torch.float64))
    assert out.dtype == torch.float64 and p.dtype == torch.float64
    assert p.kind == kind and (p.in_dim, p.out_dim, p.seed) == (30, 6, 0)
    assert kind in repr(p) or type(p).__name__ in repr(p)


@given(
    kind=st.sampled_from(PROJECTION_KINDS),
    d=st.integers(1, 40),
    k=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    a=st.floats(-3, 3),
    b=st.floats(-3, 3),
)
@settings(max_examples=40, deadline=None)
def test_linear_for_any_shape(kind, d, k, seed, a, b):
    p = make_projection(kind, d, k, seed=seed, dtype=torch.float64)
    x, y = torch.randn(2, d, dtype=torch.float64)
    torch.testing.assert_close(p(a * x + b * y), a * p(x) + b * p(y))


def test_gaussian_entries_have_variance_one_over_k():
    p = GaussianProjection(2000, 16, seed=0)
    assert p.matrix.shape == (2000, 16)
    assert abs(p.matrix.var().item() * 16 - 1.0) < 0.05
    assert p.memory_bytes == 2000 * 16 * 4


def test_sparse_matches_its_dense_matrix_across_column_blocks():
    d, k = 40_000, 8  # three CSR column blocks
    p = SparseProjection(d, k, seed=5, dtype=torch.float64)
    assert len(p.blocks) == 3
    X = torch.randn(3, d, dtype=torch.float64)
    torch.testing.assert_close(p(X), X @ p.to_dense().T)


def test_sparse_density_and_values_follow_li_hastie_church():
    d, k = 10_000, 64
    p = SparseProjection(d, k, seed=2)
    R = p.to_dense()
    s = math.sqrt(d)
    expected = k * d / s
    assert abs(p.nnz - expected) < 5 * math.sqrt(expected)
    assert (R != 0).sum().item() == p.nnz
    values = R[R != 0]
    torch.testing.assert_close(values.abs(), torch.full_like(values, math.sqrt(s / k)))
    assert abs((values > 0).float().mean().item() - 0.5) < 0.02
    # memory grows like k * sqrt(d), far below the dense d * k
    assert p.memory_bytes < 0.05 * d * k * 4


def test_bernoulli_positions_are_sorted_distinct_and_have_the_right_count():
    g = torch.Generator().manual_seed(0)
    total, p = 1_000_000, 0.003
    positions = _bernoulli_positions(total, p, g)
    assert positions.dtype == torch.int64
    assert bool((positions[1:] > positions[:-1]).all())
    assert positions[0] >= 0 and positions[-1] < total
    assert abs(positions.numel() - total * p) < 5 * math.sqrt(total * p)
    # uniform over the range: each half holds about half the successes
    assert abs((positions < total // 2).float().mean().item() - 0.5) < 0.03
    assert torch.equal(_bernoulli_positions(5, 1.0, g), torch.arange(5))


def test_kronecker_equals_scaled_kronecker_product():
    d, k = 23, 7  # pads 23 -> 5 x 5 and keeps 7 of 3 x 3 outputs
    p = KroneckerProjection(d, k, seed=1, dtype=torch.float64)
    assert (p.d1, p.d2, p.k1, p.k2) == (5, 5, 3, 3)
    full = torch.kron(p.left, p.right)[:k, :d] * math.sqrt(9 / 7)
    torch.testing.assert_close(explicit_matrix(p), full)
    assert p.memory_bytes == (3 * 5 + 3 * 5) * 8


def test_kronecker_memory_is_about_two_sqrt_kd():
    p = KroneckerProjection(1_000_000, 1024, seed=0)
    assert p.memory_bytes <= 2.1 * math.sqrt(1024 * 1_000_000) * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_same_numbers_on_cuda(kind):
    X = torch.randn(3, 50, dtype=torch.float64)
    cpu = make_projection(kind, 50, 6, seed=0, dtype=torch.float64)(X)
    gpu = make_projection(kind, 50, 6, seed=0, device="cuda", dtype=torch.float64)(X.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"kind": "dense"}, ValueError, "`kind` should be one of"),
        ({"in_dim": 0}, ValueError, "`in_dim` should be a positive integer, but got in_dim=0"),
        ({"out_dim": -2}, ValueError, "`out_dim` should be a positive integer"),
        ({"out_dim": True}, ValueError, "`out_dim` should be an integer, but got out_dim=True"),
        ({"in_dim": 3.0}, ValueError, "`in_dim` should be an integer, but got in_dim=3.0"),
        ({"seed": "0"}, TypeError, "`seed` should be an int"),
        ({"dtype": torch.int64}, TypeError, "`dtype` should be a floating-point"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    args = {"kind": "gaussian", "in_dim": 10, "out_dim": 4, "seed": 0, **kwargs}
    kind, in_dim, out_dim = args.pop("kind"), args.pop("in_dim"), args.pop("out_dim")
    with pytest.raises(error, match=message):
        make_projection(kind, in_dim, out_dim, **args)


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_bad_inputs_are_named(kind):
    p = make_projection(kind, 10, 4, seed=0)
    with pytest.raises(ValueError, match=r"expected shape \(B, 10\) or \(10,\), but got \(3, 9\)"):
        p(torch.randn(3, 9))
    with pytest.raises(ValueError, match="in_dim=10"):
        p(torch.randn(2, 3, 10))
    with pytest.raises(TypeError, match="floating-point"):
        p(torch.ones(2, 10, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"takes a torch\.Tensor"):
        p([0.0] * 10)
