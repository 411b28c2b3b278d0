"""``sign``: balance the coordinate signs of the centred gradients, sign(g_i - m)."""

from __future__ import annotations

import torch

from grabkit.order.balance import NON_FINITE_HELP
from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import StaleMeanBalance, dense_rows
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["SignBalance"]


@register_ordering
class SignBalance(StaleMeanBalance):
    """One bit per coordinate: herding on sign(g_i - m), m the previous epoch's mean. Robust to a
    few huge coordinates; needs dense per-example gradients."""

    name = "sign"
    splittable = True
    needs_coordinates = True

    def transform(self, batch: GradientBatch) -> GradientBatch:
        X = dense_rows(batch, self.name)
        if not bool(torch.isfinite(X).all()):  # sign() maps Inf to +-1: check before (host sync)
            raise ValueError(NON_FINITE_HELP)
        return batch.derived(X.sub(self.mean.current(X[0])).sign())
