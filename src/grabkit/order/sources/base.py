"""``GradientSource``: where a step's per-example gradients come from.

``GraBSampler.step(grads)`` asks its source for the step's ``GradientBatch`` pieces, in visit
order: one dense piece for gradients passed in (``DenseGradients``), or, in hook mode, one piece
per ``loss.backward()`` since the last ``step()`` (``ExactHooks``, ``SketchHooks``,
``HookGradients`` for a statistics object of your own). A source checks its own settings when
built and, once, how they combine with the sampler's ordering, transforms and rank layout
(``bind``); then it attaches whatever hooks it needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeAlias, runtime_checkable

import torch

from grabkit.order.orderings import Ordering
from grabkit.order.topology import Setting
from grabkit.order.transforms import Chain
from grabkit.stats.gradient_batch import (
    DenseGradientBatch,
    GradientBatch,
    as_gradient_batch,
    named_to_flat,
)
from grabkit.stats.source import StatisticsSource
from grabkit.validation import check_positive

__all__ = [
    "GradientSource",
    "Gradients",
    "LossScaler",
    "StatisticsReader",
    "check_dim",
    "dense_batch",
    "first_difference",
    "loss_scale",
]

#: what ``step(grads)`` accepts: a dict of (B, ...) per-example gradients (what
#: ``torch.func.vmap(torch.func.grad(f))`` returns), a (B, d) tensor, or a ``GradientBatch``
Gradients: TypeAlias = Mapping[str, torch.Tensor] | torch.Tensor | GradientBatch


@runtime_checkable
class GradientBatchReader(Protocol):
    """A statistics object of your own: one ``GradientBatch`` per step, read at ``step()``."""

    def gradient_batch(self) -> GradientBatch: ...


#: what hook mode reads: a ``StatisticsSource`` (every backward kept) or a simple reader
StatisticsReader: TypeAlias = StatisticsSource | GradientBatchReader


@runtime_checkable
class LossScaler(Protocol):
    """What ``step(grad_scale=...)`` reads of a ``torch.amp.GradScaler``: its current scale."""

    def get_scale(self) -> float: ...


def loss_scale(grad_scale: float | LossScaler) -> float:
    """The factor a loss was multiplied by before its backward: ``grad_scale`` itself, a
    positive finite number, or the scale of a ``torch.amp.GradScaler`` (``get_scale()``)."""
    get_scale = getattr(grad_scale, "get_scale", None)
    value = get_scale() if callable(get_scale) else grad_scale
    return check_positive(
        "grad_scale",
        value,
        " (the factor the loss was multiplied by: a GradScaler's get_scale(), or the GradScaler "
        "itself)",
    )


class GradientSource(ABC):
    """Where a step's per-example gradients come from; see the module docstring.

    Attributes:
        dim: numbers per example when known (every piece is checked against it), else None.
        sketched: True when the pieces are random sketches of the gradients (their
            coordinates are not the gradient's).
        reads_hooks: True when the pieces come from hooks on this process's model (a sampler
            with such a source cannot be pickled to another process).
    """

    dim: int | None = None
    sketched: ClassVar[bool] = False
    reads_hooks: ClassVar[bool] = False

    def bind(self, ordering: Ordering, transforms: Chain, setting: Setting) -> None:  # noqa: B027
        """Check how this source combines with the sampler's other parts; attach hooks. Called
        once, by the sampler, before anything is yielded."""

    @abstractmethod
    def batches(self, grads: Gradients | None) -> list[GradientBatch]:
        """The step's pieces in visit order, each ``dim`` numbers long (when known)."""

    def check_scale(self, factor: float) -> None:  # noqa: B027 (one factor fits by default)
        """Refuse a loss scale ``factor`` that cannot be that of every piece of the step (called
        after ``batches``, before anything is balanced)."""

    def check_scaler(self, scaler: LossScaler) -> None:  # noqa: B027 (nothing known by default)
        """Refuse a ``torch.amp.GradScaler`` whose scale may no longer be the loss's (read after
        its ``update()``), where the source can tell (called after ``batches`` and ``check_scale``,
        before anything is balanced)."""

    def clear(self) -> None:  # noqa: B027 (nothing kept by default)
        """Forget what was kept for the step (it was balanced)."""

    def discard(self) -> int:
        """Drop what was kept for a skipped step; return how many examples that was."""
        return 0

    def unstepped(self) -> int:
        """How many examples the backwards kept since the last ``step()`` cover (hook mode: a
        window of microbatches stepped at its end); 0 where nothing is kept."""
        return 0

    def after_load(self) -> None:
        """A sampler state was loaded: drop what this process kept from before it (the
        statistics of earlier backwards, the last one included)."""
        self.discard()

    def close(self) -> None:  # noqa: B027 (nothing attached by default)
        """Remove any hooks this source attached."""

    @property
    def statistics(self) -> StatisticsReader | None:
        """The statistics object hook mode reads (None without hooks)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"

    def config(self) -> dict[str, Any]:
        """What this source records in the sampler's configuration (plain data): ``dim``, the
        gradient length, and whatever else changes the orders."""
        return {"dim": self.dim}

    def check_saved_config(
        self, where: str, state: Mapping[str, Any], config: Mapping[str, Any]
    ) -> None:
        """Refuse a saved sampler ``state`` this source cannot continue, with a reason more
        precise than the configuration's difference (called by ``load_state_dict`` before the
        sampler's own check; ``config`` is the sampler's). By default: a state whose running
        sums lie over other parameters (``layout``, where both record one: another model of
        the same width, or the same parameters registered in another order), naming the first
        difference; a state saved without a layout is left to the configuration check."""
        saved, ours = state.get("config", {}).get("layout"), config.get("layout")
        if saved is None or ours is None or saved == ours:
            return
        at, was, here = first_difference(saved, ours)
        raise ValueError(
            f"{where}.load_state_dict: the state was saved over other parameters: its ordering "
            f"state sums the gradients of {len(saved)} parameters laid out differently from "
            f"this sampler's {len(ours)} (at parameter {at}: saved {was}, here {here}), so its "
            "sums would be read against the wrong parameters. Load "
            "it into a sampler over the model it was saved with: the same trainable parameters, "
            "registered in the same order (wrappers that only rename them, such as DDP, "
            "torch.compile or checkpoint wrappers, are looked through)."
        )


def dense_batch(grads: Gradients) -> GradientBatch:
    """The per-example gradients given to ``step()`` as one ``GradientBatch``."""
    if isinstance(grads, Mapping):
        if not grads:
            raise ValueError("step() got an empty dict of per-example gradients")
        return dense_batch(named_to_flat({k: v.detach() for k, v in grads.items()}, 1))
    if isinstance(grads, torch.Tensor):
        if grads.is_complex():
            raise TypeError(
                f"step() got complex per-example gradients ({grads.dtype}); GraB balances real "
                "vectors: pass torch.view_as_real(grads) to balance both parts."
            )
        if grads.ndim < 2:
            raise ValueError(
                "step() expects per-example gradients with a leading batch dimension, (B, d) "
                f"or (B, ...), but got a tensor of shape {tuple(grads.shape)}"
            )
        return DenseGradientBatch(grads.detach().flatten(1))
    try:
        return as_gradient_batch(grads)
    except TypeError:
        raise TypeError(
            "step() expects a dict of (B, ...) per-example gradients, a (B, d) tensor, a "
            f"GradientBatch, or nothing in hook mode, but got {type(grads).__name__}"
        ) from None


def check_dim(
    pieces: list[GradientBatch], dim: int | None, *, first_step: bool = False
) -> list[GradientBatch]:
    """``pieces``, after checking that each is ``dim`` numbers long (when ``dim`` is known:
    the params' size, or with ``first_step`` the width of the sampler's first step)."""
    for piece in pieces:
        if dim is not None and piece.dim != dim:
            given = (
                f"the first step's had {dim}" if first_step
                else f"the params given to the sampler have {dim} numbers in total"
            )  # fmt: skip
            raise ValueError(
                f"step() got gradients of length {piece.dim} per example, but {given}; pass "
                "the per-example gradients of exactly the same parameters at every step."
            )
    return pieces


def first_difference(a: Sequence[Sequence], b: Sequence[Sequence]) -> tuple[int, str, str]:
    """Where two parameter layouts (``[name, shape]`` entries in flat order) first differ, and
    the entry of each there as ``'name' (sizes)`` (``nothing`` past a layout's end)."""
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    at = next(differ, min(len(a), len(b)))
    return at, _entry(a, at), _entry(b, at)


def _entry(layout: Sequence[Sequence], at: int) -> str:
    if at >= len(layout):
        return "nothing"
    name, shape = layout[at]
    return f"{name!r} {tuple(shape)}"
