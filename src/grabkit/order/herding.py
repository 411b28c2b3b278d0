"""The herding bound of an ordering: how far the centred prefix sums stray, in the worst prefix.

For vectors x_1..x_n in R^d (per-example gradients), a visit order pi and a centre m (by default
the exact mean of the n vectors), the herding bound is

    max over k = 1..n of || sum_{t <= k} (x_{pi(t)} - m) ||_inf.

GraB's convergence rate is governed by it: an ordering whose prefix sums stay near zero makes each
epoch's sequence of SGD steps track the full-gradient path closely. Random reshuffling gives about
sqrt(n) times the typical vector size; good herding orders give about O(1).

``herding_bound`` computes it exactly from all n vectors; ``StreamingHerdingBound`` computes it
in visit order with O(d) memory when the centre is known in advance.
All arithmetic is in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["StreamingHerdingBound", "herding_bound"]

# rows per block in herding_bound, chosen so one float64 block stays near 32 MB
_BLOCK_ELEMENTS = 1 << 22


def _as_matrix(vectors: object, name: str) -> torch.Tensor:
    if not isinstance(vectors, torch.Tensor):
        raise TypeError(f"`{name}` should be a torch.Tensor, but got {type(vectors).__name__}")
    if vectors.ndim != 2:
        raise ValueError(
            f"`{name}` should be an (n, d) matrix with one vector per row, but got shape "
            f"{tuple(vectors.shape)}"
        )
    return vectors


def _as_centre(mean: object, dim: int, name: str = "mean") -> torch.Tensor:
    if not isinstance(mean, torch.Tensor):
        raise TypeError(f"`{name}` should be a torch.Tensor, but got {type(mean).__name__}")
    if mean.shape != (dim,):
        raise ValueError(
            f"`{name}` should have shape ({dim},) to match the vectors, but got {tuple(mean.shape)}"
        )
    return mean.to(torch.float64)


def _as_order(order: object, n: int) -> torch.Tensor:
    if isinstance(order, torch.Tensor):
        index = order
    elif isinstance(order, Sequence) or hasattr(order, "__array__"):
        index = torch.as_tensor(order)
    else:
        raise TypeError(
            f"`order` should be a 1-D tensor or sequence of indices, but got {type(order).__name__}"
        )
    if index.ndim != 1:
        raise ValueError(f"`order` should be 1-D, but got shape {tuple(index.shape)}")
    if index.numel() == 0:
        return index.to(torch.int64)
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(f"`order` should hold integer indices, but got dtype {index.dtype}")
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= n:
        raise ValueError(
            f"`order` holds indices into the {n} vectors, so each must be in [0, {n - 1}], but "
            f"got values from {low} to {high}"
        )
    return index.to(torch.int64)


def herding_bound(
    vectors: torch.Tensor,
    order: torch.Tensor | Sequence[int] | None = None,
    mean: torch.Tensor | None = None,
) -> float:
    """Exact herding bound max_k || sum_{t<=k} (x_{order[t]} - mean) ||_inf.

    Args:
        vectors: (n, d) matrix, one vector (e.g. one per-example gradient) per row.
        order: (m,) indices into the rows, in visit order; by default ``range(n)``. Usually a
            permutation of range(n); a shorter or repeating sequence (an epoch with ``drop_last``,
            sampling with replacement) is measured the same way.
        mean: (d,) centre; by default the exact mean of all n rows (not only those in ``order``).
    Returns:
        The bound as a Python float (0.0 for an empty ``order``).

    Memory: the n rows plus one float64 block of about 4M numbers at a time.
    """
    vectors = _as_matrix(vectors, "vectors")
    n, d = vectors.shape
    if n == 0:
        raise ValueError("`vectors` should hold at least one row, but got shape (0, d)")
    if mean is None:
        centre = vectors.to(torch.float64).mean(dim=0)
    else:
        centre = _as_centre(mean, d).to(vectors.device)
    index = torch.arange(n) if order is None else _as_order(order, n)
    streaming = StreamingHerdingBound(centre)
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(d, 1))
    for start in range(0, index.numel(), rows_per_block):
        block = index[start : start + rows_per_block].to(vectors.device)
        streaming.update(vectors.index_select(0, block))
    return streaming.compute()


class StreamingHerdingBound:
    """Herding bound of vectors fed in visit order, with O(d) memory.

    Keeps the running centred sum s = sum_{t<=k} (x_t - mean) and the largest ||s||_inf so far.

    Exactness: the result equals ``herding_bound(all_vectors, visit_order, mean)`` exactly (up to
    float64 rounding) for the ``mean`` given here. So it is the exact herding bound of the epoch
    when that mean is the epoch's true mean known in advance (fixed vectors such as features, or
    gradients at a fixed point from an earlier pass). When it is only an estimate (for instance
    the previous epoch's mean, what GraB's ``mean`` balancing centres on), ``compute_interval()``
    brackets the bound centred on the exact mean of the vectors actually seen: moving the centre
    by delta moves every prefix k's norm by at most k * ||delta||_inf.

    Args:
        mean: (d,) centre, fixed for the whole stream. Pass ``torch.zeros(d)`` for raw prefix sums.

    Example::

        bound = StreamingHerdingBound(mean)
        for batch in batches_in_visit_order:   # each (B, d)
            bound.update(batch)
        bound.compute()
    """

    def __init__(self, mean: torch.Tensor) -> None:
        if not isinstance(mean, torch.Tensor) or mean.ndim != 1:
            shape = tuple(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__
            raise ValueError(f"`mean` should be a 1-D (d,) tensor, but got {shape}")
        self.mean = mean.detach().to(torch.float64)  # (d,)
        self.dim = int(mean.shape[0])
        self.reset()

    def reset(self) -> None:
        """Forget every vector seen (keeps the centre)."""
        self.count = 0
        self.centred_sum = torch.zeros_like(self.mean)  # sum_t (x_t - mean), (d,)
        self._bound = torch.zeros((), dtype=torch.float64, device=self.mean.device)

    def update(self, batch: torch.Tensor) -> None:
        """Add a (B, d) batch (or one (d,) vector) of vectors that come next in visit order."""
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"`batch` should be a torch.Tensor, but got {type(batch).__name__}")
        if batch.ndim == 1:
            batch = batch.unsqueeze(0)
        if batch.ndim != 2 or batch.shape[1] != self.dim:
            raise ValueError(
                f"`batch` should have shape (B, {self.dim}) or ({self.dim},) to match `mean`, "
                f"but got {tuple(batch.shape)}"
            )
        if batch.shape[0] == 0:
            return
        centred = batch.detach().to(device=self.mean.device, dtype=torch.float64) - self.mean
        prefix = torch.cumsum(centred, dim=0).add_(self.centred_sum)  # (B, d) running sums
        self._bound = torch.maximum(self._bound, prefix.abs().amax())
        self.centred_sum = prefix[-1].clone()
        self.count += batch.shape[0]

    def compute(self) -> float:
        """max over prefixes so far of || sum_{t<=k} (x_t - mean) ||_inf (0.0 before any update)."""
        return float(self._bound)

    def seen_mean(self) -> torch.Tensor:
        """(d,) exact mean of the vectors seen so far (float64); needs at least one update."""
        if self.count == 0:
            raise ValueError("no vectors seen yet: call update() before seen_mean()")
        return self.mean + self.centred_sum / self.count

    def compute_interval(self) -> tuple[float, float]:
        """(low, high) bracketing the herding bound centred on the seen vectors' exact mean.

        With delta = seen_mean() - mean and n = count, the bound about the exact mean lies in
        [compute() - n ||delta||_inf, compute() + n ||delta||_inf] (clipped at 0). When ``mean``
        was the exact mean, delta is 0 and both ends equal ``compute()``.
        """
        if self.count == 0:
            return 0.0, 0.0
        slack = self.count * float((self.centred_sum / self.count).abs().max())
        value = self.compute()
        return max(0.0, value - slack), value + slack

    def state_dict(self) -> dict[str, object]:
        """Tensors and numbers only, readable with ``torch.load(..., weights_only=True)``."""
        return {
            "mean": self.mean.clone(),
            "centred_sum": self.centred_sum.clone(),
            "bound": float(self._bound),
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what ``state_dict()`` saved; the dimension must match."""
        expected = {"mean", "centred_sum", "bound", "count"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"StreamingHerdingBound state should have keys {sorted(expected)}, but got {got}"
            )
        mean = state["mean"]
        if not isinstance(mean, torch.Tensor) or mean.shape != (self.dim,):
            shape = tuple(mean.shape) if isinstance(mean, torch.Tensor) else mean
            raise ValueError(
                f"saved `mean` has shape {shape}, but this StreamingHerdingBound has d={self.dim}"
            )
        device = self.mean.device
        self.mean = mean.to(device=device, dtype=torch.float64)
        self.centred_sum = state["centred_sum"].to(device=device, dtype=torch.float64)
        self._bound = torch.tensor(float(state["bound"]), dtype=torch.float64, device=device)
        self.count = int(state["count"])
