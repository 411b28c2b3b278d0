"""``DenseGradients``: per-example gradients passed to ``step(grads)`` (grab-sampler's way)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from grabkit.order.sources.base import Gradients, GradientSource, check_dim, dense_batch
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.stats.names import canonical_name_of

#: name -> per-example shape of a dict of per-example gradients, in the order it is flattened
Layout = dict[str, tuple[int, ...]]

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

    Every step's gradients must have the width of the first (of ``params``, when given): a
    step of another width would balance other coordinates against the running sums (a (B, 1)
    tensor even broadcasts). A dict is flattened in one layout for the whole run, the names and
    order of ``params`` when it is a dict, else those of the first dict: a dict whose keys come
    in another order is put in that order (the vectors of two steps would otherwise be
    permuted against each other), and one of other names or shapes raises.

    Args:
        params: the parameters the gradients are of (a dict or an iterable of tensors): their
            total size d checks every step's gradients, and a dict's names and shapes every
            dict of per-example gradients. Optional.
    """

    def __init__(
        self, params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None
    ) -> None:
        if isinstance(params, Iterable) and not isinstance(params, (Mapping, torch.Tensor)):
            params = list(params)  # an iterator (model.parameters()) is read once
        self.dim = param_dim(params)
        self.layout: Layout | None = None
        if isinstance(params, Mapping):
            self.layout = {name: tuple(p.shape) for name, p in params.items()}
        self._params_layout = self.layout is not None
        self._given = self.dim  # the configuration's d: the first step's width is not saved

    def batches(self, grads: Gradients | None) -> list[GradientBatch]:
        if grads is None:
            raise ValueError(
                "step() without gradients needs hook statistics: construct the sampler with "
                "model=... (or stats=...), or pass the per-example gradients to step()."
            )
        if isinstance(grads, Mapping):
            grads = self.in_layout(grads)
        pieces = check_dim([dense_batch(grads)], self.dim, first_step=self._given is None)
        if self.dim is None:
            self.dim = pieces[0].dim
        return pieces

    def config(self) -> dict[str, Any]:
        """``dim``, and where ``params`` was a dict its ``layout`` (names read canonically,
        ``grabkit.stats.names.canonical_name_of``, and shapes, in order), so that a state saved
        over other parameters of the same width is refused."""
        if not self._params_layout:
            return {"dim": self._given}
        layout = [[canonical_name_of(n), list(shape)] for n, shape in self.layout.items()]
        return {"dim": self._given, "layout": layout}

    def after_load(self) -> None:
        """The width (and a dict's layout) of this process's earlier steps need not be the
        loaded run's, so the next step fixes them again (unless ``params`` did)."""
        if self._given is None:
            self.dim = None
        if not self._params_layout:
            self.layout = None

    def in_layout(
        self, named: Mapping[str, torch.Tensor], where: str = "step()", batch_dims: int = 1
    ) -> dict[str, torch.Tensor]:
        """``named`` (tensors with ``batch_dims`` leading dims before each parameter's shape) in
        the run's layout; the first dict fixes it when ``params`` was not a dict."""
        if not named:
            raise ValueError(f"{where} got an empty dict of tensors")
        layout = {name: tuple(g.shape[batch_dims:]) for name, g in named.items()}
        if self.layout is None:
            self.layout = layout
            return dict(named)
        missing, extra = (
            sorted(set(self.layout) - set(layout)),
            sorted(set(layout) - set(self.layout)),
        )
        if missing or extra:
            raise ValueError(
                f"{where} got tensors of other parameter names than the "
                f"{'params' if self._given is not None else 'first step'} (missing {missing}, "
                f"unexpected {extra}); pass those of the same parameters every time, as "
                "torch.func.vmap(torch.func.grad(f))(params, ...) returns them."
            )
        for name, shape in self.layout.items():
            if layout[name] != shape:
                lead = "B, " if batch_dims else ""
                raise ValueError(
                    f"{where} got {name!r} of shape ({lead}*{layout[name]}) but the parameter "
                    f"has shape {shape}; pass ({lead}*param.shape) for each parameter."
                )
        return {name: named[name] for name in self.layout}
