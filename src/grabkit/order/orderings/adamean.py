"""``adamean``: stale-mean GraB in the geometry of an adaptive optimiser, (g_i - m) / v."""

from __future__ import annotations

from typing import Any

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import StaleMeanBalance, dense_rows
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["AdaMeanBalance"]


@register_ordering
class AdaMeanBalance(StaleMeanBalance):
    """Balance (g_i - m) / v: m the previous epoch's mean, v = sqrt(second moment) + eps.

    The second moment is the optimiser's (Adam's ``exp_avg_sq``), handed over with
    ``sampler.update_v(...)`` whenever convenient; until then v = 1 and this is ``mean``.
    Per-coordinate scaling needs dense per-example gradients.
    """

    name = "adamean"
    splittable = True
    needs_coordinates = True
    scale: torch.Tensor | None  # (d,) v

    def __init__(self, n: int, *, eps: float = 1e-8, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.eps = float(eps)
        self.add_state("scale", None)

    def update_v(self, second_moment: torch.Tensor) -> None:
        """Set v = sqrt(second_moment) + eps from a flat (d,) tensor.

        Raises:
            ValueError: a negative or non-finite entry (its square root would make every
                later step's gradients look non-finite, blaming them).
        """
        moment = second_moment.detach()
        bad = ~torch.isfinite(moment) | (moment < 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"update_v() got a second moment of {float(moment[i])} at coordinate {i}; pass "
                "the optimiser's non-negative, finite second moment (Adam's exp_avg_sq)."
            )
        self.scale = moment.sqrt() + self.eps

    def transform(self, batch: GradientBatch) -> GradientBatch:
        X = dense_rows(batch, self.name)
        if self.scale is not None and self.scale.shape[0] != X.shape[1]:
            raise ValueError(
                f"update_v() was given {self.scale.shape[0]} numbers but the gradients have "
                f"{X.shape[1]} coordinates; pass the optimiser state of the same parameters."
            )
        centred = X - self.mean.current(X[0])
        return batch.derived(centred if self.scale is None else centred / self.scale.to(X))
