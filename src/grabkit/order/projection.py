"""Random projections that shrink per-example gradients from R^d to R^k before balancing.

Balancing only reads inner products, so a map P: R^d -> R^k with E[<Px, Py>] = <x, y> keeps the
herding decisions faithful in expectation while the running sum, the stale mean and every
per-batch product shrink from d to k numbers. Three families, all unbiased for inner products
and all fully determined by an integer seed:

* ``"gaussian"``: dense Johnson-Lindenstrauss, entries N(0, 1/k). Best accuracy, d*k numbers.
* ``"sparse"``: very sparse JL (Li, Hastie and Church, 2006): entries sqrt(s/k) * (+1, 0, -1)
  with probabilities (1/(2s), 1 - 1/s, 1/(2s)) and s = sqrt(d), stored as one of torch's own
  sparse CSR tensors. About k*sqrt(d) nonzeros.
* ``"kronecker"``: x is reshaped into a d1 x d2 matrix X and mapped to A X B^T with two small
  Gaussian matrices A (k1 x d1), B (k2 x d2). About 2*sqrt(k*d) numbers.

The random numbers are always drawn on the CPU in float32 from ``torch.Generator().manual_seed(
seed)``, so a projection is the same on every device and process; its tensors then move to the
requested device and dtype. A projection follows its input: called on a tensor of another device
or dtype it moves its tensors there once (no second copy is kept).

Example::

    proj = make_projection("sparse", in_dim=1_000_000, out_dim=1024, seed=0)
    small = proj(per_example_grads)  # (B, 1_000_000) -> (B, 1024)
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod

import torch

from grabkit.validation import check_int, check_positive_int

__all__ = [
    "PROJECTION_KINDS",
    "GaussianProjection",
    "KroneckerProjection",
    "Projection",
    "SparseProjection",
    "make_projection",
]

PROJECTION_KINDS = ("gaussian", "sparse", "kronecker")

# columns of R per CSR block in SparseProjection (a 64-row slice of X then fits in cache)
_SPARSE_BLOCK_COLUMNS = 16384


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(check_int("seed", seed))


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a dense tensor, or of a sparse CSR tensor's values and index arrays."""
    if t.layout == torch.sparse_csr:
        return sum(_tensor_bytes(part) for part in (t.values(), t.col_indices(), t.crow_indices()))
    return t.numel() * t.element_size()


class Projection(ABC):
    """A fixed random linear map R^d -> R^k, unbiased for inner products.

    Call it on a (B, d) batch (or a single (d,) vector) to get (B, k) (or (k,)).

    Attributes:
        kind: ``"gaussian"``, ``"sparse"`` or ``"kronecker"``.
        in_dim: d.  out_dim: k.  seed: the seed the random numbers came from.
    """

    kind: str

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        seed: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.in_dim = check_positive_int("in_dim", in_dim)
        self.out_dim = check_positive_int("out_dim", out_dim)
        self.seed = seed
        self._build(_generator(seed), device, dtype)

    @abstractmethod
    def _build(
        self, generator: torch.Generator, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        """Draw the projection's tensors from ``generator`` (on the CPU, so a seed gives the same
        map on every device) and keep them on ``device`` in ``dtype``."""

    @abstractmethod
    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor the projection holds, in a fixed order."""

    @abstractmethod
    def _set_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace the tensors ``_tensors()`` returned (same order), e.g. after a move."""

    @property
    def device(self) -> torch.device:
        """Device of the projection's tensors."""
        return self._tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the projection's tensors."""
        return self._tensors()[0].dtype

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the projection's tensors (values and, for sparse ones, indices)."""
        return sum(_tensor_bytes(t) for t in self._tensors())

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Projection:
        """Move the projection's tensors in place; returns ``self``."""
        self._set_tensors([t.to(device=device, dtype=dtype) for t in self._tensors()])
        return self

    @abstractmethod
    def _apply(self, X: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, k) on the projection's device and dtype."""

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        """Project a (B, d) batch to (B, k), or a (d,) vector to (k,)."""
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"a projection takes a torch.Tensor, but got {type(X).__name__}")
        if X.ndim not in (1, 2) or X.shape[-1] != self.in_dim:
            raise ValueError(
                f"{type(self).__name__} maps vectors of length in_dim={self.in_dim}: expected "
                f"shape (B, {self.in_dim}) or ({self.in_dim},), but got {tuple(X.shape)}"
            )
        if not X.is_floating_point():
            raise TypeError(f"a projection takes floating-point vectors, but got {X.dtype}")
        if X.device != self.device or X.dtype != self.dtype:
            self.to(device=X.device, dtype=X.dtype)
        if X.ndim == 1:
            return self._apply(X.unsqueeze(0)).squeeze(0)
        return self._apply(X)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(in_dim={self.in_dim}, out_dim={self.out_dim}, "
            f"seed={self.seed}, dtype={self.dtype}, device={self.device})"
        )


class GaussianProjection(Projection):
    """Dense JL projection: x -> x R with R (d, k), entries i.i.d. N(0, 1/k).

    E[R R^T] = I, so E[<xR, yR>] = <x, y>; the variance of <xR, yR> is
    (<x, y>^2 + |x|^2 |y|^2) / k.

    Memory: d * k numbers of ``dtype`` (4 GB for d = 1e6, k = 1024 in float32); prefer
    ``"sparse"`` or ``"kronecker"`` when that is too much.
    """

    kind = "gaussian"

    def _build(
        self, generator: torch.Generator, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        in_dim, out_dim = self.in_dim, self.out_dim
        matrix = torch.randn(in_dim, out_dim, generator=generator, dtype=torch.float32)
        self.matrix = (matrix / math.sqrt(out_dim)).to(device=device, dtype=dtype)  # (d, k)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.matrix]

    def _set_tensors(self, tensors: list[torch.Tensor]) -> None:
        (self.matrix,) = tensors

    def _apply(self, X: torch.Tensor) -> torch.Tensor:
        return X @ self.matrix


class SparseProjection(Projection):
    """Very sparse JL projection (Li, Hastie and Church, 2006), as torch sparse CSR blocks.

    Each entry of the (k, d) matrix R is independently sqrt(s/k) * (+1, 0, -1) with probabilities
    (1/(2s), 1 - 1/s, 1/(2s)) and s = sqrt(d): mean 0, variance 1/k, so E[R^T R] = I and
    E[<Rx, Ry>] = <x, y>. The nonzero positions are drawn exactly as independent Bernoulli(1/s)
    trials, by sampling the geometric gaps between consecutive nonzeros.

    Memory: about k * sqrt(d) nonzeros, each one value of ``dtype`` and one int64 column index,
    plus k + 1 int64 row pointers per block of 16384 columns (about 12.5 MB for d = 1e6,
    k = 1024 in float32).
    Time: one sparse-dense product, about 2 * B * k * sqrt(d) flops.
    """

    kind = "sparse"

    def _build(
        self, generator: torch.Generator, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        in_dim, out_dim = self.in_dim, self.out_dim
        s = math.sqrt(in_dim)
        positions = _bernoulli_positions(in_dim * out_dim, 1.0 / s, generator)  # sorted, flat
        signs = torch.randint(0, 2, (positions.numel(),), generator=generator) * 2 - 1
        values = signs.to(torch.float32) * math.sqrt(s / out_dim)
        rows = torch.div(positions, in_dim, rounding_mode="floor")
        cols = positions - rows * in_dim
        # Column blocks: the product needs X's columns as contiguous rows, and transposing one
        # cache-sized slice of X at a time is several times faster than transposing all of it.
        block_of = torch.div(cols, _SPARSE_BLOCK_COLUMNS, rounding_mode="floor")
        by_block = torch.argsort(block_of, stable=True)  # keeps row-major order inside a block
        counts = torch.bincount(block_of, minlength=-(-in_dim // _SPARSE_BLOCK_COLUMNS)).tolist()
        self.blocks: list[torch.Tensor] = []  # (k, width) CSR matrices, left to right
        for number, piece in enumerate(torch.split(by_block, counts)):
            start = number * _SPARSE_BLOCK_COLUMNS
            width = min(_SPARSE_BLOCK_COLUMNS, in_dim - start)
            row_counts = torch.bincount(rows[piece], minlength=out_dim)
            crow = torch.cat([torch.zeros(1, dtype=torch.int64), row_counts.cumsum(0)])
            with warnings.catch_warnings():  # torch flags CSR support as beta on every build
                warnings.simplefilter("ignore", UserWarning)
                block = torch.sparse_csr_tensor(
                    crow,
                    cols[piece] - start,
                    values[piece],
                    size=(out_dim, width),
                    check_invariants=False,  # built sorted and in range above
                )
            self.blocks.append(block.to(device=device, dtype=dtype))

    def _tensors(self) -> list[torch.Tensor]:
        return self.blocks

    def _set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.blocks = list(tensors)

    @property
    def nnz(self) -> int:
        """Number of nonzero entries of R."""
        return sum(int(b.values().numel()) for b in self.blocks)

    def to_dense(self) -> torch.Tensor:
        """The (k, d) matrix R as a dense tensor (for tests and inspection; d * k numbers)."""
        return torch.cat([b.to_dense() for b in self.blocks], dim=1)

    def _apply(self, X: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.out_dim, X.shape[0], device=X.device, dtype=X.dtype)  # (k, B)
        for number, block in enumerate(self.blocks):
            start = number * _SPARSE_BLOCK_COLUMNS
            columns = X[:, start : start + block.shape[1]].T.contiguous()  # (width, B)
            out += block @ columns
        return out.T


def _bernoulli_positions(total: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """Sorted indices i in [0, total) of independent Bernoulli(p) successes, as int64.

    Draws the gaps between successes (Geometric(p) on {1, 2, ...}) in chunks instead of one coin
    per index, so the cost is proportional to the number of successes, not to ``total``.
    """
    if p >= 1.0:
        return torch.arange(total, dtype=torch.int64)
    chunks: list[torch.Tensor] = []
    last = -1  # index of the latest success so far
    while True:
        remaining = total - 1 - last
        expected = remaining * p
        size = max(1024, int(expected + 6.0 * math.sqrt(expected) + 16))
        gaps = torch.empty(size, dtype=torch.float64).geometric_(p, generator=generator)
        positions = last + gaps.to(torch.int64).cumsum(0)
        inside = positions[positions < total]
        chunks.append(inside)
        if inside.numel() < size:
            return torch.cat(chunks)
        last = int(inside[-1])


class KroneckerProjection(Projection):
    """Kronecker-structured JL projection: x -> (A kron B) x, computed as A X B^T.

    x (length d) is zero-padded to d1 * d2 with d1 = ceil(sqrt(d)), d2 = ceil(d / d1) and read
    row-major as a d1 x d2 matrix X (padding does not change inner products). A (k1, d1) and
    B (k2, d2) have entries N(0, 1/k1) and N(0, 1/k2) with k1 = ceil(sqrt(k)), k2 = ceil(k / k1),
    so E[(A kron B)^T (A kron B)] = I. The first k of the k1 * k2 outputs are kept and scaled by
    sqrt(k1 * k2 / k), which keeps the map unbiased: E[<Px, Py>] = <x, y>. The variance is larger
    than the dense Gaussian map's for the same k; the price of the small footprint.

    Memory: k1 * d1 + k2 * d2 numbers of ``dtype``, about 2 * sqrt(k * d) (64 K numbers for
    d = 1e6, k = 1024). Time: about 2 * B * (k1 * d + k1 * k2 * d2) flops.
    """

    kind = "kronecker"

    def _build(
        self, generator: torch.Generator, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        in_dim, out_dim = self.in_dim, self.out_dim
        self.d1 = math.isqrt(in_dim - 1) + 1  # ceil(sqrt(d))
        self.d2 = -(-in_dim // self.d1)
        self.k1 = math.isqrt(out_dim - 1) + 1
        self.k2 = -(-out_dim // self.k1)
        left = torch.randn(self.k1, self.d1, generator=generator) / math.sqrt(self.k1)
        right = torch.randn(self.k2, self.d2, generator=generator) / math.sqrt(self.k2)
        self.scale = math.sqrt(self.k1 * self.k2 / out_dim)
        self.left = left.to(device=device, dtype=dtype)  # A: (k1, d1)
        self.right = right.to(device=device, dtype=dtype)  # B: (k2, d2)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.left, self.right]

    def _set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.left, self.right = tensors

    def _apply(self, X: torch.Tensor) -> torch.Tensor:
        batch = X.shape[0]
        pad = self.d1 * self.d2 - self.in_dim
        if pad:
            X = torch.nn.functional.pad(X, (0, pad))
        matrices = X.reshape(batch, self.d1, self.d2)
        out = torch.matmul(self.left, matrices) @ self.right.T  # (B, k1, k2)
        return out.reshape(batch, self.k1 * self.k2)[:, : self.out_dim] * self.scale


_KINDS: dict[str, type[Projection]] = {
    "gaussian": GaussianProjection,
    "sparse": SparseProjection,
    "kronecker": KroneckerProjection,
}


def make_projection(
    kind: str,
    in_dim: int,
    out_dim: int,
    *,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Projection:
    """Build a random projection R^in_dim -> R^out_dim, unbiased for inner products.

    Args:
        kind: ``"gaussian"`` (dense JL), ``"sparse"`` (very sparse JL, torch sparse CSR) or
            ``"kronecker"`` (Kronecker-structured); see the classes for memory and accuracy.
        in_dim: d, the length of a flattened per-example gradient.
        out_dim: k, the length after projection.
        seed: the projection is a deterministic function of ``(kind, in_dim, out_dim, seed)``.
        device: where the projection's tensors live (they follow the input later).
        dtype: their dtype.
    Returns:
        A ``Projection``: call it on (B, d) to get (B, k).
    """
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ValueError(f"`kind` should be one of {list(PROJECTION_KINDS)}, but got kind={kind!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"`dtype` should be a floating-point torch.dtype, but got dtype={dtype!r}")
    return _KINDS[kind](in_dim, out_dim, seed=seed, device=device, dtype=dtype)
