"""Per-sample gradient statistics without per-sample gradients.

``PerSampleStats`` attaches hooks to an ordinary model and, after ``loss.backward()``, reads the
norms, Gram matrix, dots and weighted sums of the per-example gradients exactly, layer by layer,
without building a (B, d) tensor; ``SketchedStats`` reads a (B, k) random sketch of them instead
(``grabkit.stats.sketch``). Both are ``StatisticsSource``s: a consumer subscribes and takes each
backward's ``GradientBatch``, the interface orderings consume; ``DenseGradientBatch`` (a (B, d)
matrix) and ``HookGradientBatch`` implement it. Every read first checks that the per-example
gradients add up to the gradient autograd delivered (``grabkit.stats.identity``;
``IdentityCheckError`` when they do not).
"""

from grabkit.stats import recurrent as _recurrent  # noqa: F401  (registers LSTM/GRU/RNN)
from grabkit.stats import transformers_rules as _transformers  # noqa: F401  (by class name)
from grabkit.stats.engine import PerSampleStats
from grabkit.stats.gradient_batch import (
    DenseGradientBatch,
    GradientBatch,
    flat_to_named,
    named_to_flat,
)
from grabkit.stats.hook_batch import HookGradientBatch
from grabkit.stats.identity import IdentityCheckError
from grabkit.stats.rules import LayerRule, register_rule, registered_rules, rule_for
from grabkit.stats.sketch import GradientSketch, SketchedStats
from grabkit.stats.source import StatisticsSource, Subscription
from grabkit.stats.step import StepStatistics

__all__ = [
    "DenseGradientBatch",
    "GradientBatch",
    "GradientSketch",
    "HookGradientBatch",
    "IdentityCheckError",
    "LayerRule",
    "PerSampleStats",
    "SketchedStats",
    "StatisticsSource",
    "StepStatistics",
    "Subscription",
    "flat_to_named",
    "named_to_flat",
    "register_rule",
    "registered_rules",
    "rule_for",
]
