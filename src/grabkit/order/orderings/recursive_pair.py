"""``recursive-pair``: pair balance applied recursively inside each batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import HostProducts, apply_update, fetch_inner_products
from grabkit.order.orderings.base import Ordering, int_list, register_ordering
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["RecursivePairBalance"]


@register_ordering
class RecursivePairBalance(Ordering):
    """Within a batch, consecutive pairs are balanced against the root's running sum; the +1
    member of each pair joins the left group, the other the right group (an odd one out joins the
    left group unbalanced), and each group is pair-balanced again against its own node's sum,
    down to single examples. That gives each batch an order of "slots" from most to least
    positive. The next epoch reads slot 0 of every batch in batch order, slot 1 in reverse batch
    order, and so on, so each new batch gathers examples of one slot.

    Decisions within a node are sequential (each pair sees the sum updated by the pairs before),
    all from one host transfer per batch. Node sums live for the epoch; there is one per internal
    node of the largest batch's tree (about the batch size of them, each of size d).
    """

    name = "recursive-pair"
    acc: torch.Tensor | None  # (num_nodes, d)
    batch_orders: list[list[int]]  # per batch, its examples from most to least positive slot

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self._converted: list[torch.Tensor] = []
        self.add_state("acc", None)
        self.add_state("batch_orders", [], save=self._batch_tensors, load=_batch_orders)

    def start_epoch(self, epoch: int) -> None:
        self.batch_orders = []
        self._converted = []
        if self.acc is not None:
            self.acc.zero_()

    def _node_sums(self, batch: GradientBatch) -> torch.Tensor:
        """The node sums, grown with zeros to cover this batch's tree (not stored yet)."""
        levels = max(1, (batch.size - 1).bit_length())
        needed = 2**levels - 1
        if self.acc is None:
            return torch.zeros(needed, batch.dim, dtype=batch.dtype, device=batch.device)
        if self.acc.shape[0] < needed:
            grow = self.acc.new_zeros(needed - self.acc.shape[0], self.acc.shape[1])
            return torch.cat([self.acc, grow])
        return self.acc

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        acc = self._node_sums(batch)
        products = fetch_inner_products(batch, acc, need_gram=True)
        self.acc = acc
        coef = np.zeros((acc.shape[0], batch.size))
        rows = self._solve(list(range(batch.size)), 0, products, coef)
        apply_update(acc, batch, coef.T)
        index_list = indices.tolist()
        self.batch_orders.append([index_list[r] for r in rows])

    def _solve(
        self, group: list[int], node: int, products: HostProducts, coef: np.ndarray
    ) -> list[int]:
        """Order the batch rows ``group`` below ``node``; record signs in ``coef`` (node, row)."""
        if len(group) < 2:
            return group
        K, xs = products.gram, products.xv
        firsts, seconds, signs = [], [], []
        left: list[int] = []
        right: list[int] = []
        for t in range(len(group) // 2):
            a, b = group[2 * t], group[2 * t + 1]
            v = xs[a, node] - xs[b, node]
            if signs:
                pa, pb, e = np.array(firsts), np.array(seconds), np.array(signs)
                v += e @ (K[pa, a] - K[pa, b] - K[pb, a] + K[pb, b])
            u = self.rule.uniforms(1)
            eps = self.rule.decide(float(v), None if u is None else float(u[0]))
            firsts.append(a)
            seconds.append(b)
            signs.append(eps)
            coef[node, a] += eps
            coef[node, b] -= eps
            left.append(a if eps > 0 else b)
            right.append(b if eps > 0 else a)
        if len(group) % 2:
            left.append(group[-1])
        return self._solve(left, 2 * node + 1, products, coef) + self._solve(
            right, 2 * node + 2, products, coef
        )

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        slots = max((len(b) for b in self.batch_orders), default=0)
        read: list[int] = []
        for slot in range(slots):
            batches = self.batch_orders if slot % 2 == 0 else self.batch_orders[::-1]
            read.extend(b[slot] for b in batches if len(b) > slot)
        placed = set(read)
        middle = [i for i in order.tolist() if i not in placed]
        half = len(read) // 2
        return torch.tensor(read[:half] + middle + read[half:], dtype=torch.int64)

    def _batch_tensors(self, batch_orders: list[list[int]]) -> list[torch.Tensor]:
        """The batch orders as tensors, converting only the batches added since the last call
        (the state is published after every step)."""
        if len(self._converted) > len(batch_orders):
            self._converted = []
        for b in batch_orders[len(self._converted) :]:
            self._converted.append(torch.tensor(b, dtype=torch.int64))
        return list(self._converted)

    def after_load(self) -> None:
        self._converted = []


def _batch_orders(saved: list[torch.Tensor]) -> list[list[int]]:
    return [int_list(b) for b in saved]
