"""grabkit: gradient statistics that decide order, grouping, stepping and noise scale.

Subpackages, one per concern:

* ``grabkit.stats``      per-sample gradient statistics from layer hooks (norms, dots, Gram, sums)
* ``grabkit.order``      example ordering: the GraB herding family and its baselines, as samplers
* ``grabkit.group``      variable-length batch grouping (asym-compatible ``DataCollection`` & co.)
* ``grabkit.accumulate`` adaptive gradient accumulation (GQC-compatible optimizer wrappers)
* ``grabkit.noise``      gradient noise scale estimators (ALF-compatible and cheaper ones)

The names below are the curated public API; they are imported lazily so that ``import grabkit``
stays cheap and one concern never drags in another.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> subpackage that defines it
_EXPORTS: dict[str, str] = {
    # ordering
    "GraBSampler": "grabkit.order",
    "GraBBatchSampler": "grabkit.order",
    "BalanceType": "grabkit.order",
    "Ordering": "grabkit.order",
    "register_ordering": "grabkit.order",
    "herding_bound": "grabkit.order",
    "StreamingHerdingBound": "grabkit.order",
    "make_projection": "grabkit.order",
    # grouping
    "DataCollection": "grabkit.group",
    "AnnotatedModule": "grabkit.group",
    "UniGrouper": "grabkit.group",
    "LengthThresholdGrouper": "grabkit.group",
    "find_thresholds": "grabkit.group",
    "GroupingCollate": "grabkit.group",
    "run_grouped": "grabkit.group",
    "plan_groups": "grabkit.group",
    # per-sample statistics
    "PerSampleStats": "grabkit.stats",
    # noise scale
    "GradientNoiseScaleEstimator": "grabkit.noise",
    "MicrobatchNoiseScale": "grabkit.noise",
    "AccumulationNoiseScale": "grabkit.noise",
    "PerExampleNoiseScale": "grabkit.noise",
    "DDPNoiseScale": "grabkit.noise",
    "NoiseScaleResult": "grabkit.noise",
    # adaptive accumulation
    "AdaptiveAccumulationWrapper": "grabkit.accumulate",
    "Controller": "grabkit.accumulate",
    "NoiseScaleController": "grabkit.accumulate",
    "NormTest": "grabkit.accumulate",
    "RelativeNormThreshold": "grabkit.accumulate",
    "OptimizerWrapperGNTS": "grabkit.accumulate",
    "OptimizerWrapperGNS": "grabkit.accumulate",
    "OptimizerWrapperMHT": "grabkit.accumulate",
    "OptimizerWrapperGNR": "grabkit.accumulate",
    "OptimizerWrapperSBC": "grabkit.accumulate",
    "NormWarmupScheduler": "grabkit.accumulate",
    "get_norm_threshold_cosine_annealing_with_warmup": "grabkit.accumulate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grabkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
