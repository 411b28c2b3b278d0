"""``batch``: stale-mean GraB deciding a whole batch at once against the batch-start sum."""

from __future__ import annotations

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.mean import MeanBalance

__all__ = ["BatchBalance"]


@register_ordering
class BatchBalance(MeanBalance):
    """Like ``mean``, but every sign of a batch is decided against the running sum at the start
    of the batch (no dependence between examples of one batch), and the sum then moves by the
    signed centred batch. Deciding and accumulating use the same centred vectors."""

    name = "batch"
    sequential = False
    splittable = False  # decisions depend on where batches start
