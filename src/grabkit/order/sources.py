"""Where the per-example statistics of a step come from, and the normalised (or unscaled) view of
a batch.

``GraBSampler.step(grads)`` turns what it is given into a list of ``GradientBatch`` pieces, in
visit order, with ``batches_from``: one dense piece for gradients passed in, or, in hook mode,
one piece per ``loss.backward()`` since the last ``step()`` (``HookSource``). A statistics
object plugs in by offering ``gradient_batch()`` (and, to keep every micro-batch of an
accumulated step, ``step_listeners``, ``backward_seen`` and ``statistics()``, as
``grabkit.stats.PerSampleStats`` and ``grabkit.stats.SketchedStats`` do); another kind of source
by offering ``batches()``, ``clear()``, ``discard()`` and ``close()``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from grabkit.order.balance import NON_FINITE_HELP
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch, named_to_flat

__all__ = [
    "HookSource",
    "NormalizedBatch",
    "RowScaledBatch",
    "check_finite",
    "dense_batch",
    "loss_scale",
    "normalized",
    "step_pieces",
    "unscaled",
]


class HookSource:
    """The statistics of every backward since the last ``step()``, from a statistics object.

    With ``grabkit.stats.PerSampleStats`` (it has ``step_listeners``) each backward's statistics
    are kept when the next forward would drop them, so a step after several backwards (gradient
    accumulation) balances every micro-batch, in order; the kept statistics hold that
    micro-batch's layer inputs and output gradients until ``step()``. Other objects with
    ``gradient_batch()`` give one piece per step, read at ``step()``.
    """

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.pending: list[GradientBatch] = []
        # the engine's statistics object last kept (or consumed), weakly: holding it would keep
        # a consumed step's activations alive through the next forward and backward
        self._taken: Callable[[], Any] = lambda: None
        self.tracks_backwards = hasattr(stats, "step_listeners") and hasattr(stats, "statistics")
        if self.tracks_backwards:
            stats.step_listeners.append(self.capture)

    def capture(self) -> None:
        """Keep the statistics of the backward that just ran, once.

        A step whose backward reached no parameter (an input gradient by
        ``torch.autograd.grad``: FGSM's clean forward, a saliency map) is not a micro-batch of
        the batch: nothing is kept, so the real backward's statistics go to the batch's own
        examples.
        """
        if not self.stats.backward_seen:
            return
        if not getattr(self.stats, "parameter_gradients_seen", True):
            return
        current = self.stats.statistics()
        if current is not self._taken():
            self._taken = weakref.ref(current)
            self.pending.append(self.stats.gradient_batch())

    def batches(self) -> list[GradientBatch]:
        """The pieces of this step, in visit order (not consumed until ``clear()``)."""
        if not self.tracks_backwards:
            return [self.stats.gradient_batch()]
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
        if self.tracks_backwards:
            self.capture()
        count = sum(int(b.size) for b in self.pending)
        self.pending = []
        return count

    def close(self) -> None:
        if self.tracks_backwards and self.capture in self.stats.step_listeners:
            self.stats.step_listeners.remove(self.capture)
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
        if dim is not None and piece.dim != dim and grads is None and sketch_dim is None:
            raise ValueError(
                f"the model's trainable parameters changed since this sampler was built: its "
                f"ordering state balances {dim} numbers per example, and the hooks now give "
                f"{piece.dim} (parameters frozen or unfrozen). Build a new sampler for the new "
                f"trainable set, or use statistics='sketch', whose width does not change."
            )
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
    raise TypeError(
        "step() expects a dict of (B, ...) per-example gradients, a (B, d) tensor, a "
        f"GradientBatch, or nothing in hook mode, but got {type(grads).__name__}"
    )


def normalized(batch: GradientBatch) -> GradientBatch:
    """g_i / ||g_i|| for every example (zero rows stay zero)."""
    if isinstance(batch, DenseGradientBatch):
        norms = torch.linalg.vector_norm(batch.matrix, dim=1, keepdim=True)
        return DenseGradientBatch(batch.matrix / torch.where(norms > 0, norms, 1.0))
    return NormalizedBatch(batch)


def loss_scale(grad_scale: Any) -> float:
    """The factor a loss was multiplied by before its backward: a positive finite number, or
    an object with ``get_scale()`` (a ``torch.amp.GradScaler``)."""
    value = grad_scale.get_scale() if hasattr(grad_scale, "get_scale") else grad_scale
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"grad_scale should be the positive finite factor the loss was multiplied by "
            f"(a GradScaler's get_scale(), or the GradScaler itself), but got {value!r}"
        )
    return float(value)


def unscaled(batch: GradientBatch, factor: float) -> GradientBatch:
    """``batch``'s gradients divided by ``factor`` (those of a loss multiplied by it)."""
    if factor == 1.0:
        return batch
    if isinstance(batch, DenseGradientBatch):
        return DenseGradientBatch(batch.matrix / factor)
    return RowScaledBatch(batch, torch.full((batch.size,), 1.0 / factor, device=batch.device))


class RowScaledBatch:
    """A ``GradientBatch`` of s_i g_i, for a (B,) tensor ``scale`` of the s_i, lazily."""

    def __init__(self, batch: GradientBatch, scale: torch.Tensor) -> None:
        self.inner = batch
        self.size, self.dim = batch.size, batch.dim
        self.dtype, self.device = batch.dtype, batch.device
        self.scale = scale

    def gram(self) -> torch.Tensor:
        return self.inner.gram() * self.scale[:, None] * self.scale[None, :]

    def norms_squared(self) -> torch.Tensor:
        return self.inner.norms_squared() * self.scale**2

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        d = self.inner.dot(vectors)
        return d * (self.scale if d.ndim == 1 else self.scale[:, None])

    def total(self) -> torch.Tensor:
        return self.inner.weighted_sum(self.scale[:, None]).reshape(-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        s = self.scale if weights.ndim == 1 else self.scale[:, None]
        return self.inner.weighted_sum(weights * s.to(weights.dtype))


class NormalizedBatch(RowScaledBatch):
    """A ``GradientBatch`` of g_i / ||g_i|| (zero rows stay zero), built lazily on the device."""

    def __init__(self, batch: GradientBatch) -> None:
        norms = batch.norms_squared().sqrt()
        super().__init__(batch, torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms)))
