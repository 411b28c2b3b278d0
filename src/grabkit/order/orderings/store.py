"""Keep every example's (dense) gradient of an epoch, for orderings that decide offline."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from grabkit.order.orderings.base import Ordering
from grabkit.order.orderings.centred import dense_rows
from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch

__all__ = [
    "MEMORY_WARNING_BYTES",
    "ExampleGradientStore",
    "StoredGradientOrdering",
    "warn_memory",
]

#: offline orderings warn when what they keep exceeds this many bytes
MEMORY_WARNING_BYTES = 1 << 30


def warn_memory(what: str, nbytes: int, advice: str) -> None:
    """Warn (ResourceWarning) that ``what`` needs ``nbytes`` when that is a lot."""
    if nbytes >= MEMORY_WARNING_BYTES:
        warnings.warn(
            f"{what} needs {nbytes / 2**30:.1f} GiB of memory. {advice}",
            ResourceWarning,
            stacklevel=4,
        )


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


class ExampleGradientStore(Stateful):
    """An (n, d) table of the latest gradient of each example (rows of unseen examples unused).

    Args:
        n: number of examples.
        name: the ordering, for messages.
    """

    table: torch.Tensor | None  # (n, d)
    seen: torch.Tensor  # (n,) bool

    def __init__(self, n: int, name: str) -> None:
        self.n, self.name = n, name
        self.add_state("table", None)
        self.add_state("seen", torch.zeros(n, dtype=torch.bool), save=_copy, load=_copy)

    def clear(self) -> None:
        self.seen.zero_()

    def add(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        rows = dense_rows(batch, self.name)
        if not torch.isfinite(rows).all():
            from grabkit.order.balance import NON_FINITE_HELP

            raise ValueError(NON_FINITE_HELP)
        if self.table is None:
            warn_memory(
                f'balance_type="{self.name}" keeps one gradient per example: an '
                f"({self.n}, {rows.shape[1]}) table that",
                self.n * rows.shape[1] * rows.element_size(),
                "Pass projection= with a small projection_dim to shrink it.",
            )
            self.table = rows.new_zeros(self.n, rows.shape[1])
        self.table[indices.to(self.table.device)] = rows.to(self.table.dtype)
        self.seen[indices] = True

    def observed(self, order: torch.Tensor) -> torch.Tensor:
        """The examples of ``order`` with a stored gradient, in that order."""
        return order[self.seen[order]]


class StoredGradientOrdering(Ordering):
    """An ordering that keeps every observed gradient of the epoch and ranks them at its end.

    Subclasses implement ``rank``; examples not observed this epoch follow at the end in their
    previous order. The store (n x d) is warned about when large.
    """

    needs_coordinates = True
    store: ExampleGradientStore

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.add_state("store", ExampleGradientStore(n, self.name))

    def rank(self, rows: torch.Tensor) -> torch.Tensor:
        """(m,) positions into ``rows`` (m, d) (float, on the CPU): the observed examples' order."""
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        self.store.clear()

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        self.store.add(batch, indices)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        observed = self.store.observed(order)
        if observed.numel() == 0:
            return order.clone()
        rows = self.store.table[observed.to(self.store.table.device)].cpu()
        return torch.cat([observed[self.rank(rows)], order[~self.store.seen[order]]])
