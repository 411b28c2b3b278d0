"""``flipflop``: a random order, then the same order reversed, alternately."""

from __future__ import annotations

import torch

from grabkit.order.orderings.base import (
    PURPOSE_RESHUFFLE,
    Ordering,
    random_permutation,
    register_ordering,
)

__all__ = ["FlipFlop"]


@register_ordering
class FlipFlop(Ordering):
    """Even epochs draw a fresh random permutation from (seed, epoch); odd epochs replay the
    previous epoch's order backwards (Rajput et al., 2022; a baseline of the GraB paper)."""

    name = "flipflop"
    uses_gradients = False

    def initial_order(self, epoch: int) -> torch.Tensor:
        if epoch % 2:
            return random_permutation(self.n, self.seed, epoch - 1, PURPOSE_RESHUFFLE).flip(0)
        return random_permutation(self.n, self.seed, epoch, PURPOSE_RESHUFFLE)

    def renumber(self, epoch: int, order: torch.Tensor) -> torch.Tensor:
        return self.initial_order(epoch)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        if next_epoch % 2:
            return order.flip(0)
        return random_permutation(self.n, self.seed, next_epoch, PURPOSE_RESHUFFLE)
