"""Example ordering: GraB herding and its baselines, as PyTorch samplers.

``GraBSampler`` orders a dataset by balancing per-example gradients (Lu et al., 2022), with every
``balance_type`` of grab-sampler; ``GraBBatchSampler`` is its batch-sampler form. The orderings
themselves live in ``grabkit.order.orderings``, the batched sign recursion in
``grabkit.order.balance``.
"""

from __future__ import annotations

from grabkit.order.batch_sampler import GraBBatchSampler
from grabkit.order.compat import BalanceType
from grabkit.order.herding import StreamingHerdingBound, herding_bound
from grabkit.order.orderings import ORDERINGS, Ordering, register_ordering
from grabkit.order.projection import make_projection
from grabkit.order.sampler import GraBSampler

__all__ = [
    "BALANCE_TYPES",
    "BalanceType",
    "GraBBatchSampler",
    "GraBSampler",
    "Ordering",
    "StreamingHerdingBound",
    "herding_bound",
    "make_projection",
    "register_ordering",
]

#: every accepted ``balance_type``
BALANCE_TYPES: tuple[str, ...] = tuple(ORDERINGS)
