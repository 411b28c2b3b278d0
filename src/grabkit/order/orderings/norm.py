"""``norm``: order examples by the size of their last gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import NON_FINITE_HELP
from grabkit.order.orderings.base import Ordering, int_list, register_ordering
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.validation import check_bool

__all__ = ["OrderByNorm"]


@register_ordering
class OrderByNorm(Ordering):
    """Sort the examples observed this epoch by gradient norm, largest first
    (``descending_norm=True``, grab-sampler's default) or smallest first; examples not observed
    follow in their previous relative order. Reads only ``norms_squared()``."""

    name = "norm"
    splittable = True
    indices: list[int]  # the examples observed this epoch, in first-visit order
    norms_squared: list[float]  # their latest ||g_i||^2

    def __init__(self, n: int, *, descending_norm: bool = True, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.descending = check_bool("descending_norm", descending_norm)
        self._where: dict[int, int] = {}  # example -> its place in the two lists
        self.add_state("indices", [], save=_int64, load=int_list)
        self.add_state("norms_squared", [], save=_float64, load=_floats)

    def start_epoch(self, epoch: int) -> None:
        self.indices, self.norms_squared, self._where = [], [], {}

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        squared = batch.to_host(batch.norms_squared().to(torch.float64))  # the one host sync
        if not np.isfinite(squared).all():
            raise ValueError(NON_FINITE_HELP)
        for index, value in zip(indices.tolist(), squared.tolist(), strict=True):
            place = self._where.setdefault(index, len(self.indices))
            if place == len(self.indices):
                self.indices.append(index)
                self.norms_squared.append(value)
            else:
                self.norms_squared[place] = value

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        norms = dict(zip(self.indices, self.norms_squared, strict=True))
        observed = [i for i in order.tolist() if i in norms]
        # a stable sort keeps the visit order among equal norms
        observed.sort(key=lambda i: -norms[i] if self.descending else norms[i])
        rest = [i for i in order.tolist() if i not in norms]
        return torch.tensor(observed + rest, dtype=torch.int64)

    def after_load(self) -> None:
        self._where = {index: place for place, index in enumerate(self.indices)}


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _float64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _floats(saved: torch.Tensor) -> list[float]:
    return [float(v) for v in saved.tolist()]
