"""Groupers: rules that partition one batch into groups, given every item's lengths.

A grouper sees ``lengths`` (a dict: data length label -> int64 CPU tensor of shape ``(n,)``) and
returns a :class:`~grabkit.group.planning.GroupPlan`. Grouping never changes results, only cost.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .planning import CostLike, GroupPlan, plan_from_partition, plan_groups

__all__ = [
    "DynamicGrouper",
    "Grouper",
    "LengthThresholdGrouper",
    "PredefinedConsecutiveGrouper",
    "PredefinedGrouper",
    "UniGrouper",
]


def _stack_lengths(lengths: Mapping[str, Tensor], n: int, first: str | None = None) -> Tensor:
    labels = list(lengths)
    if first is not None:
        labels.remove(first)
        labels.insert(0, first)
    if not labels:
        return torch.zeros((n, 1), dtype=torch.long)
    return torch.stack([lengths[label] for label in labels], dim=1)


def _threshold(value: object) -> int:
    """A length threshold as an int: ``L <= 2.5`` is ``L <= 2`` for integer lengths."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, Tensor)):
        raise TypeError(f"thresholds should hold numbers, but got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"thresholds should be finite lengths, but got {value!r}")
    return math.floor(value)


class Grouper:
    """Base class: override :meth:`plan`."""

    def plan(self, lengths: Mapping[str, Tensor], size: int) -> GroupPlan:
        raise NotImplementedError

    def _need_label(self, lengths: Mapping[str, Tensor], label: str) -> Tensor:
        if label not in lengths:
            raise ValueError(
                f"{type(self).__name__} groups on length label {label!r}, but the data's length "
                f"labels are {sorted(lengths)}; use one of those (the part after 'L_')"
            )
        return lengths[label]


class UniGrouper(Grouper):
    """One group holding the whole batch (the usual padded minibatch)."""

    def plan(self, lengths, size):
        return plan_from_partition([torch.arange(size)], _stack_lengths(lengths, size))


class PredefinedGrouper(Grouper):
    """A fixed partition: ``partition[g]`` lists the item indices of group ``g``."""

    def __init__(self, partition: Sequence[Sequence[int]]) -> None:
        self.partition = [list(map(int, part)) for part in partition]
        self.length = sum(len(part) for part in self.partition)

    def plan(self, lengths, size):
        if size != self.length:
            raise ValueError(
                f"{type(self).__name__} was built for {self.length} items, but the batch has {size}"
            )
        return plan_from_partition(self.partition, _stack_lengths(lengths, size))


class PredefinedConsecutiveGrouper(PredefinedGrouper):
    """Consecutive runs: ``nums=[2, 3]`` groups items ``[0, 1]`` and ``[2, 3, 4]``."""

    def __init__(self, nums: Sequence[int]) -> None:
        if any(int(k) < 0 for k in nums):
            raise ValueError(f"nums should be non-negative group sizes, but got {list(nums)}")
        bounds = torch.cumsum(torch.tensor([0, *nums], dtype=torch.long), 0).tolist()
        super().__init__([list(range(a, b)) for a, b in itertools.pairwise(bounds)])


class LengthThresholdGrouper(Grouper):
    """Bins by the length along ``label``: ``thresholds`` are inclusive upper bounds.

    With thresholds ``[t1, ..., tk]`` the bins are ``L <= t1``, ``t1 < L <= t2``, ..., ``L > tk``
    (the convention :func:`find_thresholds` returns); empty bins are dropped.
    """

    def __init__(self, ldim_label: str, thresholds: Sequence[int]) -> None:
        values = sorted(_threshold(t) for t in thresholds)
        if not values:
            raise ValueError("thresholds should hold at least one length, but got []")
        if len(set(values)) != len(values):
            raise ValueError(f"thresholds should be distinct, but got {list(thresholds)}")
        self.ldim_label = ldim_label
        self.thresholds = values

    def plan(self, lengths, size):
        key = self._need_label(lengths, self.ldim_label)
        bins = torch.bucketize(key, torch.tensor(self.thresholds, dtype=key.dtype))
        order = torch.sort(bins, stable=True).indices
        counts = torch.bincount(bins, minlength=len(self.thresholds) + 1).tolist()
        partition = [part for part in torch.split(order, counts) if len(part)]
        matrix = _stack_lengths(lengths, size, self.ldim_label)
        return plan_from_partition(partition, matrix)


class DynamicGrouper(Grouper):
    """Per-batch optimal groups on ``label`` (:func:`~grabkit.group.planning.plan_groups`).

    ``cost``, ``alpha``, ``overhead`` and ``max_group_cost`` are passed through. (Shape
    bucketing for ``torch.compile`` is an option of the tensor API: ``plan_groups``,
    ``GroupingCollate``, ``run_grouped``.)
    """

    def __init__(
        self,
        ldim_label: str,
        cost: CostLike | Callable[[int], float] = "linear",
        alpha: float | None = None,
        overhead: float = 0.02,
        max_group_cost: float | None = None,
    ) -> None:
        self.ldim_label = ldim_label
        self.options = dict(
            cost=cost, alpha=alpha, overhead=overhead, max_group_cost=max_group_cost
        )
        plan_groups([1], **self.options)  # bad options fail here, not at the first batch

    def plan(self, lengths, size):
        self._need_label(lengths, self.ldim_label)
        return plan_groups(_stack_lengths(lengths, size, self.ldim_label), **self.options)
