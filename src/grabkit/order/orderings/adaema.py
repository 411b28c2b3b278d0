"""``adaema``: Adam-style normalised balancing, (g_i - m_t) / (sqrt(v_t) + eps) with EMAs."""

from __future__ import annotations

from typing import Any

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import CentredBalance, dense_rows
from grabkit.order.orderings.ema import VectorEMA, check_rate
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["AdaEMABalance"]


@register_ordering
class AdaEMABalance(CentredBalance):
    """m_t, v_t: bias-corrected EMAs of the batch mean and of its square (``betas``, as in Adam),
    both including the current batch. Per-coordinate scaling needs dense per-example gradients."""

    name = "adaema"
    needs_coordinates = True

    def __init__(
        self, n: int, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, **kwargs: Any
    ) -> None:
        super().__init__(n, **kwargs)
        if len(betas) != 2:
            raise ValueError(f"`betas` should be a pair (beta1, beta2), but got betas={betas!r}")
        self.add_state("m", VectorEMA(check_rate("1 - betas[0]", 1 - betas[0])))
        self.add_state("v", VectorEMA(check_rate("1 - betas[1]", 1 - betas[1])))
        self.eps = float(eps)

    def transform(self, batch: GradientBatch) -> GradientBatch:
        X = dense_rows(batch, self.name)
        mean = X.mean(dim=0)
        m, v = self.m.peek(mean), self.v.peek(mean * mean)
        return batch.derived((X - m) / (v.sqrt() + self.eps))

    def record(self, total: torch.Tensor, count: int) -> None:
        mean = total / count
        self.m.add(mean)
        self.v.add(mean * mean)
