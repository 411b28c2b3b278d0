"""Choosing groups for one batch: the plan type, length checks and an exact dynamic program.

A group of ``n_g`` items padded to length ``L_g`` costs ``alpha + n_g * cost(L_g)``: ``alpha`` is
the fixed price of one more module call (kernel launches, Python), ``cost(L)`` the price of one
item at padded length ``L``. With ``cost`` non-decreasing, some optimal partition is contiguous
in length order (swapping a long item of a short group with a short item of a long group never
raises either maximum), so a dynamic program over the sorted lengths is exact.

Dataset-level thresholds live in ``thresholds``, timing a module into a cost model in
``calibration``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "GroupPlan",
    "as_length_matrix",
    "check_number",
    "plan_cost",
    "plan_from_partition",
    "plan_groups",
    "resolve_cost",
    "unit_costs",
]

CostLike = Callable[[int], float] | str


def resolve_cost(cost: CostLike) -> Callable[[np.ndarray], np.ndarray]:
    """A vectorised ``cost(L)``: ``"linear"`` (L), ``"quadratic"`` (L**2) or a callable."""
    if cost == "linear":
        return lambda x: np.asarray(x, dtype=np.float64)
    if cost == "quadratic":
        return lambda x: np.asarray(x, dtype=np.float64) ** 2
    if isinstance(cost, str) or not callable(cost):
        raise ValueError(f"cost should be 'linear', 'quadratic' or a callable, but got {cost!r}")

    def vectorised(x: np.ndarray) -> np.ndarray:
        return np.array([float(cost(int(v))) for v in np.asarray(x).ravel()], dtype=np.float64)

    return vectorised


@dataclass
class GroupPlan:
    """Which items form each group and the padded shape each group runs at.

    ``groups[g]``: int64 item indices (into the batch); ``lengths[g]``: padded size per length
    dim; ``rows[g]``: rows computed (the group size, or more when sizes are bucketed).
    """

    groups: list[Tensor]
    lengths: list[list[int]]
    rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = [len(g) for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def size(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def order(self) -> Tensor:
        """Item indices group after group: row ``r`` of the concatenation is item ``order[r]``."""
        return torch.cat(self.groups) if self.groups else torch.zeros(0, dtype=torch.long)

    @property
    def inverse_order(self) -> Tensor:
        """Row of the concatenated groups that holds item ``i``."""
        order = self.order
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return inverse

    @property
    def slices(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each group in the concatenated (``order``-sorted) batch."""
        bounds = np.cumsum([0] + [len(g) for g in self.groups]).tolist()
        return list(itertools.pairwise(bounds))

    def padded_elements(self) -> int:
        """Item slots computed: sum over groups of rows times the product of padded lengths."""
        return int(
            sum(r * int(np.prod(lens)) for r, lens in zip(self.rows, self.lengths, strict=False))
        )

    def partition(self) -> list[list[int]]:
        return [g.tolist() for g in self.groups]

    def check_covers(self, n: int, source: str = "the plan") -> None:
        """Raise unless the groups hold every item index ``0..n-1`` exactly once."""
        order = self.order
        if len(order) != n or not torch.equal(order.sort().values, torch.arange(n)):
            raise ValueError(
                f"{source} covers {len(order)} items but the batch has {n}; it should hold "
                "every item index once: build it from these lengths (plan_groups / "
                "plan_from_partition)"
            )


def as_length_matrix(lengths: Any, name: str = "lengths", k: int | None = None) -> Tensor:
    """``lengths`` as an ``(n, k)`` int64 CPU tensor; ``(n,)`` input becomes ``(n, 1)``.

    Integer tensors on any device (a device copy is a host sync), numpy arrays and sequences of
    ints are accepted. Floats and bools raise ``TypeError`` (truncating ``2.7`` to ``2`` would
    silently drop data); negative lengths and other shapes (``k`` columns, when given) raise
    ``ValueError``.
    """
    if isinstance(lengths, Tensor) and lengths.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and has no values; give real lengths")
    t = torch.as_tensor(lengths)
    if t.numel() == 0:
        t = t.to(torch.long)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(
            f"{name} should hold integers, but got dtype {t.dtype}; lengths are counts, so "
            f"convert them explicitly (e.g. {name}.long() after checking they are whole numbers)"
        )
    if t.dim() == 1:
        t = t[:, None]
    if t.dim() != 2 or (k is not None and t.shape[1] != k):
        columns = "k" if k is None else k
        raise ValueError(
            f"{name} should be (n,) or (n, {columns}) for {columns} length dim(s), but got shape "
            f"{tuple(t.shape)}"
        )
    t = t.to("cpu", torch.long)
    if len(t) and int(t.min()) < 0:
        raise ValueError(f"{name} should be non-negative, but got min {int(t.min())}")
    return t


def check_number(value: Any, name: str, positive: bool = False) -> float:
    """``value`` as a float, raising unless it is a finite non-negative (or positive) number."""
    bound = "positive" if positive else "non-negative"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} should be a {bound} finite number, but got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{name} should be {bound} and finite, but got {name}={value!r}")
    return number


def unit_costs(
    cost: CostLike, lengths: np.ndarray, name: str = "cost", monotone: bool = False
) -> np.ndarray:
    """``cost(L)`` for every length, checked finite, non-negative and (optionally) monotone.

    A NaN or infinite price would make every plan look infeasible and the error blame another
    option, so it is caught here and named.
    """
    unit = resolve_cost(cost)(lengths)
    bad = ~np.isfinite(unit)
    if monotone and not bad.any() and np.any(np.diff(unit) < -1e-12 * np.abs(unit).max()):
        raise ValueError(f"{name} should be non-decreasing in the length")
    bad |= unit < 0
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} should return finite non-negative prices, but {name}({int(lengths[i])}) = "
            f"{float(unit[i])}"
        )
    return unit


def _round_up(value: int, buckets: Sequence[int] | None) -> int:
    if not buckets:
        return value
    i = bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else value


def _warn_unbucketed(values: Sequence[int], buckets: list[int] | None, name: str) -> None:
    """Warn where a padded length or row count is above the largest bucket: it keeps its own
    size, one more shape than the buckets allow (``torch.compile`` recompiles for it). One
    message per bucket list, so Python's warning filter shows it once per call site."""
    if buckets and max(values, default=0) > buckets[-1]:
        warnings.warn(
            f"{name}: a group needs more than the largest bucket ({buckets[-1]}), so it keeps "
            f"its own size: one more shape than the buckets allow (torch.compile recompiles "
            f"for it). Add a bucket at least as large as the largest length (or group) you "
            f"expect, or cap the items' lengths.",
            UserWarning,
            stacklevel=3,
        )


def _check_buckets(buckets: Sequence[int] | None, name: str) -> list[int] | None:
    if buckets is None:
        return None
    values = list(buckets)
    if any(isinstance(b, bool) or int(b) != b for b in values):
        raise TypeError(f"{name} should hold whole numbers, but got {buckets!r}")
    out = sorted({int(b) for b in values})
    if not out or out[0] < 1:
        raise ValueError(f"{name} should be a non-empty list of positive ints, but got {buckets!r}")
    return out


def plan_from_partition(
    partition: Sequence[Sequence[int]] | Sequence[Tensor],
    lengths: Sequence[int] | Tensor,
    length_buckets: Sequence[int] | None = None,
    size_buckets: Sequence[int] | None = None,
) -> GroupPlan:
    """A :class:`GroupPlan` for a given partition; padded sizes are the group maxima (bucketed)."""
    matrix = as_length_matrix(lengths)
    length_buckets = _check_buckets(length_buckets, "length_buckets")
    size_buckets = _check_buckets(size_buckets, "size_buckets")
    groups = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in partition]
    groups = [g for g in groups if len(g)]
    seen = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.long)
    if len(seen) != len(matrix) or not torch.equal(seen.sort().values, torch.arange(len(matrix))):
        raise ValueError(
            f"the partition should use every item index 0..{len(matrix) - 1} exactly once, but it "
            f"holds {len(seen)} indices for {len(matrix)} items"
        )
    maxima = [matrix[g].max(0).values.tolist() for g in groups]
    padded = [[_round_up(v, length_buckets) for v in m] for m in maxima]
    rows = [_round_up(len(g), size_buckets) for g in groups]
    _warn_unbucketed([max(m) for m in padded], length_buckets, "length_buckets")
    _warn_unbucketed(rows, size_buckets, "size_buckets")
    return GroupPlan(groups, padded, rows)


def _hull_dp(cuts: list[int], unit: list[float], alpha: float) -> tuple[list[float], list[int]]:
    """``best[m] = min_i best[i] + alpha + (cuts[m] - cuts[i]) * unit[m - 1]``, exactly.

    Each earlier cut ``i`` is a line ``y = -cuts[i] * x + best[i]`` with ever smaller slopes,
    queried at the non-decreasing ``x = unit[m - 1]``: a monotone convex-hull minimum, one pass.
    """
    best, back = [0.0], [0]
    hull: list[int] = [0]  # cut indices whose lines form the lower envelope
    head = 0
    for m in range(1, len(cuts)):
        x = unit[m - 1]
        head = min(head, len(hull) - 1)
        while head + 1 < len(hull):
            nxt, cur = hull[head + 1], hull[head]
            if best[nxt] - cuts[nxt] * x > best[cur] - cuts[cur] * x:
                break
            head += 1
        i = hull[head]
        best.append(best[i] + alpha + (cuts[m] - cuts[i]) * x)
        back.append(i)
        # add line m (slope -cuts[m]); drop lines that are nowhere the minimum any more
        c3, b3 = cuts[m], best[m]
        while len(hull) >= 2:
            i1, i2 = hull[-2], hull[-1]
            c1, b1 = cuts[i1], best[i1]
            if (b3 - b1) * (cuts[i2] - c1) <= (best[i2] - b1) * (c3 - c1):
                hull.pop()
            else:
                break
        hull.append(m)
    return best, back


def _capped_dp(
    cuts: np.ndarray,
    unit: np.ndarray,
    alpha: float,
    max_group_cost: float | None,
    size_buckets: list[int] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence with a per-group cost cap and bucketed row counts, O(n^2) numpy."""
    n = len(cuts) - 1
    row_price = np.arange(n + 1, dtype=np.float64)
    if size_buckets is not None:
        row_price = np.array([_round_up(r, size_buckets) for r in range(n + 1)], np.float64)
    best = np.full(len(cuts), np.inf)
    back = np.zeros(len(cuts), dtype=np.int64)
    best[0] = 0.0
    for m in range(1, len(cuts)):
        j = cuts[m]
        work = row_price[j - cuts[:m]] * unit[j - 1]
        price = best[:m] + alpha + work
        if max_group_cost is not None:
            price = np.where(work <= max_group_cost, price, np.inf)
        back[m] = int(np.argmin(price))
        best[m] = price[back[m]]
    return best, back


def plan_groups(
    lengths: Sequence[int] | Sequence[Sequence[int]] | Tensor,
    cost: CostLike = "linear",
    alpha: float | None = None,
    overhead: float = 0.02,
    max_group_cost: float | None = None,
    length_buckets: Sequence[int] | None = None,
    size_buckets: Sequence[int] | None = None,
) -> GroupPlan:
    """The exact cheapest grouping of one batch: minimise ``sum_g alpha + rows_g * cost(L_g)``.

    Args:
        lengths: ``(n,)`` item lengths, or ``(n, k)`` with the first column planned on (the
            others are padded to their group maxima).
        cost: price of one item at padded length ``L``: ``"linear"``, ``"quadratic"`` or a
            callable (e.g. a :class:`CostModel` from :func:`calibrate_cost`).
        alpha: price of one group (one module call) in ``cost`` units. ``None``: ``overhead``
            times the padding-free cost of the batch, ``sum_i cost(L_i)``.
        max_group_cost: optional cap on ``rows_g * cost(L_g)`` (e.g. an activation-memory budget).
        length_buckets: allowed padded lengths (``torch.compile`` sees at most
            ``len(length_buckets) * len(size_buckets)`` shapes).
        size_buckets: allowed row counts.

    Exact over partitions contiguous in length order, which hold an optimum whenever sizes are
    not bucketed. Runs on the CPU in ``O(n)`` numpy operations.
    """
    if alpha is not None:
        alpha = check_number(alpha, "alpha")
    overhead = check_number(overhead, "overhead")
    if max_group_cost is not None:
        max_group_cost = check_number(max_group_cost, "max_group_cost", positive=True)
    matrix = as_length_matrix(lengths)
    n = len(matrix)
    if n == 0:
        return GroupPlan([], [])
    length_buckets = _check_buckets(length_buckets, "length_buckets")
    size_buckets = _check_buckets(size_buckets, "size_buckets")
    table = matrix.numpy()
    key = table[:, 0]
    order_np = np.argsort(key, kind="stable")
    sorted_len = key[order_np]
    padded_len = sorted_len
    if length_buckets is not None:
        padded_len = np.array([_round_up(int(v), length_buckets) for v in sorted_len])
    unit = unit_costs(cost, padded_len, monotone=True)
    if alpha is None:
        alpha = overhead * float(unit_costs(cost, sorted_len).sum())

    if max_group_cost is None and size_buckets is None:
        # boundaries only where the (bucketed) length changes; convex-hull DP, O(runs)
        ends = np.flatnonzero(np.diff(padded_len)) + 1
        cuts = np.concatenate([[0], ends, [n]])
        best, back = _hull_dp(cuts.tolist(), unit[cuts[1:] - 1].tolist(), float(alpha))
    else:
        cuts = np.arange(n + 1)
        best, back = _capped_dp(cuts, unit, float(alpha), max_group_cost, size_buckets)
    if not np.isfinite(best[-1]):
        raise ValueError(
            f"max_group_cost={max_group_cost} is below the cost of a single item of length "
            f"{int(sorted_len[-1])} ({float(unit[-1])}); raise it"
        )
    bounds = [len(cuts) - 1]
    while bounds[-1] != 0:
        bounds.append(int(back[bounds[-1]]))
    bounds.reverse()
    order = torch.from_numpy(order_np)
    groups, lengths, rows = [], [], []
    for a, b in itertools.pairwise(bounds):
        start, stop = int(cuts[a]), int(cuts[b])
        groups.append(order[start:stop])
        top = table[order_np[start:stop]].max(0) if table.shape[1] > 1 else (sorted_len[stop - 1],)
        lengths.append([_round_up(int(v), length_buckets) for v in top])
        rows.append(_round_up(stop - start, size_buckets))
    _warn_unbucketed([max(group) for group in lengths], length_buckets, "length_buckets")
    _warn_unbucketed(rows, size_buckets, "size_buckets")
    return GroupPlan(groups, lengths, rows)


def plan_cost(plan: GroupPlan, cost: CostLike = "linear", alpha: float = 0.0) -> float:
    """``sum_g alpha + rows_g * cost(L_g)`` on the first length dim: what plan_groups minimises."""
    unit = resolve_cost(cost)(np.array([lens[0] for lens in plan.lengths]))
    return float(sum(alpha + r * u for r, u in zip(plan.rows, unit, strict=False)))
