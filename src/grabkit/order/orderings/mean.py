"""``mean``: vanilla GraB. Balance g_i - m with m the previous epoch's mean gradient."""

from __future__ import annotations

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import StaleMeanBalance
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["MeanBalance"]


@register_ordering
class MeanBalance(StaleMeanBalance):
    """Online GraB with a stale mean (Lu et al., 2022, Algorithm 4).

    The epoch's own mean comes from ``batch.total()`` (free in hook mode) and becomes the centre
    of the next epoch; the first epoch is centred at zero.
    """

    name = "mean"
    splittable = True

    def centre(self, batch: GradientBatch) -> torch.Tensor | None:
        return self.mean.value
