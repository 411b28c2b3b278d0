"""Where the per-example statistics of a step come from, and the normalised view of a batch.

``GraBSampler.step(grads)`` turns what it is given into a list of ``GradientBatch`` pieces, in
visit order, with ``batches_from``: one dense piece for gradients passed in, or, in hook mode,
one piece per ``loss.backward()`` since the last ``step()`` (``HookSource``). A statistics
object plugs in by implementing ``grabkit.stats.StatisticsSource`` (subscribe, take, close), as
``grabkit.stats.PerSampleStats`` and ``grabkit.stats.SketchedStats`` do, or by offering
``gradient_batch()`` alone (read once per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grabkit.order.balance import NON_FINITE_HELP
from grabkit.stats.gradient_batch import (
    DenseGradientBatch,
    GradientBatch,
    as_gradient_batch,
    named_to_flat,
)
from grabkit.stats.source import StatisticsSource, Subscription

__all__ = [
    "HookSource",
    "check_finite",
    "dense_batch",
    "step_pieces",
]


class HookSource:
    """The statistics of every backward since the last ``step()``, from a statistics object.

    With a ``grabkit.stats.StatisticsSource`` (``PerSampleStats``, ``SketchedStats``) each
    backward's statistics are kept when the next forward would drop them, so a step after
    several backwards (gradient accumulation) balances every micro-batch, in order; the kept
    statistics hold that micro-batch's layer inputs and output gradients until ``step()``. Any
    other object with ``gradient_batch()`` gives one piece per step, read at ``step()``.
    """

    def __init__(self, stats: StatisticsSource | Any) -> None:
        self.stats = stats
        self.pending: list[GradientBatch] = []
        self.subscription: Subscription | None = None
        if isinstance(stats, StatisticsSource):
            self.subscription = stats.subscribe(self.capture)

    def capture(self) -> None:
        """Keep the statistics of the backward that just ran, once."""
        batch = self.subscription.take()
        if batch is not None:
            self.pending.append(batch)

    def batches(self) -> list[GradientBatch]:
        """The pieces of this step, in visit order (not consumed until ``clear()``)."""
        if self.subscription is None:
            return [as_gradient_batch(self.stats.gradient_batch())]
        self.capture()
        if not self.pending:
            raise ValueError(
                "step() found no loss.backward() since the last step(): hook mode balances the "
                "examples of the backwards run since then, and stepping twice would balance "
                "one batch twice. Call step() once per optimiser step, after the backward(s)."
            )
        return list(self.pending)

    def clear(self) -> None:
        self.pending = []

    def discard(self) -> int:
        """Drop what was kept (and the current backward); return how many examples that was."""
        if self.subscription is not None:
            self.capture()
        count = sum(int(b.size) for b in self.pending)
        self.pending = []
        return count

    def close(self) -> None:
        if self.subscription is not None:
            self.subscription.close()
        self.pending = []


def step_pieces(
    grads: Any, source: HookSource | None, dim: int | None, sketch_dim: int | None = None
) -> list[GradientBatch]:
    """A step's gradients as ``GradientBatch`` pieces in visit order (hook mode: one per
    backward since the last step), each checked to be ``dim`` numbers long (when known), or
    ``sketch_dim`` long when the hooks sketch (then ``grads`` must be None)."""
    if grads is not None and sketch_dim is not None:
        raise ValueError(
            'this sampler balances sketches (statistics="sketch"), k numbers per example, so '
            "it cannot take per-example gradients in step(); call step() without arguments "
            "after the backward(s)."
        )
    if grads is None and sketch_dim is not None:
        dim = sketch_dim
    if grads is not None:
        pieces = [dense_batch(grads)]
    elif source is None:
        raise ValueError(
            "step() without gradients needs hook statistics: construct the sampler with "
            "model=... (or stats=...), or pass the per-example gradients to step()."
        )
    else:
        pieces = source.batches()
    for piece in pieces:
        if dim is not None and piece.dim != dim:
            raise ValueError(
                f"step() got gradients of length {piece.dim} per example, but the params "
                f"given to the sampler have {dim} numbers in total; pass the per-example "
                "gradients of exactly those parameters."
            )
    return pieces


def check_finite(pieces: list[GradientBatch]) -> None:
    """Reject NaN / Inf in any of several micro-batches before the first changes any state (one
    piece is checked by the balancing itself, at no extra cost)."""
    if len(pieces) > 1:
        for piece in pieces:
            if not bool(torch.isfinite(piece.norms_squared()).all()):  # host sync
                raise ValueError(NON_FINITE_HELP)


def dense_batch(grads: Any) -> GradientBatch:
    """The per-example gradients given to ``step()`` as one ``GradientBatch``."""
    if isinstance(grads, Mapping):
        if not grads:
            raise ValueError("step() got an empty dict of per-example gradients")
        return DenseGradientBatch(named_to_flat({k: v.detach() for k, v in grads.items()}, 1))
    if isinstance(grads, torch.Tensor):
        if grads.ndim < 2:
            raise ValueError(
                "step() expects per-example gradients with a leading batch dimension, (B, d) "
                f"or (B, ...), but got a tensor of shape {tuple(grads.shape)}"
            )
        return DenseGradientBatch(grads.detach().flatten(1))
    if isinstance(grads, GradientBatch):
        return grads
    try:
        return as_gradient_batch(grads)
    except TypeError:
        raise TypeError(
            "step() expects a dict of (B, ...) per-example gradients, a (B, d) tensor, a "
            f"GradientBatch, or nothing in hook mode, but got {type(grads).__name__}"
        ) from None
