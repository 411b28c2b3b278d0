"""``HookGradientBatch``: a step's hook statistics seen through the flat ``GradientBatch`` layout.

Flat vectors (d,) / (k, d) are split into per-parameter views (no copy) before each layer's
factor reads them; weighted sums come back concatenated into (d,) / (k, d). So the orderings in
``grabkit.order`` run unchanged on hook statistics or on a dense (B, d) matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from grabkit.stats.gradient_batch import GradientBatch
from grabkit.stats.step import StepStatistics
from grabkit.stats.transfer import to_device

__all__ = ["HookGradientBatch"]


class HookGradientBatch(GradientBatch):
    """A ``GradientBatch`` over the per-example gradients recorded by ``PerSampleStats``.

    The layout is that of ``statistics.param_shapes``: trainable parameters in
    ``named_parameters()`` order, each flattened. ``dot`` with k vectors and ``weighted_sum``
    with (B, k) weights cost one GEMM per layer for all k together.
    """

    def __init__(self, statistics: StepStatistics) -> None:
        self.statistics = statistics
        self.size = statistics.batch_size
        self._layout = statistics.layout
        self.dim = self._layout.dim
        self.dtype = statistics.dtype
        self.device = statistics.device

    def gram(self) -> torch.Tensor:
        return self.statistics.gram()

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """Host values of ``tensor``, in one transfer with the statistics' pending identity
        check, which is compared first (``StepStatistics.to_host``)."""
        return self.statistics.to_host(tensor)

    def settle(self) -> None:
        self.statistics.settle_identity()

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
        out = self.statistics.dot_stacked(self._layout.views(rows))  # (B, k)
        return out[:, 0] if single else out

    def total(self) -> torch.Tensor:
        return self.statistics.total()

    def add_total_to(self, target: torch.Tensor) -> None:
        """In place: ``target`` (d,) += ``total()``, with no (d,) temporary."""
        if target.shape != (self.dim,):
            raise ValueError(
                f"`target` should have shape ({self.dim},), but got {tuple(target.shape)}"
            )
        self.statistics.add_total_to(target)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        columns = self._columns(weights)
        flat = torch.empty(columns.shape[1], self.dim, dtype=self.dtype, device=self.device)
        self.statistics.weighted_sum_stacked(columns, out=self._layout.views(flat))  # into ``flat``
        return flat[0] if weights.dim() == 1 else flat

    def row(self, index: int) -> torch.Tensor:
        """(d,) g_index: a weighted sum with one-hot weights, read on the host (no sync)."""
        one_hot = torch.zeros(self.size, 1, dtype=self.dtype)
        one_hot[index] = 1.0
        flat = torch.empty(1, self.dim, dtype=self.dtype, device=self.device)
        self.statistics.weighted_sum_stacked(
            to_device(one_hot, self.device), out=self._layout.views(flat), host_weights=one_hot
        )
        return flat[0]

    def add_weighted_sum_to(
        self, target: torch.Tensor, weights: torch.Tensor, *, host: torch.Tensor | None = None
    ) -> None:
        """In place: ``target += weighted_sum(weights)``, with no (k, d) temporary.

        ``target`` is a contiguous (k, d) tensor (or (d,) for (B,) weights) in this batch's
        dtype and on its device: running sums, updated layer by layer. ``host``: the weights on
        the CPU, where the signed-sum shortcut reads them (no device sync).
        """
        columns = self._columns(weights)
        k = columns.shape[1]
        if not target.is_contiguous() or target.numel() != k * self.dim:
            raise ValueError(
                f"`target` should be a contiguous tensor of {k} x {self.dim} numbers, but got "
                f"shape {tuple(target.shape)}"
            )
        flat = target if target.dim() == 2 else target.view(k, self.dim)
        host_columns = None if host is None else self._columns(host)
        self.statistics.weighted_sum_stacked(
            columns, out=self._layout.views(flat), accumulate=True, host_weights=host_columns
        )

    def _columns(self, weights: torch.Tensor) -> torch.Tensor:
        """(B,) or (B, k) weights as (B, k) columns."""
        columns = weights.unsqueeze(1) if weights.dim() == 1 else weights
        if columns.dim() != 2 or columns.shape[0] != self.size:
            raise ValueError(
                f"`weights` should have shape ({self.size},) or ({self.size}, k), but got "
                f"{tuple(weights.shape)}"
            )
        return columns
