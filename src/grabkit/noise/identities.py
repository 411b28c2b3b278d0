"""The unbiased two-batch identities behind every noise-scale estimator in grabkit.

For a gradient G_b averaged over b examples drawn i.i.d. (with replacement) from the data,

    E |G_b|^2 = |G|^2 + tr(Sigma) / b,

where G is the true (full-data) gradient and Sigma the per-example gradient covariance. Two
measurements at batch sizes b_small < b_big give unbiased estimates of both unknowns
(McCandlish et al. 2018, appendix A). The gradient noise scale is B_simple = tr(Sigma) / |G|^2;
average numerator and denominator separately over many steps and take the ratio last.

Units: squared gradient norms, in the loss's units squared per parameter unit squared.
"""

from __future__ import annotations

import torch

__all__ = ["loss_scale_squared", "two_batch_estimates"]


def two_batch_estimates(
    small_norm_sq: torch.Tensor | float,
    small_size: torch.Tensor | float,
    big_norm_sq: torch.Tensor | float,
    big_size: torch.Tensor | float,
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """Unbiased estimates of (|G|^2, tr(Sigma)) from two squared gradient norms.

    Args:
        small_norm_sq: |G_small|^2 measured on ``small_size`` examples (an average over several
            small batches of the same size is fine and lowers the variance).
        small_size: b_small > 0.
        big_norm_sq: |G_big|^2 measured on ``big_size`` examples.
        big_size: b_big > b_small.
    Returns:
        (grad_norm_sq, trace_sigma): each unbiased, either may come out negative on one draw.
    """
    sizes_known = isinstance(small_size, (int, float)) and isinstance(big_size, (int, float))
    if sizes_known and not 0 < small_size < big_size:
        raise ValueError(
            f"two_batch_estimates needs 0 < small_size < big_size, got "
            f"small_size={small_size}, big_size={big_size}"
        )
    grad_norm_sq = (big_size * big_norm_sq - small_size * small_norm_sq) / (big_size - small_size)
    trace_sigma = (small_norm_sq - big_norm_sq) / (1.0 / small_size - 1.0 / big_size)
    return grad_norm_sq, trace_sigma


def loss_scale_squared(grad_scaler: torch.amp.GradScaler | None) -> float:
    """The factor a ``GradScaler`` puts on every squared gradient norm (1 without one, or when
    it is disabled): squared norms measured before ``unscale_`` are divided by it."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 1.0
    return float(grad_scaler.get_scale()) ** 2
