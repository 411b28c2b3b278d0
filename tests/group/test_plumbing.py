"""Vectorised padding and masks agree with item-by-item references (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grabkit.group import CDimPadder, ConstantPadder, DataCollection, PredefinedGrouper
from grabkit.group.annotation import parse_signature
from grabkit.group.plumbing import length_mask, pad_stack


@st.composite
def ragged_items(draw):
    kinds = draw(st.lists(st.sampled_from(["L", "M", "C"]), min_size=1, max_size=3))
    batch_at = draw(st.integers(0, len(kinds)))
    n = draw(st.integers(1, 5))
    fixed = {i: draw(st.integers(1, 3)) for i, k in enumerate(kinds) if k != "L"}
    shapes = [
        tuple(draw(st.integers(0, 4)) if k == "L" else fixed[i] for i, k in enumerate(kinds))
        for _ in range(n)
    ]
    atoms = [
        f"L_l{i}" if k == "L" else f"M_m{i}" if k == "M" else str(fixed[i])
        for i, k in enumerate(kinds)
    ]
    atoms.insert(batch_at, "B")
    return "(" + ", ".join(atoms) + ")", shapes, kinds, batch_at


@settings(max_examples=60, deadline=None)
@given(case=ragged_items(), seed=st.integers(0, 2**16))
def test_pad_stack_matches_item_by_item_padding(case, seed) -> None:
    annot, shapes, kinds, batch_at = case
    g = torch.Generator().manual_seed(seed)
    items = [torch.randn(s, generator=g) for s in shapes]
    sig = parse_signature(annot)
    length_axes = [i for i, k in enumerate(kinds) if k == "L"]
    lengths = torch.tensor([[s[a] for a in length_axes] for s in shapes], dtype=torch.long)
    lengths = lengths.reshape(len(shapes), len(length_axes))
    const = [s for s, k in zip(shapes[0], kinds, strict=True) if k == "C"]
    padder = CDimPadder(torch.randn(const, generator=g)) if const else ConstantPadder(-7.0)
    got = pad_stack(items, sig, lengths, padder)

    target = list(shapes[0])
    for a in length_axes:
        target[a] = max(s[a] for s in shapes)
    rows = []
    for t in items:
        if const:
            view = [c if k == "C" else 1 for c, k in zip(target, kinds, strict=True)]
            row = padder.value.reshape(view).expand(target).clone()
        else:
            row = torch.full(target, -7.0)
        row[tuple(slice(0, d) for d in t.shape)] = t
        rows.append(row)
    torch.testing.assert_close(got, torch.stack(rows, dim=batch_at))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=6))
def test_length_mask_is_the_and_of_each_length_dim(lengths) -> None:
    table = torch.tensor(lengths, dtype=torch.long)
    sizes = table.max(0).values.tolist()
    mask = length_mask(table, sizes)
    for row, (a, b) in enumerate(lengths):
        expected = torch.zeros(sizes, dtype=torch.bool)
        expected[:a, :b] = True
        assert torch.equal(mask[row], expected)


@settings(max_examples=30, deadline=None)
@given(case=ragged_items(), data=st.data())
def test_group_then_ungroup_restores_every_item(case, data) -> None:
    annot, shapes, _, _ = case
    items = [torch.randn(s) for s in shapes]
    labels = data.draw(st.permutations(range(len(items))))
    cut = data.draw(st.integers(0, len(items)))
    partition = [p for p in (list(labels[:cut]), list(labels[cut:])) if p]
    dc = DataCollection(annot, items)
    dc.group(PredefinedGrouper(partition))
    assert dc.data_partition == partition
    dc.ungroup()
    for got, item in zip(dc.data_list, items, strict=True):
        torch.testing.assert_close(got.value, item)
