"""Gradient sources: where ``GraBSampler.step`` gets each step's per-example gradients.

* ``DenseGradients``: the gradients passed to ``step(grads)`` (grab-sampler's way);
* ``ExactHooks``: exact statistics from hooks on a model (``grabkit.stats.PerSampleStats``);
* ``SketchHooks``: (B, k) sketches from the same hooks (``grabkit.stats.SketchedStats``);
* ``HookGradients``: a statistics object of your own.

A new source is one subclass of ``GradientSource`` (``batches`` and, if it keeps anything,
``clear`` / ``discard`` / ``close``).
"""

from __future__ import annotations

from grabkit.order.sources.base import (
    Gradients,
    GradientSource,
    LossScaler,
    StatisticsReader,
    check_dim,
    dense_batch,
    loss_scale,
)
from grabkit.order.sources.dense import DenseGradients, param_dim
from grabkit.order.sources.hooks import HOOK_SAMPLER_NOT_PICKLABLE, ExactHooks, HookGradients
from grabkit.order.sources.sketch import DEFAULT_SKETCH_DIM, SketchHooks

__all__ = [
    "DEFAULT_SKETCH_DIM",
    "HOOK_SAMPLER_NOT_PICKLABLE",
    "DenseGradients",
    "ExactHooks",
    "GradientSource",
    "Gradients",
    "HookGradients",
    "LossScaler",
    "SketchHooks",
    "StatisticsReader",
    "check_dim",
    "dense_batch",
    "loss_scale",
    "param_dim",
]
