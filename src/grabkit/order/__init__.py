"""Example ordering: GraB herding and its baselines, as PyTorch samplers.

``GraBSampler`` orders a dataset by balancing per-example gradients (Lu et al., 2022), with every
``balance_type`` of grab-sampler; ``GraBBatchSampler`` is its batch-sampler form. A sampler is an
ordering x a gradient source x a chain of transforms:

* ``grabkit.order.orderings``: what decides the order (``MeanBalance``, ``PairBalance``, ...);
* ``grabkit.order.sources``: where each step's gradients come from (``DenseGradients``,
  ``ExactHooks``, ``SketchHooks``, ``HookGradients``);
* ``grabkit.order.transforms``: what happens to them on the way (``Cast``, ``Project``,
  ``GatherAcrossRanks``, ``Normalize``);

and ``grabkit.order.keywords`` builds the three from grabkit's and grab-sampler's keywords. The
batched sign recursion is ``grabkit.order.balance``.
"""

from __future__ import annotations

from grabkit.order.batch_sampler import GraBBatchSampler
from grabkit.order.compat import BalanceType
from grabkit.order.herding import StreamingHerdingBound, herding_bound
from grabkit.order.orderings import (
    ORDERINGS,
    MeanBalance,
    Ordering,
    PairBalance,
    RecursiveBalance,
    register_ordering,
)
from grabkit.order.projection import make_projection
from grabkit.order.sampler import GraBSampler
from grabkit.order.sources import (
    DenseGradients,
    ExactHooks,
    GradientSource,
    HookGradients,
    SketchHooks,
)
from grabkit.order.transforms import Cast, GatherAcrossRanks, Normalize, Project, Transform

__all__ = [
    "BALANCE_TYPES",
    "BalanceType",
    "Cast",
    "DenseGradients",
    "ExactHooks",
    "GatherAcrossRanks",
    "GraBBatchSampler",
    "GraBSampler",
    "GradientSource",
    "HookGradients",
    "MeanBalance",
    "Normalize",
    "Ordering",
    "PairBalance",
    "Project",
    "RecursiveBalance",
    "SketchHooks",
    "StreamingHerdingBound",
    "Transform",
    "herding_bound",
    "make_projection",
    "register_ordering",
]

#: every accepted ``balance_type``
BALANCE_TYPES: tuple[str, ...] = tuple(ORDERINGS)
