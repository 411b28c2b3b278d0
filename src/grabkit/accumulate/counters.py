"""The accumulation wrapper's counters, declared once: docs, checkpoint layout and validation.

A :class:`AccumulationCounters` is plain data; :meth:`AccumulationCounters.state_dict` is the
``"counters"`` entry of the wrapper's checkpoint and :meth:`AccumulationCounters.from_state_dict`
refuses a layout with other fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["AccumulationCounters"]


@dataclass
class AccumulationCounters:
    """Where the wrapper stands in the run and in the current window.

    Attributes:
        num_batches: microbatches folded over the run (dropped ones not included).
        num_steps: inner optimizer steps.
        num_draws: microbatches folded into the current window.
        num_skipped: microbatches dropped: overflow under a GradScaler, or a non-finite gradient
            or metric without one.
        total_count: C, the current window's total count (float64, 0-dim), None when empty.
        last_step_num_draws: the last applied window's number of microbatches.
        last_step_count: the last applied window's total count.
        last_mean_norm_sq: |m|^2 of the last applied mean gradient (before any clipping).
        last_reason: why the last ``step`` call did or did not step.
    """

    num_batches: int = 0
    num_steps: int = 0
    num_draws: int = 0
    num_skipped: int = 0
    total_count: torch.Tensor | None = None
    last_step_num_draws: int | None = None
    last_step_count: torch.Tensor | None = None
    last_mean_norm_sq: torch.Tensor | None = None
    last_reason: str = "none"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def state_dict(self) -> dict[str, Any]:
        """The fields by name (tensors, ints, a string and None: ``weights_only`` loadable)."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> AccumulationCounters:
        """Counters from :meth:`state_dict`; a ValueError names missing or unknown fields."""
        expected = set(cls.names())
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"checkpoint counters have keys {got}, expected {sorted(expected)}; was it "
                "written by another version of grabkit?"
            )
        return cls(**state)
