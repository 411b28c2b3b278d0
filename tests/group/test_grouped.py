"""Plain modules run group by group: run_grouped, GroupingCollate, backward_by_group."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, DistributedSampler

from grabkit.group import (
    GroupedBatch,
    GroupingCollate,
    backward_by_group,
    group_batch,
    plan_from_partition,
    plan_groups,
    run_grouped,
)

TOL = dict(rtol=1e-5, atol=1e-5)


class MaskedMax(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, width)
        self.linear = nn.Linear(width, width)
        self.proj = nn.Linear(width, 1)

    def forward(self, x, mask):
        h = self.linear(self.emb(x))
        h = h.masked_fill(~mask[..., None], float("-inf"))
        return self.proj(h.max(1).values)[:, 0]


def token_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 8, (n,), generator=g) for n in lengths]
    return xs, pad_sequence(xs, batch_first=True), torch.tensor(lengths)


def test_run_grouped_equals_padded_run_and_per_item_reference_with_gradients() -> None:
    torch.manual_seed(0)
    lengths = [1, 4, 16, 1, 64, 4, 1, 16, 1, 1]
    xs, padded, lens = token_batch(lengths)
    model = MaskedMax()
    mask = torch.arange(padded.shape[1])[None] < lens[:, None]

    grouped = run_grouped(model, padded, lens, pass_mask=True, planning={"overhead": 0.0})
    plain = model(padded, mask)
    single = torch.stack([model(x[None], torch.ones(1, len(x), dtype=torch.bool))[0] for x in xs])
    torch.testing.assert_close(grouped, plain, **TOL)
    torch.testing.assert_close(grouped, single, **TOL)

    g1 = torch.autograd.grad(grouped.square().sum(), list(model.parameters()))
    g2 = torch.autograd.grad(model(padded, mask).square().sum(), list(model.parameters()))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_input_gradients_and_two_length_dims() -> None:
    torch.manual_seed(1)
    shapes = [(3, 2), (1, 5), (4, 4), (2, 1)]
    padded = torch.zeros(4, 4, 5, 3)
    for i, (a, b) in enumerate(shapes):
        padded[i, :a, :b] = torch.randn(a, b, 3)
    padded.requires_grad_()
    lens = torch.tensor(shapes)
    lin = nn.Linear(3, 2)

    def module(x, mask):
        return (lin(x) * mask[..., None]).sum((1, 2))

    plan = plan_from_partition([[0, 3], [1, 2]], lens)
    out = run_grouped(module, padded, lens, plan=plan, length_dims=(1, 2), pass_mask=True)
    mask = (torch.arange(4)[None, :, None] < lens[:, 0, None, None]) & (
        torch.arange(5)[None, None, :] < lens[:, 1, None, None]
    )
    ref = module(padded, mask)
    torch.testing.assert_close(out, ref, **TOL)
    (ga,) = torch.autograd.grad(out.sum(), padded)
    (gb,) = torch.autograd.grad(ref.sum(), padded)
    torch.testing.assert_close(ga, gb, **TOL)


def test_derived_lengths_are_inferred_without_annotations() -> None:
    torch.manual_seed(2)
    conv = nn.Sequential(nn.Conv1d(2, 4, kernel_size=3, stride=2), nn.ReLU(), nn.MaxPool1d(2))
    lengths = [7, 20, 9, 33, 12]
    xs = [torch.randn(2, n) for n in lengths]
    padded = torch.zeros(5, 2, 33)
    for i, x in enumerate(xs):
        padded[i, :, : x.shape[1]] = x
    out, out_lengths = run_grouped(
        conv, padded, lengths, length_dims=(2,), return_lengths=True, planning={"overhead": 0.0}
    )
    expected = [((n - 3) // 2 + 1) // 2 for n in lengths]
    assert list(out_lengths) == [2]
    assert out_lengths[2].tolist() == expected
    for i, x in enumerate(xs):
        torch.testing.assert_close(out[i, :, : expected[i]], conv(x[None])[0], **TOL)


def test_buckets_bound_the_number_of_shapes_and_keep_results() -> None:
    torch.manual_seed(3)
    lengths = torch.randint(1, 60, (40,)).tolist()
    _, padded, lens = token_batch(lengths, seed=3)
    model = MaskedMax()
    mask = torch.arange(padded.shape[1])[None] < lens[:, None]
    plan = plan_groups(lens, overhead=0.0, length_buckets=[8, 32, 64], size_buckets=[4, 16, 64])
    assert {tuple(x) for x in plan.lengths} <= {(8,), (32,), (64,)}
    assert set(plan.rows) <= {4, 16, 64}
    batch = group_batch(padded, lens, plan)
    shapes = {tuple(x.shape) for x in batch.group_inputs()}
    assert shapes <= {(r, L) for r in (4, 16, 64) for L in (8, 32, 64)}
    torch.testing.assert_close(batch.run(model, pass_mask=True), model(padded, mask), **TOL)


def test_collate_with_distributed_sampler_and_dataloader() -> None:
    torch.manual_seed(4)
    lengths = torch.randint(1, 30, (24,)).tolist()
    data = [(torch.randint(0, 8, (n,)), float(i)) for i, n in enumerate(lengths)]
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = DataLoader(
        data, batch_size=6, sampler=sampler, collate_fn=GroupingCollate(overhead=0.0)
    )
    model = MaskedMax()
    seen = []
    for batch in loader:
        y = batch.extras
        out = batch.run(model, pass_mask=True)
        ids = y.long().tolist()
        seen += ids
        ref = torch.stack(
            [model(data[i][0][None], torch.ones(1, lengths[i], dtype=torch.bool))[0] for i in ids]
        )
        torch.testing.assert_close(out, ref, **TOL)
        assert 0 < batch.padding_efficiency() <= 1
    assert sorted(seen) == sorted(list(sampler))


def test_backward_by_group_gives_the_full_batch_gradient() -> None:
    torch.manual_seed(5)
    lengths = [3, 17, 1, 9, 30, 2, 2, 12]
    _, padded, lens = token_batch(lengths, seed=5)
    y = torch.randn(len(lengths))
    model = MaskedMax()
    batch = group_batch(padded, lens, max_group_cost=40.0, overhead=0.0)
    assert len(batch.plan) >= 3
    loss = backward_by_group(model, batch, lambda out, items: (out - y[items]) ** 2, pass_mask=True)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mask = torch.arange(padded.shape[1])[None] < lens[:, None]
    ref = ((model(padded, mask) - y) ** 2).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    for a, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, **TOL)


def test_errors() -> None:
    import pytest

    _, padded, lens = token_batch([2, 3])
    with pytest.raises(ValueError, match="exceeds the padded size"):
        group_batch(padded, torch.tensor([2, 9]))
    with pytest.raises(ValueError, match=r"\(n,\) or \(n, 1\)"):
        group_batch(padded, torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="single tensor"):
        run_grouped(lambda x: (x, x), padded, lens)
    batch = group_batch(padded, lens)
    with pytest.raises(ValueError, match="per-item losses"):
        backward_by_group(lambda x: x.float().sum(1), batch, lambda out, items: out.sum())
    with pytest.raises(TypeError, match="key=None"):
        GroupingCollate()([torch.zeros(2)])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    alpha=st.floats(0, 20),
    buckets=st.booleans(),
    sort_rows=st.booleans(),
)
def test_split_and_merge_round_trip(lengths, alpha, buckets, sort_rows) -> None:
    n, top = len(lengths), max(lengths)
    padded = torch.randn(n, top, 3)
    lens = torch.tensor(lengths)
    options = {"length_buckets": [2, 5, 12], "size_buckets": [3, 8, 16]} if buckets else {}
    plan = plan_groups(lens, alpha=alpha, **options)
    batch = group_batch(padded, lens, plan)
    if sort_rows:  # the layout GroupingCollate builds: rows already in plan order
        batch = GroupedBatch(padded[plan.order], lens[plan.order][:, None], plan)
    for x, mask, sizes, rows in zip(
        batch.group_inputs(), batch.group_masks(), plan.lengths, plan.rows, strict=True
    ):
        assert x.shape == (rows, sizes[0], 3) and mask.shape == (rows, sizes[0])
    out = batch.run(lambda x: x * 2)
    for i, L in enumerate(lengths):
        torch.testing.assert_close(out[i, :L], padded[i, :L] * 2)


def test_collate_dict_samples_in_a_worker_process() -> None:
    data = [{"tokens": torch.arange(n), "label": n % 2} for n in (3, 1, 5, 2, 4, 6)]
    collate = GroupingCollate(key="tokens", overhead=0.0)
    loader = DataLoader(data, batch_size=6, collate_fn=collate, num_workers=1)
    (batch,) = list(loader)
    assert batch.extras["label"].tolist() == [1, 1, 1, 0, 0, 0]
    out = batch.run(lambda x: x.sum(1))
    assert out.tolist() == [3, 0, 10, 1, 6, 15]
