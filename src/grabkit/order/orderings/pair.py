"""``pair``: balance differences of consecutive examples, so no stale mean is needed."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import NON_FINITE_HELP, fetch_inner_products
from grabkit.order.orderings.base import (
    FrontBackOrder,
    Ordering,
    balance_combinations,
    balance_dense_vectors,
    register_ordering,
)
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["PairBalance"]


@register_ordering
class PairBalance(Ordering):
    """Pair balance (Lu et al., 2022; Cooper et al., 2023): visit examples two at a time and
    balance z = g_first - g_second. On +1 the first goes to the front and the second to the back,
    on -1 the other way round. The difference cancels the mean, so none is estimated.

    A batch of odd size leaves one example waiting; it is paired with the first example of the
    next batch (its gradient is kept as one (d,) vector, read through ``weighted_sum``, so this
    works on hook statistics too). With an odd number of examples in an epoch the last one stays
    unpaired and goes between the front and the back part.
    """

    name = "pair"
    splittable = True
    acc: torch.Tensor | None  # (1, d)
    pending: torch.Tensor | None  # (d,) gradient of the example waiting
    pending_index: int
    placement: FrontBackOrder

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.add_state("acc", None)
        self.add_state("pending", None)
        self.add_state("pending_index", -1, load=int)
        self.add_state("placement", FrontBackOrder())

    def start_epoch(self, epoch: int) -> None:
        self.placement.clear()
        self.pending, self.pending_index = None, -1
        if self.acc is not None:
            self.acc.zero_()

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        if self.acc is None:
            self.acc = torch.zeros(1, batch.dim, dtype=batch.dtype, device=batch.device)
        items = ([self.pending_index] if self.pending is not None else []) + indices.tolist()
        k = len(items) // 2
        leftover = len(items) % 2 == 1
        if k == 0:
            fetch_inner_products(batch, None, need_gram=False)  # still reject NaN / Inf now
        elif self._differences_pay(batch):
            self._place(items, self._balance_differences(batch, k, leftover))
        else:
            self._place(items, self._balance_combinations(batch, k))
        self._keep_leftover(batch, items[-1] if leftover else None)

    def _balance_combinations(self, batch: GradientBatch, k: int) -> np.ndarray:
        """Signs of the k pairs as combinations W x - U v (v: the carried example)."""
        carried = self.pending is not None
        rows = list(range(-1 if carried else 0, batch.size))  # -1: the carried vector
        W = np.zeros((k, batch.size))
        U = np.zeros((k, 1))
        for j in range(k):
            first, second = rows[2 * j], rows[2 * j + 1]
            if first == -1:
                U[j, 0] = -1.0  # z = -U v: +pending
            else:
                W[j, first] = 1.0
            W[j, second] = -1.0
        signs, _ = balance_combinations(
            batch,
            self.acc,
            self.rule,
            weights=W,
            fixed=self.pending.reshape(1, -1) if carried else None,
            fixed_weights=U if carried else None,
            policy=self.policy,
        )
        return signs

    def _place(self, items: list[int], signs: np.ndarray) -> None:
        for j, eps in enumerate(signs[:, 0].tolist()):
            first, second = items[2 * j], items[2 * j + 1]
            plus, minus = (first, second) if eps > 0 else (second, first)
            self.placement.front.append(plus)
            self.placement.back.append(minus)

    def _keep_leftover(self, batch: GradientBatch, index: int | None) -> None:
        """Keep the batch's last example waiting for a partner (``index`` None: none waits)."""
        if index is None:
            self.pending, self.pending_index = None, -1
            return
        self.pending = batch.row(-1).to(self.acc.dtype)
        self.pending_index = index

    def _differences_pay(self, batch: GradientBatch) -> bool:
        """Whether to balance the differences of a dense CPU batch, formed one cache-sized block
        at a time: when a block holds several of them, the Gram arithmetic is that of k vectors,
        not 2k rows. Longer gradients take one pair per block as a combination of two rows (no
        Gram, no temporary): fewer passes over memory than forming the difference."""
        return (
            batch.coordinates() is not None
            and batch.device.type == "cpu"
            and self.policy.rows > 0
            and self.policy.block_rows(batch.dim * self.acc.element_size()) >= 4
        )

    def _balance_differences(self, batch: GradientBatch, k: int, leftover: bool) -> np.ndarray:
        """Signs of z_j = (first of pair j) - (second of pair j) for the k pairs of a dense CPU
        batch (pair 0 starts with the carried example when one waits)."""
        X = batch.coordinates()
        if leftover and not bool(torch.isfinite(X[-1]).all()):
            raise ValueError(NON_FINITE_HELP)  # the example left waiting is checked now too
        shift = 1 if self.pending is not None else 0  # z_j = X[2j - shift] - X[2j + 1 - shift]
        scratch = torch.empty(
            self.policy.vector_rows(k, X.shape[1], self.acc.element_size()),
            X.shape[1],
            dtype=self.acc.dtype,
        )

        def differences(lo: int, hi: int) -> torch.Tensor:
            out = scratch[: hi - lo]
            if lo == 0 and shift:
                torch.sub(self.pending, X[0], out=out[0])
                lo = 1
            a = 2 * lo - shift
            b = 2 * hi - shift
            torch.sub(X[a:b:2], X[a + 1 : b + 1 : 2], out=out[out.shape[0] - (hi - lo) :])
            return out

        signs = balance_dense_vectors(
            differences, k, self.acc, self.rule, self.policy, read=batch.to_host
        )
        return signs[:, None]

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return self.placement.build(order)
