"""``recursive``: recursive balance, a tree of herding problems that refines the order."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import FixedGram
from grabkit.order.orderings.base import (
    IndexTensor,
    Ordering,
    balance_combinations,
    int_list,
    register_ordering,
)
from grabkit.order.orderings.centred import StaleMean
from grabkit.order.orderings.store import warn_memory
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.validation import check_int_in_range

__all__ = ["RecursiveBalance"]


@register_ordering
class RecursiveBalance(Ordering):
    """Each example walks a binary tree of depth ``depth``: at every node it is balanced against
    that node's running sum and goes left on +1, right on -1. A leaf keeps its +1 examples in visit
    order and its -1 examples in reverse; the next order reads the leaves left to right. Depth 0
    is ``mean``. Vectors are centred by the previous epoch's mean. The tree holds
    2^(depth+1) - 1 running sums of size d (grab-sampler's default depth 5: 63 of them).
    """

    name = "recursive"
    splittable = True
    acc: torch.Tensor | None  # (num_nodes, d)
    mean: StaleMean
    leaf_front: dict[int, list[int]]  # leaf -> its +1 examples, in visit order
    leaf_back: dict[int, list[int]]  # leaf -> its -1 examples, in visit order

    def __init__(self, n: int, *, depth: int = 5, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.depth = depth = check_int_in_range("depth", depth, 0, 16)
        self.num_nodes = 2 ** (depth + 1) - 1
        self.first_leaf = 2**depth - 1
        self._tensors: dict[tuple[str, int], IndexTensor] = {}
        self.add_state("acc", None)
        self.add_state("mean", StaleMean())
        self.add_state("leaf_front", {}, save=self._saved_front, load=_leaves)
        self.add_state("leaf_back", {}, save=self._saved_back, load=_leaves)
        self._centre_gram = FixedGram()  # <m, m> once per epoch, not per batch (not state)

    def start_epoch(self, epoch: int) -> None:
        self.mean.roll()
        self.leaf_front, self.leaf_back = {}, {}
        self._tensors = {}
        if self.acc is not None:
            self.acc.zero_()

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        if self.acc is None:
            warn_memory(
                f'balance_type="recursive" with depth={self.depth} keeps {self.num_nodes} running '
                f"sums of {batch.dim} numbers: that",
                self.num_nodes * batch.dim * batch.dtype.itemsize,
                "Lower depth=, or pass projection= to shrink the gradients first.",
            )
            self.acc = torch.zeros(
                self.num_nodes, batch.dim, dtype=batch.dtype, device=batch.device
            )
        m = self.mean.value
        signs, leaves = balance_combinations(
            batch,
            self.acc,
            self.rule,
            fixed=None if m is None else m.reshape(1, -1),
            fixed_weights=None if m is None else np.ones((batch.size, 1)),
            fixed_gram=self._centre_gram,
            depth=self.depth,
            on_accept=lambda total: self.mean.add(
                batch.total() if total is None else total, batch.size
            ),
            policy=self.policy,
        )
        decided = zip(indices.tolist(), leaves.tolist(), signs[:, -1].tolist(), strict=True)
        for index, leaf, eps in decided:
            side = self.leaf_front if eps > 0 else self.leaf_back
            side.setdefault(leaf, []).append(index)

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        halves: list[list[int]] = [[], []]
        for leaf in range(self.first_leaf, self.num_nodes):
            half = halves[0 if leaf - self.first_leaf < 2 ** max(self.depth - 1, 0) else 1]
            half.extend(self.leaf_front.get(leaf, []))
            half.extend(self.leaf_back.get(leaf, [])[::-1])
        if self.depth == 0:  # a single leaf: front part, then the back part
            front = self.leaf_front.get(0, [])
            halves = [front, self.leaf_back.get(0, [])[::-1]]
        placed = set(halves[0]) | set(halves[1])
        middle = [i for i in order.tolist() if i not in placed]
        return torch.tensor(halves[0] + middle + halves[1], dtype=torch.int64)

    def _saved_front(self, leaf_front: dict[int, list[int]]) -> dict[str, torch.Tensor]:
        return self._saved_leaves("front")

    def _saved_back(self, leaf_back: dict[int, list[int]]) -> dict[str, torch.Tensor]:
        return self._saved_leaves("back")

    def _saved_leaves(self, side: str) -> dict[str, torch.Tensor]:
        """Every leaf either side has reached, as "leaf" -> its list on ``side`` as a tensor
        (extended incrementally: the state is published after every step)."""
        leaves = sorted(set(self.leaf_front) | set(self.leaf_back))
        lists = self.leaf_front if side == "front" else self.leaf_back
        tensors = self._tensors
        return {
            str(k): tensors.setdefault((side, k), IndexTensor()).view(lists.setdefault(k, []))
            for k in leaves
        }

    def after_load(self) -> None:
        self._tensors = {}


def _leaves(saved: dict[str, Any]) -> dict[int, list[int]]:
    return {int(k): int_list(v) for k, v in saved.items()}
