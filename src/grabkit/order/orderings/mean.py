"""``mean``: vanilla GraB. Balance g_i - m with m the previous epoch's mean gradient."""

from __future__ import annotations

from typing import Any

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import CentredBalance, StaleMean
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["MeanBalance"]


@register_ordering
class MeanBalance(CentredBalance):
    """Online GraB with a stale mean (Lu et al., 2022, Algorithm 4).

    The epoch's own mean comes from ``batch.total()`` (free in hook mode) and becomes the centre
    of the next epoch; the first epoch is centred at zero.
    """

    name = "mean"
    splittable = True

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.mean = StaleMean()

    def start_epoch(self, epoch: int) -> None:
        super().start_epoch(epoch)
        self.mean.roll()

    def centre(self, batch: GradientBatch) -> torch.Tensor | None:
        return self.mean.value

    def record(self, total: torch.Tensor, count: int) -> None:
        self.mean.add(total, count)

    def record_batch(self, batch: GradientBatch, count: int) -> None:
        self.mean.add_batch(batch, count)

    def extra_state(self) -> dict[str, Any]:
        return {"mean": self.mean.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.mean.load_state_dict(state["mean"])
