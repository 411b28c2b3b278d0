"""Stepping a GraB sampler after the backward of a loss that a framework's GradScaler scaled.

Under fp16 mixed precision, Hugging Face Trainer (through accelerate) and Lightning
(``precision="16-mixed"``) multiply the loss by a ``torch.amp.GradScaler``'s scale before the
backward, so the hook statistics a sampler balances are those of the scaled loss, and the scale
changes between steps (growth every ``growth_interval`` steps, back-off after an overflow):
without dividing it out, steps would weigh differently in the balancing and GraB would decide on
other gradients than the model's. An overflowing step has gradients that are not finite; the
scaler skips its update, and the sampler skips its examples (no decision this epoch).
"""

from __future__ import annotations

from typing import Any

from grabkit.order.balance import NON_FINITE_HELP

__all__ = ["step_sampler"]


def step_sampler(sampler: Any, scaler: Any = None) -> None:
    """``sampler.step()`` after a backward, with ``scaler``'s loss scale divided out.

    Args:
        sampler: a hook-mode ``GraBSampler`` (or ``GraBBatchSampler``).
        scaler: the ``torch.amp.GradScaler`` that scaled the loss, read before its
            ``update()``; None, or a disabled scaler, when the loss was not scaled.
    """
    if scaler is None or not scaler.is_enabled():
        sampler.step()
        return
    try:
        sampler.step(grad_scale=scaler.get_scale())
    except ValueError as error:
        if str(error) != NON_FINITE_HELP:
            raise
        sampler.skip()  # an overflow: the scaler skips this update, the sampler these examples
