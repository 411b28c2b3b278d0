"""``HookGradientBatch``: a step's hook statistics seen through the flat ``GradientBatch`` layout.

Flat vectors (d,) / (k, d) are split into per-parameter views (no copy) before each layer's
factor reads them; weighted sums come back concatenated into (d,) / (k, d). So the orderings in
``grabkit.order`` run unchanged on hook statistics or on a dense (B, d) matrix.
"""

from __future__ import annotations

import torch

from grabkit.stats.step import StepStatistics

__all__ = ["HookGradientBatch"]


class HookGradientBatch:
    """A ``GradientBatch`` over the per-example gradients recorded by ``PerSampleStats``.

    The layout is that of ``statistics.param_shapes``: trainable parameters in
    ``named_parameters()`` order, each flattened. ``dot`` with k vectors and ``weighted_sum``
    with (B, k) weights cost one GEMM per layer for all k together.
    """

    def __init__(self, statistics: StepStatistics) -> None:
        self.statistics = statistics
        self.size = statistics.batch_size
        self.dim = sum(int(torch.Size(s).numel()) for s in statistics.param_shapes.values())
        self.dtype = statistics.dtype
        self.device = statistics.device

    def gram(self) -> torch.Tensor:
        return self.statistics.gram()

    def norms_squared(self) -> torch.Tensor:
        return self.statistics.norms_squared()

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        single = vectors.dim() == 1
        rows = vectors.unsqueeze(0) if single else vectors
        if rows.dim() != 2 or rows.shape[1] != self.dim:
            raise ValueError(
                f"`vectors` should have shape ({self.dim},) or (k, {self.dim}), but got "
                f"{tuple(vectors.shape)}"
            )
        named = {}
        offset = 0
        for name, shape in self.statistics.param_shapes.items():
            n = int(torch.Size(shape).numel())
            named[name] = rows[:, offset : offset + n].reshape(rows.shape[0], *shape)
            offset += n
        out = self.statistics.dot_stacked(named)  # (B, k)
        return out[:, 0] if single else out

    def total(self) -> torch.Tensor:
        return self.statistics.total()

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        single = weights.dim() == 1
        columns = weights.unsqueeze(1) if single else weights
        if columns.dim() != 2 or columns.shape[0] != self.size:
            raise ValueError(
                f"`weights` should have shape ({self.size},) or ({self.size}, k), but got "
                f"{tuple(weights.shape)}"
            )
        k = columns.shape[1]
        flat = torch.empty(k, self.dim, dtype=self.dtype, device=self.device)
        views, offset = {}, 0
        for name, shape in self.statistics.param_shapes.items():
            n = int(torch.Size(shape).numel())
            views[name] = flat[:, offset : offset + n].view(k, *shape)
            offset += n
        self.statistics.weighted_sum_stacked(columns, out=views)  # written into ``flat``
        return flat[0] if single else flat
