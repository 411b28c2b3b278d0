"""Copies of a DataCollection (``to``, ``pin_memory``, ``[key]``) are independent of the original.

Setting a key on a copy used to write into signature and item dicts shared with the original,
which then listed a key its items lacked (``group`` raised KeyError) or changed under the user.
"""

from __future__ import annotations

import pytest
import torch

from grabkit.group import DataCollection, LengthThresholdGrouper, UniGrouper


def make(grouped: bool) -> DataCollection:
    data = [
        {"x": torch.randn(n, 2), "y": {"a": torch.randn(n), "b": torch.randn(n)}} for n in (2, 4, 3)
    ]
    dc = DataCollection({"x": "(B, L_s, M_f)", "y": {"a": "(B, L_s)", "b": "(B, L_s)"}}, data)
    if grouped:
        dc.group(LengthThresholdGrouper("s", [2]))
    return dc


def keys(tree):
    return {k: keys(v) for k, v in tree.items()} if isinstance(tree, dict) else None


def snapshot(dc: DataCollection) -> tuple:
    items = dc.data_groups if dc.is_grouped else dc.data_list
    return keys(dc.shapesig_data), [keys(i.value) for i in items], sorted(dc.lengths)


def copies(dc: DataCollection) -> list:
    out = [dc.to("cpu"), dc["y"]]
    if torch.cuda.is_available():
        out.append(dc.pin_memory())
    return out


@pytest.mark.parametrize("grouped", [False, True])
def test_setting_a_key_on_a_copy_leaves_the_original_alone(grouped) -> None:
    dc = make(grouped)
    before = snapshot(dc)
    for copy in copies(dc):
        copy["c"] = copy["x"] if "x" in copy.shapesig_data else copy["a"]
        assert snapshot(dc) == before
    if grouped:
        dc.regroup(UniGrouper())
        dc.ungroup()
    dc.group(UniGrouper())  # every item still has exactly the annotated keys
    assert snapshot(dc)[0] == keys(make(False).shapesig_data)


def test_adding_a_key_to_a_moved_copy_leaves_the_original_groupable() -> None:
    dc = make(False)
    m = dc.to("cpu")
    m["c"] = m["x"]
    dc.group(UniGrouper())  # raised KeyError: an item lacks key path 'c'
    assert sorted(dc.shapesig_data) == ["x", "y"]
    assert sorted(m.shapesig_data) == ["c", "x", "y"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs an accelerator")
def test_pin_memory_copy_is_independent() -> None:
    dc = make(True)
    pinned = dc.pin_memory()
    pinned["c"] = pinned["x"]
    dc.ungroup()
    assert sorted(dc.data_list[0].value) == ["x", "y"]
