"""``greedy``: stale-gradient greedy herding, the GraB paper's offline baseline."""

from __future__ import annotations

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.store import StoredGradientOrdering

__all__ = ["GreedyHerding", "greedy_herding_order"]


def greedy_herding_order(vectors: torch.Tensor) -> torch.Tensor:
    """Greedy herding: repeatedly append the vector that keeps the centred prefix sum smallest.

    Args:
        vectors: (m, d); they are centred by their mean first.
    Returns:
        (m,) int64 positions into ``vectors``. Costs O(m^2) memory (the Gram matrix) and O(m^2 d)
        time.
    """
    Z = (vectors - vectors.mean(dim=0)).to(torch.float64)
    G = Z @ Z.T  # (m, m)
    m = G.shape[0]
    norms = G.diagonal().clone()
    inner = torch.zeros(m, dtype=torch.float64)  # <s, z_c> for the current prefix sum s
    taken = torch.zeros(m, dtype=torch.bool)
    order = []
    for _ in range(m):
        score = 2 * inner + norms  # ||s + z_c||^2 - ||s||^2
        score[taken] = float("inf")
        j = int(torch.argmin(score))
        order.append(j)
        taken[j] = True
        inner += G[:, j]
    return torch.tensor(order, dtype=torch.int64)


@register_ordering
class GreedyHerding(StoredGradientOrdering):
    """Keep every example's gradient of this epoch (n x d, warned about when large) and build the
    next order greedily from them, centred by their mean. Examples not observed follow at the
    end in their previous order. Needs dense gradients (use a projection to shrink d)."""

    name = "greedy"
    splittable = True

    def rank(self, rows: torch.Tensor) -> torch.Tensor:
        return greedy_herding_order(rows)
