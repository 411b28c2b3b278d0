"""Group outputs must have a row per input row, and collated items may differ only along their
length dims: anything else raises instead of merging rows that belong to no item."""

from __future__ import annotations

import pytest
import torch

from grabkit.group import GroupingCollate, backward_by_group, group_batch, plan_groups, run_grouped

LENGTHS = torch.tensor([3, 7, 1, 7, 2, 5])


def _padded() -> torch.Tensor:
    x = torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(0))
    return x * (torch.arange(8)[None, :, None] < LENGTHS[:, None, None])


@pytest.mark.parametrize(
    "module",
    [
        lambda t: t.sum(1).T,  # the batch dim moved: (4, n_g)
        lambda t: t.sum((0, 1))[None].expand(2, 4),  # reduced over the batch, then 2 rows
        lambda t: torch.cat([t.sum(1), t.sum(1)[:1]]),  # one row too many
        lambda t: t.sum(1)[:-1],  # one row too few
    ],
    ids=["transposed", "batch-reduced", "extra-row", "missing-row"],
)
def test_an_output_without_a_row_per_input_row_raises(module):
    """The transposed and extra-row outputs used to be cut to the group's size and merged
    (a (6, 2) result for (6, 4), rows of no item); the others failed inside index_select."""
    with pytest.raises(ValueError, match="one output row per input row"):
        run_grouped(module, _padded(), LENGTHS, planning={"alpha": 0})


def test_bucketed_padding_rows_are_still_cut_off():
    x = _padded()
    out = run_grouped(lambda t: t.sum(1), x, LENGTHS, planning={"alpha": 0, "size_buckets": [4]})
    torch.testing.assert_close(out, x.sum(1))


def test_merge_needs_one_output_per_group_in_group_order():
    batch = group_batch(_padded(), LENGTHS, alpha=0)
    outputs = [g.sum(1) for g in batch.group_inputs()]
    torch.testing.assert_close(batch.merge(outputs), _padded().sum(1))
    with pytest.raises(ValueError, match="outputs for a plan of"):
        batch.merge(outputs[:-1])
    sizes = [len(g) for g in batch.plan.groups]
    assert sizes != sizes[::-1]  # so that reversed outputs have the wrong row counts
    with pytest.raises(ValueError, match="one output row per input row"):
        batch.merge(outputs[::-1])


def test_backward_by_group_checks_the_rows_before_the_loss():
    x = _padded().requires_grad_()
    batch = group_batch(x, LENGTHS, alpha=0)
    with pytest.raises(ValueError, match="one output row per input row"):
        backward_by_group(lambda t: t.sum(1).T, batch, lambda out, items: out.sum(1))


def test_collated_items_that_differ_outside_the_length_dims_raise():
    samples = [(torch.randn(2, 3), 0), (torch.randn(5, 3), 1), (torch.randn(2, 4), 2)]
    with pytest.raises(ValueError, match=r"item 2 .*\(2, 4\).*length_dims"):
        GroupingCollate()(samples)


@pytest.mark.parametrize("pad_value", [0.5, float("nan"), 2.0**70])
def test_a_pad_value_integer_items_cannot_hold_raises(pad_value):
    """0.5 used to be truncated to 0 without a word (NaN failed deep inside the padding)."""
    samples = [(torch.tensor([1, 2]), 0), (torch.tensor([3, 4, 5]), 1)]
    with pytest.raises(ValueError, match="pad_value"):
        GroupingCollate(pad_value=pad_value)(samples)
    assert GroupingCollate(pad_value=7)(samples).padded.tolist() == [[1, 2, 7], [3, 4, 5]]


def test_fractional_buckets_raise():
    with pytest.raises(TypeError, match="whole numbers"):
        plan_groups([1, 2, 3], length_buckets=[2.5])
    assert plan_groups([1, 2, 3], alpha=0, length_buckets=[2.0, 4]).lengths == [[2], [4]]
