"""ALF-compatible ``GradientNoiseScaleEstimator``: two extra backward passes per update.

Drop-in for ``alf.utils.gradient_noise_scale.GradientNoiseScaleEstimator``: same constructor,
same ``estimator(loss, tensors)`` call and the same returned value, with two fixes:

* odd batch sizes work in "alternative" mode (the two halves may differ by one example; the
  effective size 2 b1 b2 / (b1 + b2) replaces b, which is exact for the identity below);
* the per-block |G|^2, tr(Sigma) and a confidence interval are available from ``result()``;
* a batch whose gradients are not finite (a NaN or inf loss) leaves the averages unchanged and
  returns the last valid estimate, as grabkit's other estimators do (in ALF one NaN poisons the
  averages for good).

Each call splits the batch at random into two disjoint parts and differentiates the mean loss of
each ("paper" mode: a small part of ``batch_size_ratio`` and the rest; "alternative": two halves):

* paper:        the two-batch identity on |G_small|^2 and |G_big|^2;
* alternative:  alpha = <G_1, G_2> (unbiased for |G|^2 since the parts are independent) and
  beta = (|G_1|^2 + |G_2|^2) / 2 (= |G|^2 + tr(Sigma) / b on average); GNS = (beta / alpha - 1) b.

As in ALF, each quantity is averaged with a bias-corrected EMA of rate ``update_rate``, a
negative estimate returns the last non-negative one, and ``gradient_norm_clip`` clips each part's
gradient before measuring it (which biases the estimate: leave it None for a faithful number).

Under torch.distributed nothing is combined across ranks, as in ALF: each rank splits and measures
its own batch and keeps its own averages, so each rank's estimate is B_simple estimated from that
rank's batches alone (the ranks' values differ). Its state is that rank's: save each rank's own;
another rank's state with averages in it is refused on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grabkit.noise.averaging import BiasCorrectedEMA
from grabkit.noise.estimator import NoiseEstimator
from grabkit.noise.identities import two_batch_estimates
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.tracker import NoiseScaleTracker
from grabkit.sharding import is_sharded, refuse_flat_parameters, world_size
from grabkit.state import Stateful
from grabkit.validation import check_positive

__all__ = ["GradientNoiseScaleEstimator"]

_MODES = ("paper", "alternative")
# ALF's guard against a zero denominator, kept so that returned values match ALF's
_DENOMINATOR_EPS = 1e-8


def _flatten_tensors(tensors: object, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) leaves of a tensor, a list/tuple/dict nest, or an iterable of tensors.

    Dict keys are visited in sorted order (ALF's nest order); list items by position.
    """
    if isinstance(tensors, torch.Tensor):
        return [(prefix or "0", tensors)]
    if isinstance(tensors, Mapping):
        items: Iterable = ((str(k), tensors[k]) for k in sorted(tensors))
    elif isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes)):
        items = ((str(i), t) for i, t in enumerate(tensors))
    else:
        raise TypeError(
            "tensors should be a tensor, a list/tuple/dict of tensors or an iterable of "
            f"parameters, but got {type(tensors).__name__}"
        )
    leaves = []
    for key, value in items:
        leaves.extend(_flatten_tensors(value, f"{prefix}.{key}" if prefix else key))
    return leaves


def _refuse_sharded(leaves: list[torch.Tensor]) -> None:
    """Sharded parameters are not what a sharded model's forward differentiates through."""
    refuse_flat_parameters(leaves, "GradientNoiseScaleEstimator")
    if any(is_sharded(t) for t in leaves):
        raise NotImplementedError(
            "GradientNoiseScaleEstimator differentiates the loss with respect to the given "
            "tensors, but these are fully_shard (DTensor) shards, which the forward does not "
            "use directly (it gathers unsharded copies); under fully_shard measure with "
            "AccumulationNoiseScale(model) (microbatches, or one step per rank) or "
            "PerExampleNoiseScale with PerSampleStats"
        )


class GradientNoiseScaleEstimator(nn.Module, NoiseEstimator):
    """Simple gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018).

    Args:
        batch_size_ratio: "paper" mode: the share of the batch used as the small batch, in
            (0, 0.5); the small batch has max(1, int(B * ratio)) examples and the big batch the
            rest. Ignored (0.5) in "alternative" mode.
        update_rate: EMA weight of the newest update (ALF's ``ScalarEMAverager`` meaning).
        gradient_norm_clip: if given, each part's gradient is clipped to this global norm before
            measuring (ALF's behaviour; it biases the estimate).
        mode: "paper" or "alternative".
        name: a label, as in ALF.

    Under several processes each rank measures its own batch and keeps its own averages (nothing
    is all-reduced, as in ALF): each rank's estimate is from its batches alone. ``state_dict()``
    records the saving rank, and a state with averages saved by another rank is refused, since
    this rank would continue that rank's averages as its own: save and load each rank's state
    (a checkpoint that only rank 0 writes holds rank 0's).
    """

    def __init__(
        self,
        batch_size_ratio: float = 0.1,
        update_rate: float = 0.001,
        gradient_norm_clip: float | None = None,
        mode: str = "alternative",
        name: str = "GNSEstimator",
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode should be one of {_MODES}, but got mode={mode!r}")
        if mode == "paper" and not 0.0 < batch_size_ratio < 0.5:
            raise ValueError(
                "batch_size_ratio should be in (0, 0.5) in paper mode, but got "
                f"batch_size_ratio={batch_size_ratio}"
            )
        if gradient_norm_clip is not None:
            gradient_norm_clip = check_positive("gradient_norm_clip", gradient_norm_clip)
        self._name = name
        self._mode = mode
        self._batch_size_ratio = batch_size_ratio if mode == "paper" else 0.5
        self._grad_norm_clip = gradient_norm_clip
        self._update_rate = update_rate
        self._averages = _Averages(mode, self._batch_size_ratio, update_rate, gradient_norm_clip)
        self.register_buffer("_last_valid_gns", torch.zeros(()))

    def _part_gradients(self, loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = torch.autograd.grad(loss.mean(), leaves, retain_graph=True, allow_unused=True)
        grads = [
            torch.zeros_like(t) if g is None else g.detach()
            for g, t in zip(grads, leaves, strict=True)
        ]
        if self._grad_norm_clip is not None:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            factor = self._grad_norm_clip / torch.clamp(norm, min=self._grad_norm_clip)
            grads = [g * factor for g in grads]
        return grads

    @staticmethod
    def _block_dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        dots = [torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b, strict=True)]
        return torch.stack(dots).double()

    def _split_sizes(self, batch: int) -> tuple[int, int]:
        if self._mode == "paper":
            small = max(1, int(batch * self._batch_size_ratio))
            if batch - small <= small:
                raise ValueError(
                    f"paper mode needs a big part larger than the small one, but a batch of "
                    f"{batch} with batch_size_ratio={self._batch_size_ratio} splits into "
                    f"{small} and {batch - small}; use a larger batch"
                )
            return small, batch - small
        if batch < 2:
            raise ValueError(f"the loss needs at least 2 examples, but has a batch of {batch}")
        return batch // 2, batch - batch // 2

    def forward(self, loss: torch.Tensor, tensors: object) -> torch.Tensor:
        """Update the averages with one split of this batch and return the estimated GNS.

        Args:
            loss: per-example losses *before* the mean, shape [B] or [T, B] (the last dimension
                indexes examples); its graph is kept (``retain_graph=True``).
            tensors: the tensors whose gradients count: a tensor, a list/tuple/dict nest of
                tensors, or ``model.parameters()``.
        Returns:
            0-d float32 tensor, detached: the GNS, or the last non-negative one if this one is
            negative or not finite (0 before any).
        """
        if not isinstance(loss, torch.Tensor) or loss.ndim not in (1, 2):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss should be a [B] or [T, B] tensor, but got {shape}")
        named = _flatten_tensors(tensors)
        if not named:
            raise ValueError("tensors should contain at least one tensor, but is empty")
        names = tuple(n for n, _ in named)
        leaves = [t for _, t in named]
        _refuse_sharded(leaves)
        small, big = self._split_sizes(loss.shape[-1])
        shuffled = loss[..., torch.randperm(loss.shape[-1], device=loss.device)]
        big_grads = self._part_gradients(shuffled[..., small:], leaves)
        small_grads = self._part_gradients(shuffled[..., :small], leaves)
        big_sq = self._block_dot(big_grads, big_grads)
        small_sq = self._block_dot(small_grads, small_grads)
        if self._mode == "paper":
            block_grad_norm, block_trace = two_batch_estimates(small_sq, small, big_sq, big)
            grad_norm, var_trace = block_grad_norm.sum(), block_trace.sum()
            size = 1.0
        else:
            size = 2.0 * small * big / (small + big)
            block_grad_norm = self._block_dot(big_grads, small_grads)
            block_trace = ((big_sq + small_sq) / 2.0 - block_grad_norm) * size
            grad_norm, var_trace = block_grad_norm.sum(), ((big_sq + small_sq) / 2.0).sum()
        finite = torch.isfinite(torch.cat([block_grad_norm, block_trace]))
        if not bool(finite.all()):  # a NaN / inf loss: skip the update, as the others do
            return self._last_valid_gns.clone()
        self._track(names, block_grad_norm, block_trace, small + big)
        avg_grad_norm = self._averages.gradient_norm.update(grad_norm)
        avg_var_trace = self._averages.var_trace.update(var_trace)
        gns = avg_var_trace / (avg_grad_norm + _DENOMINATOR_EPS)
        if self._mode == "alternative":
            gns = (gns - 1.0) * size
        gns = gns.to(self._last_valid_gns.dtype)
        if gns < 0:
            return self._last_valid_gns.clone()
        self._last_valid_gns = gns.detach().clone()
        return gns.detach()

    def _track(self, names, block_grad_norm, block_trace, examples: int) -> None:
        averages = self._averages
        if averages.tracker is None:
            averages.tracker = NoiseScaleTracker(self._update_rate, block_names=names)
        elif averages.tracker.block_names != names:
            raise ValueError(
                f"tensors changed between calls: first {averages.tracker.block_names}, now {names}"
            )
        averages.tracker.update(block_grad_norm, block_trace, examples)

    @property
    def _tracker(self) -> NoiseScaleTracker | None:
        """The per-block tracker behind ``result()`` (None before the first call)."""
        return self._averages.tracker

    def get_extra_state(self) -> dict[str, Any]:
        """The averages and the configuration, saved by ``state_dict()`` next to the
        ``_last_valid_gns`` buffer; a state of another configuration is refused on load."""
        return self._averages.state_dict()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._averages.load_state_dict(state)

    def observe(self, loss: torch.Tensor, tensors: object) -> NoiseScaleResult | None:
        """``self(loss, tensors)`` (ALF's call), then the estimate."""
        self(loss, tensors)
        return self.estimate

    @property
    def estimate(self) -> NoiseScaleResult | None:
        """``result()``, or None before the first finite update."""
        tracker = self._averages.tracker
        return None if tracker is None or not tracker.observations else tracker.result()

    def result(self) -> NoiseScaleResult:
        """Per-block |G|^2 and tr(Sigma), B_simple and its interval, from the same splits."""
        if self._averages.tracker is None:
            raise RuntimeError("no estimate yet: call the estimator on a loss first")
        return self._averages.tracker.result()


class _Averages(Stateful):
    """The estimator's saved state: its settings (under ``"config"``), the averages of |G|^2
    and tr(Sigma) behind the returned GNS, and the per-block tracker behind ``result()``."""

    config_key = "config"
    tracker: NoiseScaleTracker | None

    def __init__(
        self, mode: str, batch_size_ratio: float, update_rate: float, clip: float | None
    ) -> None:
        self.update_rate = update_rate
        self.add_config("mode", mode)
        self.add_config("batch_size_ratio", batch_size_ratio)
        self.add_config("update_rate", update_rate)
        self.add_config("gradient_norm_clip", clip)
        self.add_state("gradient_norm", BiasCorrectedEMA(update_rate))
        self.add_state("var_trace", BiasCorrectedEMA(update_rate))
        self.add_state("tracker", None, save=_tracker_state, load=self._tracker_from)
        # the rank that saved the averages (None in one process); states saved before lack it
        self.add_state("rank", None, attribute="_saved_rank", save=lambda _: _rank(), optional=True)

    @property
    def state_owner(self) -> str:
        return "GradientNoiseScaleEstimator"

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` once it was found to be this rank's (or one process's)."""
        if isinstance(state, Mapping):
            _check_own_rank(state)
        super().load_state_dict(state)

    def _tracker_from(self, saved: dict[str, Any] | None) -> NoiseScaleTracker | None:
        if saved is None:
            return None
        tracker = NoiseScaleTracker(self.update_rate, block_names=saved["block_names"])
        tracker.load_state_dict(saved)
        return tracker


def _tracker_state(tracker: NoiseScaleTracker | None) -> dict[str, Any] | None:
    return None if tracker is None else tracker.state_dict()


def _rank() -> int | None:
    """This process's rank in the default group, None in one process."""
    return dist.get_rank() if world_size() > 1 else None


def _check_own_rank(state: Mapping[str, Any]) -> None:
    """Refuse averages that another rank saved: they are of that rank's batches, and this rank
    would continue them as its own (every rank loading the checkpoint that rank 0 writes)."""
    saved, rank = state.get("rank"), _rank()
    averages = state.get("gradient_norm")
    if saved is None or rank is None or saved == rank:
        return
    if not (isinstance(averages, Mapping) and averages.get("mean") is not None):
        return  # nothing measured yet: the same on every rank
    raise ValueError(
        f"GradientNoiseScaleEstimator.load_state_dict: this state was saved by rank {saved}, "
        f"whose averages are of rank {saved}'s own batches (each rank's estimator measures its "
        f"own batches and keeps its own averages); rank {rank} would continue them as its own "
        "and its estimate would silently differ from the uninterrupted run's. Save and load "
        "each rank's own state (e.g. torch.save(estimator.state_dict(), f'gns-rank{rank}.pt')); "
        "a checkpoint that only rank 0 writes (accelerate's save_state of a registered object, "
        "Lightning's checkpoint, a model state_dict with the estimator inside) holds rank 0's: "
        "keep the estimator out of it, or build this rank's estimator afresh."
    )
