"""``GradientBatch``: the declared interface, its defaults, and the wrapping of foreign batches."""

from __future__ import annotations

import pytest
import torch

from grabkit.stats.gradient_batch import (
    DenseGradientBatch,
    ForeignBatch,
    GradientBatch,
    as_gradient_batch,
)


class ReadsOnly(GradientBatch):
    """Implements the five reads and nothing else: every other operation is a default."""

    def __init__(self, X: torch.Tensor) -> None:
        self.X = X
        self.size, self.dim, self.dtype, self.device = X.shape[0], X.shape[1], X.dtype, X.device

    def gram(self):
        return self.X @ self.X.T

    def norms_squared(self):
        return (self.X * self.X).sum(1)

    def dot(self, vectors):
        return self.X @ vectors.T

    def total(self):
        return self.X.sum(0)

    def weighted_sum(self, weights):
        return (weights if weights.ndim == 1 else weights.mT) @ self.X


def _rows(B: int = 5, d: int = 4) -> torch.Tensor:
    X = torch.randn(B, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    X[2] = 0.0  # a zero row stays zero when normalised
    return X


def test_the_reads_are_abstract():
    with pytest.raises(TypeError, match="abstract"):
        GradientBatch()


def test_defaults_equal_the_dense_overrides():
    X = _rows()
    dense, plain = DenseGradientBatch(X), ReadsOnly(X)
    assert dense.coordinates() is X and plain.coordinates() is None
    for batch in (dense, plain):
        target = torch.ones(X.shape[1], dtype=X.dtype)
        batch.add_total_to(target)
        torch.testing.assert_close(target, X.sum(0) + 1)
        weights = torch.randn(X.shape[0], 2, dtype=X.dtype)
        running = torch.ones(2, X.shape[1], dtype=X.dtype)
        batch.add_weighted_sum_to(running, weights)
        torch.testing.assert_close(running, weights.T @ X + 1)
        row = batch.row(-1)
        torch.testing.assert_close(row, X[-1])
        row += 1.0  # a tensor of its own
        torch.testing.assert_close(batch.gram(), X @ X.T)
        unit = X / X.norm(dim=1, keepdim=True).clamp_min(1e-300)
        normalized = batch.normalized()
        torch.testing.assert_close(normalized.gram(), unit @ unit.T)
        torch.testing.assert_close(normalized.total(), unit.sum(0))
        torch.testing.assert_close(normalized.weighted_sum(weights), weights.T @ unit)
    assert [b.size for b in dense.split(2)] == [2, 2, 1]
    assert plain.split(2) == [plain]  # cannot be cut without recomputing: kept whole


def test_an_object_with_the_reads_is_wrapped_once_and_anything_else_refused():
    X = _rows()
    plain = ReadsOnly(X)
    assert as_gradient_batch(plain) is plain
    duck = type("Duck", (), {})()
    for name in ("gram", "norms_squared", "dot", "total", "weighted_sum"):
        setattr(duck, name, getattr(plain, name))
    duck.size, duck.dim, duck.dtype, duck.device = plain.size, plain.dim, X.dtype, X.device
    wrapped = as_gradient_batch(duck)
    assert isinstance(wrapped, ForeignBatch) and as_gradient_batch(wrapped) is wrapped
    torch.testing.assert_close(wrapped.row(1), X[1])
    with pytest.raises(TypeError, match=r"without \['gram'"):
        as_gradient_batch(object())


def test_divided_equals_the_divided_rows_on_every_read():
    X, factor = _rows(), 3.0
    expected = X / factor
    weights = torch.randn(X.shape[0], 2, dtype=X.dtype)
    for batch in (DenseGradientBatch(X), ReadsOnly(X)):
        assert batch.divided(1.0) is batch
        divided = batch.divided(factor)
        torch.testing.assert_close(divided.gram(), expected @ expected.T)
        torch.testing.assert_close(divided.norms_squared(), (expected * expected).sum(1))
        vectors = torch.randn(2, X.shape[1], dtype=X.dtype)
        torch.testing.assert_close(divided.dot(vectors), expected @ vectors.T)
        torch.testing.assert_close(divided.total(), expected.sum(0))
        torch.testing.assert_close(divided.weighted_sum(weights), weights.T @ expected)
        torch.testing.assert_close(divided.row(1), expected[1])
        target = torch.ones(X.shape[1], dtype=X.dtype)
        divided.add_total_to(target)
        torch.testing.assert_close(target, expected.sum(0) + 1)
        running = torch.ones(2, X.shape[1], dtype=X.dtype)
        divided.add_weighted_sum_to(running, weights, host=weights.clone())
        torch.testing.assert_close(running, weights.T @ expected + 1)
        unit = expected / expected.norm(dim=1, keepdim=True).clamp_min(1e-300)
        torch.testing.assert_close(divided.normalized().gram(), unit @ unit.T)


class Reads:
    """Records the host reads and settles sent to it (what a batch's statistics would do)."""

    def __init__(self) -> None:
        self.reads, self.settles = 0, 0

    def to_host(self, tensor):
        self.reads += 1
        return tensor.cpu().numpy()

    def settle(self):
        self.settles += 1


def test_every_batch_derived_from_a_batch_reads_the_host_through_it():
    # a check pending on the statistics must ride on whatever batch the consumer ends up reading
    reads = Reads()
    batch = DenseGradientBatch(torch.randn(6, 4), reads_through=reads)
    derived = [
        batch.normalized(),
        batch.divided(2.0),
        batch.split(2)[1],
        batch.derived(batch.matrix[:, :2]),
        batch.normalized().split(3)[0].divided(4.0),
    ]
    for piece in derived:
        piece.to_host(torch.ones(2))
        piece.settle()
    assert (reads.reads, reads.settles) == (len(derived), len(derived))
    plain = DenseGradientBatch(torch.randn(6, 4))
    assert plain.derived(plain.matrix).reads_through is plain
    assert plain.to_host(torch.ones(2)).tolist() == [1.0, 1.0]
