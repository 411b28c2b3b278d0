"""Gradient noise scale estimators."""

from grabkit.noise.averaging import BiasCorrectedEMA
from grabkit.noise.identities import two_batch_estimates

__all__ = ["BiasCorrectedEMA", "two_batch_estimates"]
