"""Planning: the per-batch DP and the dataset-level thresholds are exact (vs brute force)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grabkit.group import (
    LengthThresholdGrouper,
    calibrate_cost,
    find_thresholds,
    plan_cost,
    plan_groups,
)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def brute_force(lengths, cost, alpha, cap=None):
    best = np.inf
    for partition in set_partitions(list(range(len(lengths)))):
        total = 0.0
        for group in partition:
            unit = cost(max(lengths[i] for i in group))
            if cap is not None and len(group) * unit > cap:
                total = np.inf
                break
            total += alpha + len(group) * unit
        best = min(best, total)
    return best


COSTS = {"linear": lambda L: float(L), "quadratic": lambda L: float(L * L)}


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    alpha=st.floats(0, 40),
    kind=st.sampled_from(["linear", "quadratic"]),
    capped=st.booleans(),
)
def test_plan_groups_is_optimal(lengths, alpha, kind, capped) -> None:
    cap = 2.5 * COSTS[kind](max(lengths)) if capped else None
    plan = plan_groups(lengths, cost=kind, alpha=alpha, max_group_cost=cap)
    assert sorted(torch.cat(plan.groups).tolist()) == list(range(len(lengths)))
    for group, padded in zip(plan.groups, plan.lengths, strict=True):
        assert padded[0] == max(lengths[i] for i in group.tolist())
        if cap is not None:
            assert len(group) * COSTS[kind](padded[0]) <= cap
    got = plan_cost(plan, kind, alpha)
    assert got == pytest.approx(brute_force(lengths, COSTS[kind], alpha, cap))


def test_alpha_trades_groups_for_padding() -> None:
    lengths = [1] * 100 + [4] * 25 + [16] * 6 + [64] * 2
    assert len(plan_groups(lengths, alpha=0.0)) == 4
    assert len(plan_groups(lengths, alpha=1e6)) == 1
    callable_cost = plan_groups(lengths, cost=lambda L: L, alpha=0.0)
    assert [g[0] for g in callable_cost.lengths] == [1, 4, 16, 64]


def threshold_cost(lengths, thresholds, cost):
    """Padded cost of binning ``lengths`` by inclusive upper ``thresholds``."""
    bins: dict[int, list[int]] = {}
    for L in lengths:
        bins.setdefault(sum(t < L for t in thresholds), []).append(L)
    return sum(len(members) * cost(max(members)) for members in bins.values())


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 15), min_size=2, max_size=25),
    k=st.integers(1, 3),
    kind=st.sampled_from(["linear", "quadratic"]),
)
def test_exact_thresholds_are_optimal(lengths, k, kind) -> None:
    distinct = sorted(set(lengths))
    if len(distinct) < k + 1:
        with pytest.raises(ValueError, match="distinct lengths"):
            find_thresholds(lengths, kind, k)
        return
    got = find_thresholds(lengths, COSTS[kind], k)
    assert got == sorted(got) and len(got) == k
    best = min(
        threshold_cost(lengths, list(c), COSTS[kind])
        for c in itertools.combinations(distinct[:-1], k)
    )
    assert threshold_cost(lengths, got, COSTS[kind]) == pytest.approx(best)


def test_notebook_thresholds_and_grouper_convention() -> None:
    lengths = [1] * 500 + [4] * 130 + [16] * 30 + [64] * 8
    assert find_thresholds(lengths, cost_fn=lambda x: x, k=3, num_trials=100) == [1, 4, 16]
    balanced, gap = find_thresholds(
        lengths, lambda x: x, k=3, num_trials=20, method="balance", seed=0, return_max_diff=True
    )
    assert len(balanced) == 3 and gap >= 0
    grouper = LengthThresholdGrouper("s", [1, 4, 16])
    plan = grouper.plan({"s": torch.tensor([64, 1, 4, 16, 2, 5])}, 6)
    assert plan.partition() == [[1], [2, 4], [3, 5], [0]]  # thresholds are inclusive bounds


def test_calibrate_cost_recovers_the_timing_model(monkeypatch) -> None:
    """A fake clock advances by exactly ``2e-3 + n * 1e-5 * L`` per call: the fit is exact."""
    import grabkit.group.calibration as calibration

    now = [0.0]

    def run(n, L):
        now[0] += 2e-3 + n * 1e-5 * L

    monkeypatch.setattr(calibration.time, "perf_counter", lambda: now[0])
    model = calibrate_cost(run, lengths=(4, 16, 64), sizes=(1, 8, 32), repeats=1)
    assert model.alpha == pytest.approx(2e-3, rel=1e-6)
    assert model(10) == pytest.approx(1e-4, rel=1e-6)
    plan = plan_groups([1] * 50 + [64] * 3, cost=model, alpha=model.alpha)
    assert len(plan) == 2


def test_planning_errors() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        plan_groups([1, -2])
    with pytest.raises(ValueError, match="alpha should be non-negative"):
        plan_groups([1, 2], alpha=-1.0)
    with pytest.raises(ValueError, match="below the cost of a single item"):
        plan_groups([1, 50], max_group_cost=10.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_groups([1, 5], cost=lambda L: -L)
    with pytest.raises(ValueError, match="k should be a positive integer"):
        find_thresholds([1, 2, 3], "linear", 0)
    with pytest.raises(ValueError, match="method"):
        find_thresholds([1, 2, 3], "linear", 1, method="nope")
    with pytest.raises(ValueError, match="distinct"):
        LengthThresholdGrouper("s", [2, 2])
