"""Noise scale from gradient accumulation: microbatch norms against the norm of their mean.

A step that accumulates K microbatches of n_1..n_K examples (B = sum n_k) already computes the
gradients needed by the two-batch identity, E |G_b|^2 = |G|^2 + tr(Sigma) / b:

* small batches: each microbatch's mean gradient g_k. Averaging |g_k|^2 with weights n_k / B
  gives E = |G|^2 + tr(Sigma) K / B, i.e. an effective small batch size of B / K;
* big batch: the step's mean gradient G_B = sum_k (n_k / B) g_k, of size B.

No extra forward or backward pass is needed: only the squared norms. ``MicrobatchNoiseScale`` takes
those norms as plain numbers or per-block tensors; ``AccumulationNoiseScale`` (in
``grabkit.noise.accumulation``) measures them with gradient hooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grabkit.noise.identities import two_batch_estimates
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.tracker import TrackedEstimator
from grabkit.stats.transfer import to_device
from grabkit.validation import check_positive

__all__ = ["MicrobatchNoiseScale"]


class MicrobatchNoiseScale(TrackedEstimator):
    """B_simple from the squared norms of microbatch gradients and of the step gradient.

    Per step: call ``observe_microbatch(grad_norm_sq, count)`` once per microbatch, then
    ``observe_step(grad_norm_sq)`` with the squared norm of the step's mean gradient. Norms may be
    Python floats, 0-d tensors, or (P,) tensors with one entry per parameter block.

    Args:
        update_rate: EMA weight of the newest step (or example, with window="examples"),
            with the meaning of ALF's ``ScalarEMAverager(update_rate)``.
        window: "steps" or "examples", the unit of ``update_rate``.
        confidence: coverage of the reported interval for B_simple.
        block_names: names of the P blocks when norms are (P,) tensors.
        population_size: the data set size N when steps draw without replacement; see
            ``NoiseScaleTracker`` (finite-population correction).

    Norms must be of *mean* gradients (per-example loss averaged over the microbatch / step) and
    measured before clipping and after undoing any loss scaling.

    Its state: the tracker and the microbatches observed since the last ``observe_step`` (the
    pending (K, P) norms and their counts), so a checkpoint taken in mid-step resumes to the
    same estimate.
    """

    def __init__(
        self,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        block_names: Sequence[str] = ("all",),
        population_size: int | None = None,
    ) -> None:
        super().__init__(update_rate, window, confidence, block_names, population_size)
        self.add_state("pending_norms", attribute="_micro_norms", save=_joined, load=_pending)
        self.add_state("pending_counts", attribute="_micro_counts", save=list, load=_floats)

    def observe(self, grad_norm_sq: torch.Tensor | float) -> NoiseScaleResult | None:
        """``observe_step``: close the step with |G_B|^2 of its mean gradient."""
        return self.observe_step(grad_norm_sq)

    def clear_pending(self) -> None:
        """Forget the microbatches observed since the last ``observe_step``."""
        self._micro_norms: list[torch.Tensor] = []
        self._micro_counts: list[float] = []

    @property
    def pending_microbatches(self) -> int:
        """Microbatches observed since the last ``observe_step``."""
        return len(self._micro_counts)

    def observe_microbatch(self, grad_norm_sq: torch.Tensor | float, count: float) -> None:
        """Record |g_k|^2 of one microbatch's mean gradient, over ``count`` examples."""
        self._micro_counts.append(check_positive("count", count))
        self._micro_norms.append(torch.as_tensor(grad_norm_sq, dtype=torch.float64).reshape(1, -1))

    def observe_microbatches(self, grad_norm_sq: torch.Tensor, counts: Sequence[float]) -> None:
        """Record several microbatches at once: (K,) or (K, P) norms and K example counts."""
        norms = torch.as_tensor(grad_norm_sq, dtype=torch.float64)
        if norms.ndim not in (1, 2) or norms.shape[0] != len(counts):
            raise ValueError(
                f"grad_norm_sq should be (K,) or (K, P) with K = len(counts) = {len(counts)}, "
                f"but got shape {tuple(norms.shape)}"
            )
        self._micro_counts.extend(check_positive("count", c) for c in counts)
        self._micro_norms.append(norms.reshape(len(counts), -1))

    def step_estimates(
        self, grad_norm_sq: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """This step's unbiased (|G|^2, tr Sigma, examples), without averaging; clears the step.

        Returns None when fewer than two microbatches were observed (no information).
        """
        norms, counts = self._micro_norms, self._micro_counts
        self.clear_pending()
        if len(counts) < 2:
            return None
        stacked = torch.cat([n.to(norms[0].device) for n in norms])  # (K, P)
        total = sum(counts)
        weights = to_device(torch.tensor(counts, dtype=torch.float64), stacked.device) / total
        small = (weights[:, None] * stacked).sum(0)
        big = torch.as_tensor(grad_norm_sq, dtype=torch.float64).reshape(-1).to(small.device)
        if big.shape != small.shape:
            raise ValueError(
                f"step grad_norm_sq has {big.numel()} block entries but the microbatch norms "
                f"have {small.numel()}; pass both per block or both as totals"
            )
        grad_norm, trace = two_batch_estimates(small, total / len(counts), big, total)
        return grad_norm, trace, total

    def observe_step(self, grad_norm_sq: torch.Tensor | float) -> NoiseScaleResult | None:
        """Close the step with |G_B|^2 of its mean gradient and return the current estimate.

        Steps with fewer than two microbatches carry no noise information and leave the averages
        unchanged. Steps whose norms are not finite (an overflowing loss scale) are skipped.
        Returns None until the first informative step.
        """
        estimates = self.step_estimates(grad_norm_sq)
        if estimates is not None:
            self.fold(*estimates)
        return self.estimate

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``, once its pending microbatches were found consistent."""
        if isinstance(state, Mapping) and {"pending_norms", "pending_counts"} <= set(state):
            norms, counts = state["pending_norms"], list(state["pending_counts"])
            if (norms is None) != (not counts) or (
                norms is not None and (norms.ndim != 2 or norms.shape[0] != len(counts))
            ):
                raise ValueError(
                    "MicrobatchNoiseScale state's pending microbatches are inconsistent: "
                    f"{len(counts)} counts for norms of shape "
                    f"{None if norms is None else tuple(norms.shape)}"
                )
        super().load_state_dict(state)


def _joined(norms: list[torch.Tensor]) -> torch.Tensor | None:
    """The pending (K, P) norms as one tensor (None when no microbatch is pending)."""
    if not norms:
        return None
    return torch.cat([n.to(norms[0].device) for n in norms])


def _pending(saved: torch.Tensor | None) -> list[torch.Tensor]:
    return [] if saved is None else [saved.to(torch.float64).clone()]


def _floats(saved: Sequence[float]) -> list[float]:
    return [float(c) for c in saved]
