"""Noise scale from per-example gradient norms: the two-batch identity with b_small = 1.

With per-example gradients g_1..g_B of one batch and its mean gradient G_B,
mean_i |g_i|^2 estimates |G|^2 + tr(Sigma) (batches of one) and |G_B|^2 estimates
|G|^2 + tr(Sigma) / B, so ``two_batch_estimates(mean_i |g_i|^2, 1, |G_B|^2, B)`` gives unbiased
|G|^2 and tr(Sigma) (the latter is the sample variance of the g_i, summed over coordinates).

The per-example squared norms come from ``grabkit.stats.PerSampleStats`` (layer hooks, no
per-example gradient is ever built) or from any other source as plain tensors.

With several ranks (DDP, ``fully_shard``) each rank's batch gives its own unbiased estimates;
the ranks average them (one all-reduce of 2P + 1 numbers per step), so every rank folds the same
step and reports the same estimate, over all ranks' examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grabkit.noise.identities import two_batch_estimates
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.tracker import TrackedEstimator
from grabkit.sharding import world_size

if TYPE_CHECKING:
    from grabkit.stats import PerSampleStats

__all__ = ["PerExampleNoiseScale"]


class PerExampleNoiseScale(TrackedEstimator):
    """B_simple from per-example squared gradient norms and the batch gradient's squared norm.

    Args:
        update_rate: EMA weight of the newest step (or example, with window="examples"),
            with the meaning of ALF's ``ScalarEMAverager(update_rate)``.
        window: "steps" or "examples", the unit of ``update_rate``.
        confidence: coverage of the reported interval for B_simple.
        block_names: names of the P blocks when norms are given per block.
        population_size: the data set size N when batches are drawn without replacement; see
            ``NoiseScaleTracker`` (finite-population correction).
        process_group: the ranks whose batches make one step (default: the world when
            torch.distributed is initialised with several ranks; ``observe`` is then collective).
    """

    def __init__(
        self,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        block_names: Sequence[str] = ("all",),
        population_size: int | None = None,
        process_group: Any = None,
    ) -> None:
        super().__init__(update_rate, window, confidence, block_names, population_size)
        self.process_group = process_group
        #: (id of the statistics, their generation) of the backward ``observe_stats`` folded last
        self._observed: tuple[int, int] | None = None

    def _average_over_ranks(
        self, grad_norm: torch.Tensor, trace: torch.Tensor, batch: float
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The ranks' mean of their unbiased estimates (still unbiased) and their examples."""
        world = world_size(self.process_group)
        if world == 1:
            return grad_norm, trace, batch
        blocks = grad_norm.numel()
        count = torch.tensor([float(batch)], dtype=torch.float64, device=grad_norm.device)
        summed = torch.cat([grad_norm.reshape(-1), trace.reshape(-1), count])
        dist.all_reduce(summed, group=self.process_group)
        return summed[:blocks] / world, summed[blocks:-1] / world, float(summed[-1])

    @staticmethod
    def step_estimates(
        norms_sq: torch.Tensor, batch_grad_norm_sq: torch.Tensor | float, grad_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One batch's unbiased (|G|^2, tr Sigma) per block and its size B, without averaging.

        Args:
            norms_sq: (B,) or (B, P) squared norms |g_i|^2 of each example's loss gradient
                (per block when (B, P)).
            batch_grad_norm_sq: scalar or (P,) squared norm of the batch's *mean* gradient.
            grad_scale: a loss scale that multiplies every gradient (GradScaler); divided out.
        """
        if not isinstance(norms_sq, torch.Tensor) or norms_sq.ndim not in (1, 2):
            shape = tuple(norms_sq.shape) if isinstance(norms_sq, torch.Tensor) else norms_sq
            raise ValueError(f"norms_sq should be a (B,) or (B, P) tensor, but got {shape}")
        batch = norms_sq.shape[0]
        if batch < 2:
            raise ValueError(f"norms_sq needs at least 2 examples, but got a batch of {batch}")
        if not grad_scale > 0:
            raise ValueError(f"grad_scale should be positive, but got grad_scale={grad_scale}")
        per_block = norms_sq.to(torch.float64).reshape(batch, -1)
        small = per_block.mean(0) / grad_scale**2
        big = torch.as_tensor(batch_grad_norm_sq, dtype=torch.float64).reshape(-1)
        big = big.to(small.device) / grad_scale**2
        if big.shape != small.shape:
            raise ValueError(
                f"batch_grad_norm_sq has {big.numel()} block entries but norms_sq has "
                f"{small.numel()} per example; pass both per block or both as totals"
            )
        grad_norm, trace = two_batch_estimates(small, 1.0, big, float(batch))
        return grad_norm, trace, batch

    def observe(
        self,
        norms_sq: torch.Tensor,
        batch_grad_norm_sq: torch.Tensor | float,
        grad_scale: float = 1.0,
    ) -> NoiseScaleResult | None:
        """Fold one batch in (arguments as in ``step_estimates``) and return the estimate.

        Batches with non-finite norms (an overflowing loss scale) are skipped; returns None
        until the first finite one. Collective with several ranks.
        """
        estimates = self.step_estimates(norms_sq, batch_grad_norm_sq, grad_scale)
        self.fold(*self._average_over_ranks(*estimates))
        return self.estimate

    @classmethod
    def for_stats(cls, stats: PerSampleStats, **kwargs: object) -> PerExampleNoiseScale:
        """An estimator with one block per trainable parameter of ``stats``' model."""
        return cls(block_names=tuple(stats.param_shapes), **kwargs)

    def _check_observable(self, stats: PerSampleStats) -> None:
        """Refuse statistics without exact norms and batch gradient, and a backward already
        folded."""
        if not callable(getattr(stats, "statistics", None)):
            raise TypeError(
                f"observe_stats reads exact per-example norms and the batch gradient from a "
                f"PerSampleStats (an exact sampler's sampler.stats), but got "
                f"{type(stats).__name__}, which holds neither (a sketch's norms are estimates); "
                f"pass the norms you hold to observe(norms_sq, batch_grad_norm_sq)."
            )
        if self._observed == (id(stats), stats.generation):
            raise ValueError(
                "observe_stats: this backward was already folded into the estimate (no "
                "backward ran since the last observe_stats of these statistics), and folding "
                "it again would count its batch twice. Call it once after each backward."
            )

    def observe_stats(
        self, stats: PerSampleStats, grad_scale: float = 1.0
    ) -> NoiseScaleResult | None:
        """Fold in the batch that ``stats`` (a ``grabkit.stats.PerSampleStats``) just measured.

        Call after ``loss.backward()``. Blocks are the model's trainable parameters when this
        estimator was made with ``for_stats``, else one total block. Each backward is folded
        once: a second call before the next backward raises (it would count its batch twice).
        """
        self._check_observable(stats)
        step = stats.statistics()
        self._observed = (id(stats), stats.generation)
        batch = step.batch_size
        names = tuple(step.param_shapes)
        # ||mean gradient||^2 per parameter: one dot product each, no model-sized temporaries
        total_sq = step.total_norms_squared_by_parameter()
        mean_sq = torch.stack([total_sq[n].to(torch.float64) for n in names]) / batch**2
        if self.tracker.block_names == names:
            per_block = step.norms_squared_by_parameter()
            norms = torch.stack([per_block[n].to(torch.float64) for n in names], dim=1)
            return self.observe(norms, mean_sq, grad_scale)
        if len(self.tracker.block_names) != 1:
            raise ValueError(
                f"this estimator tracks blocks {self.tracker.block_names}, which are not the "
                f"model's parameters {names}; build it with PerExampleNoiseScale.for_stats(stats)"
            )
        return self.observe(stats.norms_squared(), mean_sq.sum(), grad_scale)
