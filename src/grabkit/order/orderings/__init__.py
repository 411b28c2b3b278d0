"""Every ordering, registered by the ``balance_type`` name grab-sampler uses for it.

Importing this package imports each ordering module; each class registers itself with
``@register_ordering`` beside its definition (``grabkit.order.orderings.base``).
"""

from __future__ import annotations

from grabkit.order.orderings import (  # noqa: F401 (imported for their registrations)
    adaema,
    adamean,
    baselines,
    batch,
    ema,
    flipflop,
    greedy,
    mean,
    norm,
    ntk,
    pair,
    recursive,
    recursive_pair,
    sign,
)
from grabkit.order.orderings.base import ORDERINGS, Ordering, register_ordering

__all__ = ["ORDERINGS", "Ordering", "register_ordering"]

# grab-sampler's order of the built-in names (BALANCE_TYPES lists them so); orderings
# registered later follow them
_BUILT_IN = (
    "mean", "pair", "recursive", "recursive-pair", "batch", "ema", "adamean", "adaema", "sign",
    "norm", "rr", "so", "swr", "fixed", "ntk-fixed", "ntk-eigen", "ntk-fixed-eigen", "flipflop",
    "greedy",
)  # fmt: skip
ORDERINGS.update({name: ORDERINGS.pop(name) for name in _BUILT_IN})
