"""Every ordering, by the ``balance_type`` name grab-sampler uses for it."""

from __future__ import annotations

from grabkit.order.orderings.adaema import AdaEMABalance
from grabkit.order.orderings.adamean import AdaMeanBalance
from grabkit.order.orderings.base import Ordering
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

__all__ = ["ORDERINGS", "Ordering"]

#: balance_type name -> ordering class
ORDERINGS: dict[str, type[Ordering]] = {
    cls.name: cls
    for cls in (
        MeanBalance,
        PairBalance,
        RecursiveBalance,
        RecursivePairBalance,
        BatchBalance,
        EMABalance,
        AdaMeanBalance,
        AdaEMABalance,
        SignBalance,
        OrderByNorm,
        RandomReshuffling,
        ShuffleOnce,
        SampleWithReplacement,
        FixedOrdering,
        NTKFixedBalance,
        NTKEigen,
        NTKFixedEigen,
        FlipFlop,
        GreedyHerding,
    )
}
