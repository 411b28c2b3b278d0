"""Per-sample gradient statistics without per-sample gradients."""

from grabkit.stats.gradient_batch import (
    DenseGradientBatch,
    GradientBatch,
    flat_to_named,
    named_to_flat,
)

__all__ = ["DenseGradientBatch", "GradientBatch", "flat_to_named", "named_to_flat"]
