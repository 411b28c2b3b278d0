"""Per-example gradient norms of every backward, summarised for a training log.

For users who want to look at their gradients: :class:`ExampleGradientNorms` reads |g_i|, the
norm of each example's gradient, after every ``loss.backward()`` from the hook statistics of
``grabkit.stats.PerSampleStats`` (exact, no per-example gradient is formed), keeps them until the
next log, and :meth:`ExampleGradientNorms.summary` reduces them to a few numbers (quantiles, mean,
count) that any logger takes. The Hugging Face and Lightning callbacks log that summary.

What a norm is: the gradient of example i's own term of the loss as backpropagated, times
``scale``; with ``loss_reduction="mean"`` (the loss is a mean over the microbatch) the
microbatch's mean is undone, so |g_i| does not shrink with the microbatch size. Lightning divides
every loss by ``accumulate_grad_batches`` and its callback undoes that (``scale``): a norm is the
gradient of the example's own loss. transformers' Trainer divides by the accumulation steps, or
by the window's label tokens when the model takes ``num_items_in_batch`` (whether a model honours
it is not visible from outside): its callback logs the norms as backpropagated, every norm of a
run scaled alike. On a model that already carries hook statistics (a hook-mode ``GraBSampler``'s
``sampler.stats``), pass them as ``stats``: one set of hooks serves both, read in the statistics'
own loss reduction, and over the model's trainable parameters only where the statistics hook
them all (statistics of a submodule, or a ``loss_reduction`` other than theirs, are refused:
``grabkit.stats.source.check_shared``). A sketching sampler's
``SketchedStats`` give the norms of the (B, k) sketches, unbiased estimates of |g_i|^2 with a
relative error of about sqrt(2 / k) (0.044 at k = 1024), not exact norms.

Under fp16 mixed precision each loss is multiplied by a ``GradScaler``'s scale before its
backward, and the scale changes during training; ``grad_scaler`` (set by the callbacks to the
framework's scaler) has it divided out of each backward's norms: the scale noted when the
model's forward began (a forward pre-hook, no host read), the one the step's loss is scaled by,
so norms kept lazily (at the next forward, or at ``take()`` when logging) after the scaler's
``update()`` are still divided by their own backward's scale.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from grabkit.stats import PerSampleStats, StatisticsSource
from grabkit.stats.source import check_shared

__all__ = ["DEFAULT_QUANTILES", "ExampleGradientNorms"]

DEFAULT_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


_OWNER_CLOSED = (
    "ExampleGradientNorms: the statistics it reads (stats=, shared) were closed by their owner "
    "(sampler.close(), or the end of its with block): backwards since are not measured, and "
    "their norms are not among those returned. Build the norms over statistics that stay open, "
    "or ExampleGradientNorms(model) (its own hooks) once the owner is closed."
)


def _scale_noter(norms: weakref.ref[ExampleGradientNorms]) -> Callable[..., None]:
    """A forward pre-hook noting the loss scale for ``norms`` (held weakly), run outside
    Dynamo's trace where the model is compiled (torch's lazy ``torch.compiler.disable``)."""

    def note(module: nn.Module, args: object) -> None:
        owner = norms()
        if owner is not None:
            owner._note_scale()

    return getattr(torch, "_disable_dynamo", torch.compiler.disable)(note)


def _quantile_name(q: float) -> str:
    return {0.0: "min", 0.5: "median", 1.0: "max"}.get(q, f"q{round(100 * q):02d}")


class ExampleGradientNorms:
    """Collect |g_i| of every backward (see the module doc).

    Args:
        model: the module whose parameters' per-example gradients are measured.
        stats: the hook statistics already on ``model`` (``sampler.stats`` of a hook-mode
            ``GraBSampler``: exact, or sketched); None: a ``PerSampleStats`` is attached
            (``close()`` removes it).
        loss_reduction: ``"mean"`` or ``"sum"``, how each microbatch's loss reduces its examples;
            None: that of ``stats``, or ``"mean"`` when none are given.
        quantiles: the quantiles :meth:`summary` reports, in [0, 1].
    """

    def __init__(
        self,
        model: nn.Module,
        stats: StatisticsSource | None = None,
        loss_reduction: str | None = None,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
    ) -> None:
        self.quantiles = self.check_quantiles(quantiles)
        if stats is not None and not isinstance(stats, StatisticsSource):
            raise TypeError(
                "ExampleGradientNorms reads per-example norms from a statistics source "
                f"(PerSampleStats, SketchedStats), but got {type(stats).__name__}"
            )
        self._owns = stats is None
        if stats is None:
            stats = PerSampleStats(model, "mean" if loss_reduction is None else loss_reduction)
        else:
            check_shared(stats, model, loss_reduction, "ExampleGradientNorms")
        self.stats = stats
        self.scale = 1.0  # undoes a framework's factor on every loss (Lightning's 1 / accumulation)
        self._grad_scaler: torch.amp.GradScaler | None = None
        self._scale_hook: RemovableHandle | None = None
        #: the GradScaler's scale when the model's latest forward began (None: not noted)
        self._scale_at_forward: torch.Tensor | float | None = None
        self._kept: list[torch.Tensor] = []
        self._closed_said = False  # the owner's close() of shared statistics, warned
        self.subscription = self.stats.subscribe(self.capture)

    @staticmethod
    def check_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
        """The quantiles as floats; raise unless they are numbers in [0, 1]."""
        try:
            values = tuple(float(q) for q in quantiles)
        except (TypeError, ValueError):
            values = ()
        if not values or any(not 0.0 <= q <= 1.0 for q in values):
            raise ValueError(f"quantiles should be numbers in [0, 1], but got {quantiles!r}")
        return values

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16: the ``GradScaler`` whose scale multiplies every loss, divided out of the norms
        (None: no scaler)."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        if scaler is self._grad_scaler:
            return
        self._grad_scaler, self._scale_at_forward = scaler, None
        if self._scale_hook is not None:
            self._scale_hook.remove()
            self._scale_hook = None
        model = self.stats.model
        if scaler is not None and model is not None:
            # after the statistics' own pre-hook, which keeps the previous backward first
            self._scale_hook = model.register_forward_pre_hook(_scale_noter(weakref.ref(self)))
            weakref.finalize(self, self._scale_hook.remove)  # dropped unclosed: the hook goes

    def _note_scale(self) -> None:
        """At a forward with gradients: note the scale the step's loss will be multiplied by
        (a copy of the scaler's scale tensor, read on the host only when a norm is kept)."""
        scaler = self._grad_scaler
        if scaler is None or not torch.is_grad_enabled():
            return
        current = getattr(scaler, "_scale", None)
        self._scale_at_forward = (
            current.detach().clone()
            if isinstance(current, torch.Tensor)
            else float(scaler.get_scale())  # before its first scale(): the initial scale
        )

    def _loss_scale(self) -> float:
        """The scale of the backward being kept: noted at its forward, else the current one."""
        noted = self._scale_at_forward
        if noted is None:
            return float(self._grad_scaler.get_scale())
        return float(noted)

    def capture(self) -> None:
        """Keep the norms of the backward that just ran (once; the next forward calls it).
        A sketch's |S g_i|^2 estimates |g_i|^2 (unbiased)."""
        batch = self.subscription.take()
        if batch is None:
            return
        squares = batch.norms_squared()
        norms = squares.detach().clamp(min=0).sqrt().cpu()
        scaler = self._grad_scaler
        if scaler is not None and scaler.is_enabled():
            norms = norms / self._loss_scale()  # the scale of this backward's loss
        self._kept.append(norms * self.scale)

    def take(self) -> torch.Tensor:
        """The (m,) norms kept since the last ``take()``, in backward order; forgets them.
        Shared statistics their owner closed (``sampler.close()``) measure nothing more: said
        once, with a ``RuntimeWarning``, instead of returning fewer norms without a word."""
        self.capture()
        if not self._owns and not self._closed_said and self.stats.closed:
            self._closed_said = True
            warnings.warn(_OWNER_CLOSED, RuntimeWarning, stacklevel=2)
        kept, self._kept = self._kept, []
        return torch.cat(kept) if kept else torch.zeros(0)

    def summary(self, prefix: str = "grad_norm_per_example/") -> dict[str, float]:
        """Quantiles, mean and count of the norms since the last summary (empty when none)."""
        return self.summarize(self.take(), prefix)

    def summarize(
        self, norms: torch.Tensor, prefix: str = "grad_norm_per_example/"
    ) -> dict[str, float]:
        """Quantiles, mean and count of ``norms`` ((m,) values; empty: {})."""
        norms = norms.double()
        if norms.numel() == 0:
            return {}
        values = torch.quantile(norms, torch.tensor(self.quantiles, dtype=torch.float64))
        names = [f"{prefix}{_quantile_name(q)}" for q in self.quantiles]
        out = {name: float(v) for name, v in zip(names, values, strict=True)}
        out[f"{prefix}mean"] = float(norms.mean())
        out[f"{prefix}count"] = float(norms.numel())
        return out

    def close(self) -> None:
        """Stop collecting; remove the hooks this object attached."""
        self.subscription.close()
        self.grad_scaler = None  # its forward pre-hook removed
        if self._owns:
            self.stats.close()
