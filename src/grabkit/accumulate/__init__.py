"""Adaptive gradient accumulation: optimizer wrappers that decide after each microbatch whether
the accumulated gradient is good enough to step on (torch-gqc compatible).

* :mod:`~grabkit.accumulate.wrapper`      ``AdaptiveAccumulationWrapper``, the real optimizer
* :mod:`~grabkit.accumulate.controllers`  the stepping rules, one knob each; ``Controller`` is
  the extension point (a new rule is one subclass, passed to the wrapper)
* :mod:`~grabkit.accumulate.counters`     the wrapper's counters, declared once
* :mod:`~grabkit.accumulate.gqc`          GQC's five wrappers by name
* :mod:`~grabkit.accumulate.schedules`    schedules for the knobs
"""

from grabkit.accumulate.controllers import (
    AlwaysStep,
    Controller,
    MetricHypothesisTest,
    NoiseScaleController,
    NormRescale,
    NormTest,
    NormThreshold,
    Observation,
    RelativeNormThreshold,
    ScheduledBatch,
    window_noise_estimates,
)
from grabkit.accumulate.counters import AccumulationCounters
from grabkit.accumulate.gqc import (
    OptimizerWrapperGNR,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
)
from grabkit.accumulate.schedules import (
    NormWarmupScheduler,
    ValueSchedule,
    get_curved_batch_schedule,
    get_direct_cosine_annealing_with_warmup,
    get_norm_threshold_cosine_annealing_with_warmup,
    get_quadratic_batch_schedule,
)
from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper

__all__ = [
    "AccumulationCounters",
    "AdaptiveAccumulationWrapper",
    "AlwaysStep",
    "Controller",
    "MetricHypothesisTest",
    "NoiseScaleController",
    "NormRescale",
    "NormTest",
    "NormThreshold",
    "NormWarmupScheduler",
    "Observation",
    "OptimizerWrapperGNR",
    "OptimizerWrapperGNS",
    "OptimizerWrapperGNTS",
    "OptimizerWrapperMHT",
    "OptimizerWrapperSBC",
    "RelativeNormThreshold",
    "ScheduledBatch",
    "ValueSchedule",
    "get_curved_batch_schedule",
    "get_direct_cosine_annealing_with_warmup",
    "get_norm_threshold_cosine_annealing_with_warmup",
    "get_quadratic_batch_schedule",
    "window_noise_estimates",
]
