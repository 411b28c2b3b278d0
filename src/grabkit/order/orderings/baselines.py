"""Orderings that ignore gradients: ``rr``, ``so``, ``swr``, ``fixed``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grabkit.order.balance import epoch_generator
from grabkit.order.orderings.base import (
    PURPOSE_RESHUFFLE,
    PURPOSE_SHUFFLE_ONCE,
    PURPOSE_WITH_REPLACEMENT,
    Ordering,
    random_permutation,
    register_ordering,
)

__all__ = ["FixedOrdering", "RandomReshuffling", "SampleWithReplacement", "ShuffleOnce"]


class _DrawnEachEpoch(Ordering):
    """Orderings that ignore gradients and draw every epoch's order afresh from (seed, epoch)
    in ``initial_order``."""

    uses_gradients = False

    def renumber(self, epoch: int, order: torch.Tensor) -> torch.Tensor:
        return self.initial_order(epoch)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return self.initial_order(next_epoch)


@register_ordering
class RandomReshuffling(_DrawnEachEpoch):
    """``rr``: a fresh uniformly random permutation every epoch, from (seed, epoch)."""

    name = "rr"

    def initial_order(self, epoch: int) -> torch.Tensor:
        return random_permutation(self.n, self.seed, epoch, PURPOSE_RESHUFFLE)


@register_ordering
class ShuffleOnce(Ordering):
    """``so``: one random permutation (from the seed), used for every epoch."""

    name = "so"
    uses_gradients = False

    def initial_order(self, epoch: int) -> torch.Tensor:
        return random_permutation(self.n, self.seed, 0, PURPOSE_SHUFFLE_ONCE)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return order


@register_ordering
class SampleWithReplacement(_DrawnEachEpoch):
    """``swr``: n indices drawn uniformly with replacement each epoch (not a permutation)."""

    name = "swr"

    def initial_order(self, epoch: int) -> torch.Tensor:
        g = epoch_generator(self.seed, epoch, PURPOSE_WITH_REPLACEMENT)
        return torch.randint(self.n, (self.n,), generator=g)


@register_ordering
class FixedOrdering(Ordering):
    """``fixed``: the given ``orders`` (a permutation of 0..n-1) every epoch; 0..n-1 if None."""

    name = "fixed"
    uses_gradients = False

    def __init__(self, n: int, *, orders: Sequence[int] | torch.Tensor | None = None, **kw: Any):
        super().__init__(n, **kw)
        if orders is None:
            self.orders = torch.arange(n)
        else:
            self.orders = torch.as_tensor(orders, dtype=torch.int64).reshape(-1).clone()
            if self.orders.numel() != n or not torch.equal(
                torch.sort(self.orders).values, torch.arange(n)
            ):
                raise ValueError(
                    f"`orders` should be a permutation of 0..{n - 1} (one entry per example), "
                    f"but got {self.orders.numel()} entries that are not; pass None for 0..n-1."
                )

    def initial_order(self, epoch: int) -> torch.Tensor:
        return self.orders.clone()

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return self.orders.clone()
