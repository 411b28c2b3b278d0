"""``SketchHooks``: hook mode on (B, k) random sketches of the per-example gradients."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from grabkit.order.orderings import Ordering
from grabkit.order.sources.base import Gradients
from grabkit.order.sources.dense import param_dim
from grabkit.order.sources.hooks import HookGradients
from grabkit.order.topology import Setting
from grabkit.order.transforms import Chain, Project
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.stats.sketch import SketchedStats, check_saved_maps, kronecker_factors

__all__ = ["DEFAULT_SKETCH_DIM", "SketchHooks"]

#: the sketch width when none is chosen (32 x 32)
DEFAULT_SKETCH_DIM = 1024


class SketchHooks(HookGradients):
    """Hook mode on sketches: ``grabkit.stats.SketchedStats`` on ``model`` gives a (B, k) random
    sketch S g_i of every example's gradient from the same hooks (unbiased inner products, error
    about sqrt(2 / k) |g_i| |g_j|). Every ordering runs on it, on any number of ranks (each
    sketches its local batch and the ranks exchange (B, k) sketches); the maps are seeded by
    the sampler's seed, so every rank and a resumed run draw the same ones.

    Args:
        model: the ``nn.Module`` (a ``DistributedDataParallel`` wrapper is looked through).
        dim: k (a power of two or a square; default 1024).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss was reduced.
        params: the parameters whose gradients are sketched (default: the model's trainable
            ones); only their total size is used, recorded in the configuration.
        **stats_options: passed on to ``PerSampleStats`` (e.g. ``torch_func_fallback=True``).
    """

    sketched: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        dim: int = DEFAULT_SKETCH_DIM,
        loss_reduction: str = "mean",
        *,
        params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None,
        **stats_options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"`model` should be an nn.Module, but got {type(model).__name__}")
        kronecker_factors(dim)  # validates it
        super().__init__(None, dim)
        self.model, self.loss_reduction, self.stats_options = model, loss_reduction, stats_options
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        self.gradient_dim = param_dim(params)  # recorded: d, what the sketches shrink

    def __repr__(self) -> str:
        model = type(self.model).__name__
        return f"SketchHooks({model}, dim={self.dim}, loss_reduction={self.loss_reduction!r})"

    def bind(self, ordering: Ordering, transforms: Chain, setting: Setting) -> None:
        if transforms.has(Project):
            raise ValueError(
                'statistics="sketch" is already a random projection of the gradients; drop '
                "projection= (the sketch's width is sketch_dim)."
            )
        if self._stats is None:
            self._stats = SketchedStats(
                self.model, self.dim, setting.seed, loss_reduction=self.loss_reduction,
                **self.stats_options,
            )  # fmt: skip
        super().bind(ordering, transforms, setting)

    def batches(self, grads: Gradients | None) -> list[GradientBatch]:
        if grads is not None:
            raise ValueError(
                'this sampler balances sketches (statistics="sketch"), k numbers per example, '
                "so it cannot take per-example gradients in step(); call step() without "
                "arguments after the backward(s)."
            )
        return super().batches(None)

    def config(self) -> dict[str, Any]:
        """The gradient length, and the maps' description (``GradientSketch.config``: k, the
        maps' version and their fingerprint)."""
        return {"dim": self.gradient_dim, "statistics": "sketch", **self._stats.sketch.config}

    def check_saved_config(
        self, where: str, state: Mapping[str, Any], config: Mapping[str, Any]
    ) -> None:
        """A state balanced on sketches of other maps (another fingerprint, all else equal) is
        refused with the reason (``grabkit.stats.sketch.check_saved_maps``)."""
        check_saved_maps(where, state, config)

    def close(self) -> None:
        super().close()
        if self._stats is not None:
            self._stats.close()
