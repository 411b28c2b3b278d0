"""Gradient noise scale estimators.

B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) from the unbiased two-batch identity
E |G_b|^2 = |G|^2 + tr(Sigma) / b, with numerator and denominator averaged separately:

* ``GradientNoiseScaleEstimator``: ALF-compatible, two extra backward passes per update;
* ``MicrobatchNoiseScale`` / ``AccumulationNoiseScale``: free under gradient accumulation;
* ``PerExampleNoiseScale``: from per-example squared gradient norms;
* ``DDPNoiseScale``: free under DistributedDataParallel (a communication hook).

All report a ``NoiseScaleResult``: |G|^2, tr(Sigma) and B_simple per block and in total, with a
confidence interval, through one surface (``NoiseEstimator``): ``observe(...)`` takes a step and
returns ``estimate``, ``close()`` detaches what the estimator attached; their states are declared
once (``grabkit.state``).
"""

from grabkit.noise.accumulation import AccumulationNoiseScale
from grabkit.noise.alf import GradientNoiseScaleEstimator
from grabkit.noise.averaging import BiasCorrectedEMA
from grabkit.noise.ddp import DDPNoiseScale
from grabkit.noise.estimator import NoiseEstimator
from grabkit.noise.identities import two_batch_estimates
from grabkit.noise.microbatch import MicrobatchNoiseScale
from grabkit.noise.per_example import PerExampleNoiseScale
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.tracker import NoiseScaleTracker, ratio_interval

__all__ = [
    "AccumulationNoiseScale",
    "BiasCorrectedEMA",
    "DDPNoiseScale",
    "GradientNoiseScaleEstimator",
    "MicrobatchNoiseScale",
    "NoiseEstimator",
    "NoiseScaleResult",
    "NoiseScaleTracker",
    "PerExampleNoiseScale",
    "ratio_interval",
    "two_batch_estimates",
]
