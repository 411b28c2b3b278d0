"""The shared shape of the flat balancers: z_i = T(x_i) - m, balanced against one running sum.

Subclasses choose the centre m (a stale mean, an EMA, nothing) and, when they need coordinates,
a per-coordinate transform T (signs, Adam-style scaling). The running sum restarts every epoch;
the next order is the GraB front/back placement of this epoch's signs.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from grabkit.order.balance import FixedGram
from grabkit.order.orderings.base import FrontBackOrder, Ordering, balance_combinations
from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["CentredBalance", "StaleMean", "StaleMeanBalance", "dense_rows"]


def _own_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


class StaleMean(Stateful):
    """The mean of the per-example gradients observed in the previous epoch (zero at first).

    ``add`` takes a batch sum and a count; ``roll`` makes this epoch's mean the stale one. An
    epoch that observed nothing keeps the previous mean. The running sum is its own tensor,
    updated in place (no new tensor the size of the model per batch); a loaded one is copied.
    """

    value: torch.Tensor | None  # (d,)
    running_sum: torch.Tensor | None  # (d,)
    count: int

    def __init__(self) -> None:
        self.add_state("value", None)
        self.add_state("running_sum", None, load=_own_copy)
        self.add_state("count", 0, load=int)

    def current(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like) if self.value is None else self.value

    def add(self, total: torch.Tensor, count: int) -> None:
        if self.running_sum is None:
            self.running_sum = total.clone()
        else:
            self.running_sum.add_(total)
        self.count += count

    def add_batch(self, batch: GradientBatch, count: int) -> None:
        """``add(batch.total(), count)``, adding the batch's sum straight into the running sum
        (``add_total_to``: hook statistics form no (d,) temporary)."""
        if self.running_sum is None:
            self.add(batch.total(), count)
            return
        batch.add_total_to(self.running_sum)
        self.count += count

    def roll(self) -> None:
        if self.count:
            self.value = self.running_sum / self.count
        self.running_sum, self.count = None, 0


class _CentreRow:
    """``m.reshape(1, -1)``, the same view object while the centre m is the same tensor.

    Hook statistics cut a fixed vector into per-parameter views, kept while that vector object
    lives (``FlatLayout.views``): a new (1, d) view per batch would be cut anew every batch. The
    view is kept only from the second batch with the same centre (a stale mean), so a centre
    made anew for every batch (an EMA) is never held here, and ``clear()`` lets go of it before
    the centre is replaced (a new epoch, a load).
    """

    def __init__(self) -> None:
        self._seen: weakref.ref[torch.Tensor] | None = None  # the last centre, weakly
        self._row: torch.Tensor | None = None  # its (1, d) view, once seen twice

    def __call__(self, m: torch.Tensor) -> torch.Tensor:
        row = self._row
        if row is not None and row._base is m and row.shape == (1, m.numel()):
            return row
        self._row = None
        seen = None if self._seen is None else self._seen()
        self._seen = weakref.ref(m)
        row = m.reshape(1, -1)
        if seen is m and row._base is m:  # a view (not a copy) of the same centre again
            self._row = row
        return row

    def clear(self) -> None:
        self._seen = self._row = None

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle starts empty
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.clear()


class CentredBalance(Ordering):
    """Balance T(x_i) - m against one running sum; subclasses set the centre and transform.

    ``sequential = False`` decides every sign of a batch against the running sum at the batch's
    start (the "batch" ordering); otherwise decisions are exactly the sequential rule.
    """

    sequential = True
    acc: torch.Tensor | None  # (1, d): the running signed sum
    placement: FrontBackOrder

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.add_state("acc", None)
        self.add_state("placement", FrontBackOrder())
        self._centre_gram = FixedGram()  # <m, m> once per centre, not per batch (not state)
        self._centre_row = _CentreRow()  # its (1, d) view, the same while m is (not state)

    # -- hooks for subclasses -------------------------------------------------------------
    def transform(self, batch: GradientBatch) -> GradientBatch:
        """T applied to every example (identity unless coordinates are needed)."""
        return batch

    def centre(self, batch: GradientBatch) -> torch.Tensor | None:
        """The centre m (d,) for this batch, or None; must not change any state."""
        return None

    def record(self, total: torch.Tensor, count: int) -> None:
        """Update running statistics with a batch known to be finite: ``total`` (d,) is the sum
        of its ``count`` raw gradients."""

    def record_batch(self, batch: GradientBatch, count: int) -> None:
        """``record`` for a batch balanced without a transform on the one-transfer path (hook
        statistics): subclasses may take the sum from ``batch`` without forming it."""
        self.record(batch.total(), count)

    # -- Ordering --------------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        self.placement.clear()
        self._centre_row.clear()  # before a subclass rolls its centre: the old one is freed
        if self.acc is not None:
            self.acc.zero_()

    def after_load(self) -> None:
        super().after_load()
        self._centre_row.clear()

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        vectors = self.transform(batch)
        if self.acc is None:
            self.acc = torch.zeros(1, vectors.dim, dtype=vectors.dtype, device=vectors.device)
        m = self.centre(batch)
        fixed = None if m is None else self._centre_row(m)
        fixed_weights = None if m is None else np.ones((batch.size, 1))
        signs, _ = balance_combinations(
            vectors,
            self.acc,
            self.rule,
            fixed=fixed,
            fixed_weights=fixed_weights,
            fixed_gram=self._centre_gram,
            sequential=self.sequential,
            on_accept=lambda total: self._accept(batch, total if vectors is batch else None),
            policy=self.policy,
        )
        self.placement.place(indices.tolist(), signs[:, 0])

    def _accept(self, batch: GradientBatch, total: torch.Tensor | None) -> None:
        """Record a batch found finite: from the sum of its rows when balancing formed it, else
        from the batch (which may add its sum without forming it: hook statistics)."""
        if total is None:
            self.record_batch(batch, batch.size)
        else:
            self.record(total, batch.size)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return self.placement.build(order)


def dense_rows(batch: GradientBatch, name: str) -> torch.Tensor:
    """The (B, d) matrix behind a dense batch; a clear error for hook-statistics batches."""
    X = batch.coordinates()
    if X is not None:
        return X
    raise TypeError(
        f'balance_type="{name}" transforms gradient coordinates, so it needs dense per-example '
        f"gradients, but step() got a {type(batch).__name__} (inner products only). Pass the "
        "(B, d) tensor or the dict of per-example gradients to step(), or choose an ordering that "
        'works on hook statistics ("mean", "pair", "recursive", "batch", "ema", ...).'
    )


class StaleMeanBalance(CentredBalance):
    """A ``CentredBalance`` that keeps the previous epoch's mean gradient in ``self.mean``.

    Each epoch's batch totals (``record``) become the next epoch's stale mean; the mean goes into
    the checkpoint. Subclasses decide how the mean enters (``centre`` or ``transform``) and
    declare their own state with ``add_state``.
    """

    mean: StaleMean

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.add_state("mean", StaleMean())

    def start_epoch(self, epoch: int) -> None:
        super().start_epoch(epoch)
        self.mean.roll()

    def record(self, total: torch.Tensor, count: int) -> None:
        self.mean.add(total, count)

    def record_batch(self, batch: GradientBatch, count: int) -> None:
        self.mean.add_batch(batch, count)
