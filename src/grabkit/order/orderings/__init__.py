"""Every ordering, registered by the ``balance_type`` name grab-sampler uses for it.

Importing this package imports each ordering module; each class registers itself with
``@register_ordering`` beside its definition (``grabkit.order.orderings.base``). Each is built
with its own options, ``MeanBalance(n, seed=0)``, ``RecursiveBalance(n, depth=3)``, ... and
handed to ``GraBSampler(dataset, ordering, source)``.
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
from grabkit.order.orderings.adaema import AdaEMABalance
from grabkit.order.orderings.adamean import AdaMeanBalance
from grabkit.order.orderings.base import ORDERINGS, Ordering, register_ordering
from grabkit.order.orderings.baselines import (
    FixedOrdering,
    RandomReshuffling,
    SampleWithReplacement,
    ShuffleOnce,
)
from grabkit.order.orderings.batch import BatchBalance
from grabkit.order.orderings.ema import EMABalance
from grabkit.order.orderings.flipflop import FlipFlop
from grabkit.order.orderings.greedy import GreedyHerding
from grabkit.order.orderings.mean import MeanBalance
from grabkit.order.orderings.norm import OrderByNorm
from grabkit.order.orderings.ntk import NTKEigen, NTKFixedBalance, NTKFixedEigen
from grabkit.order.orderings.pair import PairBalance
from grabkit.order.orderings.recursive import RecursiveBalance
from grabkit.order.orderings.recursive_pair import RecursivePairBalance
from grabkit.order.orderings.sign import SignBalance

__all__ = [
    "ORDERINGS",
    "AdaEMABalance",
    "AdaMeanBalance",
    "BatchBalance",
    "EMABalance",
    "FixedOrdering",
    "FlipFlop",
    "GreedyHerding",
    "MeanBalance",
    "NTKEigen",
    "NTKFixedBalance",
    "NTKFixedEigen",
    "OrderByNorm",
    "Ordering",
    "PairBalance",
    "RandomReshuffling",
    "RecursiveBalance",
    "RecursivePairBalance",
    "SampleWithReplacement",
    "ShuffleOnce",
    "SignBalance",
    "register_ordering",
]

# grab-sampler's order of the built-in names (BALANCE_TYPES lists them so); orderings
# registered later follow them
_BUILT_IN = (
    "mean", "pair", "recursive", "recursive-pair", "batch", "ema", "adamean", "adaema", "sign",
    "norm", "rr", "so", "swr", "fixed", "ntk-fixed", "ntk-eigen", "ntk-fixed-eigen", "flipflop",
    "greedy",
)  # fmt: skip
ORDERINGS.update({name: ORDERINGS.pop(name) for name in _BUILT_IN})
