"""``DenseGradients``: per-example gradients passed to ``step(grads)`` (grab-sampler's way)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from grabkit.order.sources.base import Gradients, GradientSource, check_dim, dense_batch
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["DenseGradients", "param_dim"]


def param_dim(params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None) -> int | None:
    """d, the total size of ``params`` (a dict of tensors or an iterable of them); None if None."""
    if params is None:
        return None
    values = params.values() if isinstance(params, Mapping) else params
    try:
        return sum(int(p.numel()) for p in values)
    except (TypeError, AttributeError):
        raise TypeError(
            "`params` should be a dict of tensors (e.g. dict(model.named_parameters())) or an "
            f"iterable of tensors, but got {type(params).__name__}"
        ) from None


class DenseGradients(GradientSource):
    """The per-example gradients each ``step(grads)`` is given: the dict of (B, ...) tensors
    that ``torch.func.vmap(torch.func.grad(f))`` returns, a (B, d) tensor or a
    ``GradientBatch``.

    Args:
        params: the parameters the gradients are of (a dict or an iterable of tensors); only
            their total size d is used, to check every step's gradients. Optional.
    """

    def __init__(
        self, params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None
    ) -> None:
        self.dim = param_dim(params)

    def batches(self, grads: Gradients | None) -> list[GradientBatch]:
        if grads is None:
            raise ValueError(
                "step() without gradients needs hook statistics: construct the sampler with "
                "model=... (or stats=...), or pass the per-example gradients to step()."
            )
        return check_dim([dense_batch(grads)], self.dim)
