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
framework's scaler) has it divided out of each backward's norms, read before the scaler's next
``update()`` (the norms of a whole accumulation window share one scale).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from grabkit.stats import PerSampleStats, StatisticsSource
from grabkit.stats.source import check_shared

__all__ = ["DEFAULT_QUANTILES", "ExampleGradientNorms"]

DEFAULT_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


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
        self.grad_scaler: torch.amp.GradScaler | None = None  # fp16: its scale divided out
        self._kept: list[torch.Tensor] = []
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

    def capture(self) -> None:
        """Keep the norms of the backward that just ran (once; the next forward calls it).
        A sketch's |S g_i|^2 estimates |g_i|^2 (unbiased)."""
        batch = self.subscription.take()
        if batch is None:
            return
        squares = batch.norms_squared()
        norms = squares.detach().clamp(min=0).sqrt().cpu()
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            norms = norms / float(scaler.get_scale())  # the scale of this backward's loss
        self._kept.append(norms * self.scale)

    def take(self) -> torch.Tensor:
        """The (m,) norms kept since the last ``take()``, in backward order; forgets them."""
        self.capture()
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
        if self._owns:
            self.stats.close()
