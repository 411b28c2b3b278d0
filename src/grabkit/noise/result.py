"""What every noise-scale estimator reports: |G|^2, tr(Sigma) and B_simple, per block and in total.

B_simple = tr(Sigma) / |G|^2 is the batch size at which the gradient noise equals the signal
(McCandlish et al. 2018). Both parts are averaged separately and the ratio is taken last; the
confidence interval says how much the average can be trusted instead of clamping negatives away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["NoiseScaleResult"]


@dataclass(frozen=True)
class NoiseScaleResult:
    """The current estimate of the gradient noise scale.

    Attributes:
        grad_norm_sq: averaged |G|^2 summed over all blocks (squared gradient norm, loss units
            squared per parameter unit squared). Unbiased, so it may be negative on few samples.
        trace_sigma: averaged tr(Sigma), the per-example gradient covariance trace (same units).
        b_simple: trace_sigma / grad_norm_sq, in examples; ``math.inf`` while the averaged
            |G|^2 is not positive (no detectable signal yet).
        interval: (low, high) confidence interval of B_simple at ``confidence`` (Fieller's
            interval for a ratio of two averaged, correlated estimates). It is
            ``(-inf, inf)`` until |G|^2 is significantly positive or with fewer than two
            observations.
        confidence: the coverage the interval was computed for, e.g. 0.95.
        block_names: names of the parameter blocks (one per parameter tensor, or one "all").
        block_grad_norm_sq: (P,) float64 tensor, |G|^2 of each block.
        block_trace_sigma: (P,) float64 tensor, tr(Sigma) of each block.
        observations: number of steps folded into the averages.
        examples: number of examples those steps covered.
    """

    grad_norm_sq: float
    trace_sigma: float
    b_simple: float
    interval: tuple[float, float]
    confidence: float
    block_names: tuple[str, ...]
    block_grad_norm_sq: torch.Tensor
    block_trace_sigma: torch.Tensor
    observations: int
    examples: float

    @property
    def block_b_simple(self) -> torch.Tensor:
        """(P,) B_simple of each block (inf where the block's |G|^2 is not positive)."""
        ratio = self.block_trace_sigma / self.block_grad_norm_sq
        return torch.where(self.block_grad_norm_sq > 0, ratio, torch.full_like(ratio, math.inf))

    @property
    def interval_is_bounded(self) -> bool:
        """True when the interval is finite, i.e. the signal |G|^2 is significantly positive."""
        return math.isfinite(self.interval[0]) and math.isfinite(self.interval[1])

    def as_dict(self) -> dict[str, float]:
        """Flat scalars for loggers: totals plus ``b_simple/<block>`` entries."""
        out = {
            "grad_norm_sq": self.grad_norm_sq,
            "trace_sigma": self.trace_sigma,
            "b_simple": self.b_simple,
            "b_simple_low": self.interval[0],
            "b_simple_high": self.interval[1],
        }
        for name, value in zip(self.block_names, self.block_b_simple.tolist(), strict=True):
            out[f"b_simple/{name}"] = value
        return out
