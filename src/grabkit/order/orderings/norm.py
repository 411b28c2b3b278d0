"""``norm``: order examples by the size of their last gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import NON_FINITE_HELP
from grabkit.order.orderings.base import Ordering, check_state_keys, register_ordering
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["OrderByNorm"]


@register_ordering
class OrderByNorm(Ordering):
    """Sort the examples observed this epoch by gradient norm, largest first
    (``descending_norm=True``, grab-sampler's default) or smallest first; examples not observed
    follow in their previous relative order. Reads only ``norms_squared()``."""

    name = "norm"
    splittable = True

    def __init__(self, n: int, *, descending_norm: bool = True, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.descending = bool(descending_norm)
        self.norms: dict[int, float] = {}

    def start_epoch(self, epoch: int) -> None:
        self.norms = {}

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        squared = batch.norms_squared().to(torch.float64).cpu().numpy()
        if not np.isfinite(squared).all():
            raise ValueError(NON_FINITE_HELP)
        self.norms.update(zip(indices.tolist(), squared.tolist(), strict=True))

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        observed = [i for i in order.tolist() if i in self.norms]
        # a stable sort keeps the visit order among equal norms
        observed.sort(key=lambda i: -self.norms[i] if self.descending else self.norms[i])
        rest = [i for i in order.tolist() if i not in self.norms]
        return torch.tensor(observed + rest, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        keys = list(self.norms)
        return {
            "indices": torch.tensor(keys, dtype=torch.int64),
            "norms_squared": torch.tensor([self.norms[k] for k in keys], dtype=torch.float64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(self.name, state, {"indices", "norms_squared"})
        keys, values = state["indices"].tolist(), state["norms_squared"].tolist()
        self.norms = dict(zip(keys, values, strict=True))
