"""Dataset-level length thresholds for :class:`~grabkit.group.groupers.LengthThresholdGrouper`.

``k`` thresholds cut the sorted distinct lengths into ``k + 1`` bins; a bin of ``count_g`` items
whose longest is ``max_g`` costs ``count_g * cost(max_g)`` when padded. ``find_thresholds``
minimises the sum exactly, or (asym's method) balances neighbouring bins by local search.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .planning import as_length_matrix, unit_costs

__all__ = ["find_thresholds"]


def _distinct_counts(lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    matrix = as_length_matrix(lengths, "l (the lengths)")
    if matrix.shape[1] != 1 or len(matrix) == 0:
        raise ValueError("l (the lengths) should be a non-empty 1-D sequence of ints")
    values = matrix[:, 0].numpy()
    if values.min() <= 0:
        raise ValueError(f"l (the lengths) should be positive, but got min {int(values.min())}")
    return np.unique(values, return_counts=True)


def _exact_thresholds(xs: np.ndarray, counts: np.ndarray, unit: np.ndarray, k: int) -> list[int]:
    """Minimise ``sum_g count_g * cost(max_g)`` over partitions into ``k + 1`` contiguous bins."""
    d = len(xs)
    cum = np.concatenate([[0], np.cumsum(counts)])
    # best[g, j]: first j distinct values in g + 1 bins; bin (i, j] costs (cum[j]-cum[i])*unit[j-1]
    best = np.full((k + 1, d + 1), np.inf)
    back = np.zeros((k + 1, d + 1), dtype=np.int64)
    best[0, 1:] = cum[1:] * unit
    for g in range(1, k + 1):
        for j in range(g + 1, d + 1):
            price = best[g - 1, g:j] + (cum[j] - cum[g:j]) * unit[j - 1]
            back[g, j] = g + int(np.argmin(price))
            best[g, j] = price[back[g, j] - g]
    cuts, j = [], d
    for g in range(k, 0, -1):
        j = int(back[g, j])
        cuts.append(j)
    return [int(xs[c - 1]) for c in reversed(cuts)]


def _bin_costs(counts: np.ndarray, unit: np.ndarray, cuts: list[int]) -> np.ndarray:
    """``count * cost(max)`` of each bin when bins close after distinct-length indices ``cuts``."""
    cum = np.concatenate([[0], np.cumsum(counts)])
    edges = [0, *(i + 1 for i in cuts), len(counts)]
    return np.array([(cum[b] - cum[a]) * unit[b - 1] for a, b in itertools.pairwise(edges)])


def _best_balanced(
    xs: np.ndarray,
    counts: np.ndarray,
    unit: np.ndarray,
    k: int,
    num_trials: int,
    seed: int | None,
    patience: int,
) -> tuple[list[int], dict[str, int]]:
    """The most balanced of ``num_trials`` random restarts, and how each restart stopped."""
    if num_trials < 1:
        raise ValueError(f"num_trials should be a positive integer, but got {num_trials}")
    rng = random.Random(seed)
    best: tuple[list[int], float] | None = None
    status_freq: dict[str, int] = {}
    for _ in range(num_trials):
        t, gap, status = _balance_thresholds(xs, counts, unit, k, rng, patience)
        status_freq[status] = status_freq.get(status, 0) + 1
        if best is None or gap < best[1]:
            best = (t, gap)
    return best[0], status_freq


def _balance_thresholds(
    xs: np.ndarray, counts: np.ndarray, unit: np.ndarray, k: int, rng: random.Random, patience: int
) -> tuple[list[int], float, str]:
    """Local search that equalises neighbouring bin costs (``count * cost(max)``)."""
    d = len(xs)
    t = sorted(rng.sample(range(d - 1), k))
    best_t, best_gap, stale, status = list(t), np.inf, 0, "patience"
    for _ in range(4 * d * max(k, 1)):
        diffs = np.diff(_bin_costs(counts, unit, t))
        j = int(np.argmax(np.abs(diffs)))
        gap = float(abs(diffs[j]))
        if gap < best_gap:
            best_t, best_gap, stale = list(t), gap, 0
        else:
            stale += 1
        if gap == 0:
            status = "balanced"
            break
        step = 1 if diffs[j] > 0 else -1
        moved = t[j] + step
        lower = t[j - 1] + 1 if j > 0 else 0
        upper = t[j + 1] - 1 if j + 1 < k else d - 2
        if stale > patience or not lower <= moved <= upper:
            status = "patience" if stale > patience else "boundary"
            break
        t[j] = moved
    return [int(xs[i]) for i in best_t], best_gap, status


def find_thresholds(
    l: Sequence[int],
    cost_fn: Callable[[int], float] | str,
    k: int,
    tolerate: int | None = None,
    print_status: bool = False,
    num_trials: int = 100,
    return_max_diff: bool = False,
    method: str = "exact",
    seed: int | None = None,
) -> list[int] | tuple[list[int], float]:
    """Dataset-level thresholds for :class:`LengthThresholdGrouper` (``k`` of them, ascending).

    A threshold closes a bin: bin ``g`` holds the lengths in ``(t_{g-1}, t_g]`` and the last one
    everything above ``t_k``. ``method="exact"`` (default) minimises the dataset's padded cost
    ``sum_g count_g * cost_fn(max_g)`` by dynamic programming; ``method="balance"`` is the
    random-restart search that equalises ``count_g * cost_fn(max_g)`` across bins
    (``num_trials`` restarts, ``tolerate`` non-improving steps each). ``return_max_diff`` also
    returns the largest gap between neighbouring bin costs of the answer.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k should be a positive integer, but got k={k!r}")
    xs, counts = _distinct_counts(l)
    if len(xs) < k + 1:
        raise ValueError(
            f"k={k} thresholds need at least {k + 1} distinct lengths, but the data has "
            f"{len(xs)}; use a smaller k"
        )
    unit = unit_costs(cost_fn, xs, "cost_fn")
    if method == "exact":
        thresholds, status_freq = _exact_thresholds(xs, counts, unit, k), {"exact": 1}
    elif method == "balance":
        patience = 2 * len(xs) if tolerate is None else int(tolerate)
        thresholds, status_freq = _best_balanced(xs, counts, unit, k, num_trials, seed, patience)
    else:
        raise ValueError(f"method should be 'exact' or 'balance', but got {method!r}")
    if print_status:
        print(status_freq)
    if not return_max_diff:
        return thresholds
    index = np.searchsorted(xs, thresholds)
    costs = _bin_costs(counts, unit, [int(i) for i in index])
    return thresholds, float(np.max(np.abs(np.diff(costs))))
