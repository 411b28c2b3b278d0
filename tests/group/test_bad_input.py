"""Bad or edge-case input to the grouping API: every case is exact or a clear error, never silent.

An empty batch is well defined (``run_grouped`` returns ``module(padded)``, ``backward_by_group``
with ``reduction="sum"`` returns a zero loss); a mean over no items is not, so it raises.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from grabkit.group import (
    DataCollection,
    DynamicGrouper,
    Grouper,
    GroupingCollate,
    GroupPlan,
    LengthThresholdGrouper,
    UniGrouper,
    backward_by_group,
    find_thresholds,
    group_batch,
    infer_output_lengths,
    plan_from_partition,
    plan_groups,
    run_grouped,
)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1)


# ----------------------------------------------------------------------------- empty batches
def test_run_grouped_on_an_empty_batch_returns_the_padded_run() -> None:
    model = nn.Linear(3, 2)
    padded = torch.zeros(0, 5, 3)
    out = run_grouped(model, padded, torch.zeros(0, dtype=torch.long))
    assert out.shape == model(padded).shape == (0, 5, 2)
    out, lengths = run_grouped(model, padded, torch.zeros(0, dtype=torch.long), return_lengths=True)
    assert out.shape == (0, 5, 2) and lengths == {}


def test_run_grouped_on_an_empty_batch_passes_an_empty_mask() -> None:
    seen = []

    def masked(x, mask):
        seen.append(tuple(mask.shape))
        return x.sum(1)

    out = run_grouped(masked, torch.zeros(0, 4), [], pass_mask=True)
    assert out.shape == (0,) and seen == [(0, 4)]


def test_backward_by_group_on_an_empty_batch() -> None:
    model = nn.Linear(3, 2)
    batch = group_batch(torch.zeros(0, 5, 3), torch.zeros(0, dtype=torch.long))
    loss = backward_by_group(model, batch, lambda o, i: o.sum((1, 2)), reduction="sum")
    assert loss.item() == 0.0 and model.weight.grad is None
    with pytest.raises(ValueError, match=r"empty batch.*reduction='sum'"):
        backward_by_group(model, batch, lambda o, i: o.sum((1, 2)))


# ----------------------------------------------------------------------------- lengths
@pytest.mark.parametrize(
    "lengths",
    [
        torch.tensor([1.7, 2.2, 5.0]),
        [1.5, 2.0, 5.0],
        torch.tensor([True, False, True]),
        [True, True, False],
        torch.tensor([1.0, 2.0, 5.0]),
    ],
)
def test_float_or_bool_lengths_raise_naming_lengths(lengths) -> None:
    with pytest.raises(TypeError, match="lengths"):
        run_grouped(row_sum, torch.ones(3, 5), lengths)
    with pytest.raises(TypeError, match="lengths"):
        group_batch(torch.ones(3, 5), lengths)
    with pytest.raises(TypeError, match="lengths"):
        plan_groups(lengths)
    with pytest.raises(TypeError, match="lengths"):
        DataCollection.from_padded("(B, L_s)", torch.ones(3, 5), {"s": lengths})


def test_float_length_info_of_a_grouped_collection_raises() -> None:
    with pytest.raises(TypeError, match=r"length_info\['s'\]\[1\]"):
        DataCollection(
            "(B, L_s)",
            data_groups=[torch.ones(1, 2), torch.ones(2, 3)],
            length_info={"s": [[2], [2.5, 3]]},
        )


def test_float_lengths_to_infer_output_lengths_raise() -> None:
    with pytest.raises(TypeError, match="lengths"):
        infer_output_lengths(row_sum, torch.ones(1, 5), torch.tensor([[2.5]]), (1,), (1,))


def test_float_lengths_to_find_thresholds_raise() -> None:
    with pytest.raises(TypeError, match="lengths"):
        find_thresholds([1.5, 2.7, 3.2, 4], "linear", 1)
    with pytest.raises(TypeError, match="lengths"):
        find_thresholds([True, False, True], "linear", 1)
    assert find_thresholds(torch.tensor([1, 2, 3, 4]), "linear", 1) == find_thresholds(
        [1, 2, 3, 4], "linear", 1
    )


def test_negative_lengths_raise_even_with_a_given_plan() -> None:
    plan = plan_from_partition([[0, 1, 2]], [1, 2, 5])
    with pytest.raises(ValueError, match="non-negative"):
        run_grouped(row_sum, torch.ones(3, 5), [1, -2, 5], plan=plan)
    with pytest.raises(ValueError, match="non-negative"):
        DataCollection.from_padded("(B, L_s)", torch.ones(3, 5), {"s": [1, -2, 5]})


def test_lengths_longer_than_the_padded_dim_raise() -> None:
    with pytest.raises(ValueError, match="exceeds the padded size"):
        run_grouped(row_sum, torch.ones(3, 5), [1, 6, 5])
    with pytest.raises(ValueError, match="exceeds the padded size"):
        DataCollection.from_padded("(B, L_s)", torch.ones(3, 5), {"s": [1, 6, 5]})


def test_mismatched_batch_sizes_raise() -> None:
    with pytest.raises(ValueError, match="lengths has 2 rows for a batch of 3"):
        run_grouped(row_sum, torch.ones(3, 5), [1, 2])
    with pytest.raises(ValueError, match="lengths\\['s'\\] has 2 entries for 3 items"):
        DataCollection.from_padded("(B, L_s)", torch.ones(3, 5), {"s": [1, 2]})


def test_a_plan_for_other_items_or_shorter_lengths_raises() -> None:
    padded, lengths = torch.ones(3, 5), [1, 2, 5]
    with pytest.raises(ValueError, match="plan covers 2 items"):
        run_grouped(row_sum, padded, lengths, plan=plan_from_partition([[0, 1]], [1, 2]))
    with pytest.raises(ValueError, match=r"plan pads group 0 to 2.*item 2 has length 5"):
        run_grouped(row_sum, padded, lengths, plan=plan_from_partition([[0, 1, 2]], [1, 2, 2]))
    wider = plan_from_partition([[0, 1, 2]], [1, 2, 5], length_buckets=[8])
    torch.testing.assert_close(run_grouped(row_sum, padded, lengths, plan=wider), padded.sum(1))


def test_length_dims_out_of_range_or_repeated_raise() -> None:
    with pytest.raises(ValueError, match="length_dims"):
        run_grouped(row_sum, torch.ones(3, 5), [1, 2, 5], length_dims=(3,))
    with pytest.raises(ValueError, match="length_dims"):
        group_batch(torch.ones(3, 5, 5), [[1, 1], [2, 2], [5, 5]], length_dims=(1, -2))
    assert group_batch(torch.ones(3, 5), [1, 2, 5], length_dims=(-1,)).length_dims == (1,)


@pytest.mark.parametrize("dims", [(3,), (0, -1), (True,), (0.0,)])
def test_collate_length_dims_out_of_range_repeated_or_not_int_raise(dims) -> None:
    with pytest.raises(ValueError, match="length_dims"):
        GroupingCollate(length_dims=dims, key=None)([torch.ones(3), torch.ones(5)])


def test_lengths_on_the_meta_device_raise_clearly() -> None:
    with pytest.raises(ValueError, match="lengths"):
        run_grouped(row_sum, torch.ones(3, 5), torch.tensor([1, 2, 5], device="meta"))


def test_non_contiguous_inputs_are_exact() -> None:
    torch.manual_seed(0)
    padded = torch.randn(2, 4, 6).transpose(0, 2)  # (6, 4, 2), non-contiguous
    assert not padded.is_contiguous()
    lengths = torch.tensor([[4, 1], [2, 2], [3, 2], [1, 1], [4, 2], [1, 2]]).t().contiguous().t()
    mask = (torch.arange(4)[None, :, None] < lengths[:, None, :1]) & (
        torch.arange(2)[None, None, :] < lengths[:, None, 1:]
    )

    def masked_sum(x, m):
        return (x * m).sum((1, 2))

    out = run_grouped(
        masked_sum, padded, lengths, length_dims=(1, 2), pass_mask=True, planning={"alpha": 0.0}
    )
    torch.testing.assert_close(out, masked_sum(padded, mask))


# ----------------------------------------------------------------------------- planning options
@pytest.mark.parametrize("option", ["alpha", "overhead", "max_group_cost"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_planning_options_name_themselves(option, value) -> None:
    with pytest.raises(ValueError, match=f"{option} should be"):
        plan_groups([1, 2, 5], **{option: value})
    with pytest.raises(ValueError, match=f"{option} should be"):
        run_grouped(row_sum, torch.ones(3, 5), [1, 2, 5], planning={option: value})
    with pytest.raises(ValueError, match=f"{option} should be"):
        GroupingCollate(**{option: value})
    with pytest.raises(ValueError, match=f"{option} should be"):
        DynamicGrouper("s", **{option: value})


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf])
def test_a_cost_that_is_not_finite_and_non_negative_is_named(bad) -> None:
    with pytest.raises(ValueError, match="cost"):
        plan_groups([1, 2, 5], cost=lambda L: bad)
    with pytest.raises(ValueError, match="cost_fn"):
        find_thresholds([1, 2, 3, 4], lambda L: bad, 1)


# ----------------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=10),
    seed=st.integers(0, 2**16),
    shrink=st.booleans(),
)
def test_any_given_plan_is_exact_or_refused(lengths, seed, shrink) -> None:
    """A random partition as a plan: exact when it pads every item, refused when it does not."""
    n = len(lengths)
    g = torch.Generator().manual_seed(seed)
    padded = torch.randn(n, 6, generator=g)
    lens = torch.tensor(lengths, dtype=torch.long)
    groups = torch.randint(0, 3, (n,), generator=g)
    partition = [torch.nonzero(groups == k)[:, 0] for k in range(3)]
    plan = plan_from_partition(partition, lens)
    too_short = shrink and any(size[0] > 0 for size in plan.lengths)
    if too_short:
        plan.lengths = [[max(0, size[0] - 1)] for size in plan.lengths]

    def masked_sum(x, mask):
        return (x * mask).sum(1)

    mask = torch.arange(6)[None] < lens[:, None]
    if too_short:
        with pytest.raises(ValueError, match="the plan pads group"):
            run_grouped(masked_sum, padded, lens, plan=plan, pass_mask=True)
    else:
        out = run_grouped(masked_sum, padded, lens, plan=plan, pass_mask=True)
        torch.testing.assert_close(out, masked_sum(padded, mask))


# ----------------------------------------------------------------------------- grouped input
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(length_info={"s": [[2]]}), r"length_info\['s'\] gives 1 groups for 2"),
        (dict(length_info={}), "length_info should give every length label"),
        (dict(length_info={"s": [[2], [3]]}), r"length_info\['s'\]\[1\] has 1 lengths for 2"),
        (dict(length_info={"s": [[5], [3, 3]]}), "exceeds the padded size"),
        (
            dict(length_info={"s": [[2], [3, 3]]}, data_partition=[[0], [0, 1]]),
            "every item index 0..2 exactly once",
        ),
        (
            dict(length_info={"s": [[2], [3, 3]]}, data_partition=[[0], [1]]),
            "data_partition\\[1\\] has 1 items but group 1 has 2 rows",
        ),
    ],
)
def test_an_inconsistent_grouped_collection_is_refused(options, match) -> None:
    groups = [torch.ones(1, 2), torch.ones(2, 3)]
    with pytest.raises(ValueError, match=match):
        DataCollection("(B, L_s)", data_groups=groups, **options)


def test_a_custom_grouper_that_drops_items_is_refused() -> None:
    class Dropping(Grouper):
        def plan(self, lengths, size):
            return GroupPlan([torch.tensor([0, 1])], [[4]])

    dc = DataCollection("(B, L_s)", [torch.ones(n) for n in (2, 4, 3)])
    with pytest.raises(ValueError, match=r"Dropping.plan\(\) covers 2 items but the batch has 3"):
        dc.group(Dropping())
    dc.group(UniGrouper())
    with pytest.raises(ValueError, match="Dropping"):
        dc.regroup(Dropping())


def test_thresholds_that_are_not_finite_numbers_are_named() -> None:
    with pytest.raises(ValueError, match="thresholds should be finite"):
        LengthThresholdGrouper("s", [math.nan])
    with pytest.raises(TypeError, match="thresholds should hold numbers"):
        LengthThresholdGrouper("s", [True, 3])
    grouper = LengthThresholdGrouper("s", [2.5])  # L <= 2.5 is L <= 2 for integer lengths
    assert grouper.plan({"s": torch.tensor([1, 2, 3])}, 3).partition() == [[0, 1], [2]]


@pytest.mark.parametrize("planner", ["plan_groups", "plan_from_partition"])
def test_a_length_or_size_above_the_largest_bucket_warns(planner):
    """Buckets bound the shapes ``torch.compile`` sees; a group longer (or with more rows) than
    the largest bucket kept its own size without a word on the old code: one more shape."""

    def plan(lengths, **buckets):
        if planner == "plan_groups":
            return plan_groups(lengths, alpha=0.0, **buckets)
        return plan_from_partition([list(range(len(lengths)))], lengths, **buckets)

    with pytest.warns(UserWarning, match=r"length_buckets.*largest.*8.*one more shape"):
        assert plan([3, 9], length_buckets=[4, 8]).lengths[-1] == [9]
    with pytest.warns(UserWarning, match=r"size_buckets.*largest.*2.*one more shape"):
        assert max(plan([3, 3, 3], size_buckets=[1, 2]).rows) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan([3, 7], length_buckets=[4, 8], size_buckets=[1, 2, 4])  # all within the buckets
