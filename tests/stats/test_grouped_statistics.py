"""Per-example statistics and hook-mode GraB on grouped batches (``grabkit.group``).

A grouped batch calls the model once per length group; the grouped runner tells the engine which
items each call's rows hold, so every read describes the batch's items in the batch's order.
References: per-item ``torch.autograd.grad`` in float64 (each item run alone, unpadded), the
padded run's statistics, and, for GraB, a sampler fed those per-item gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from grabkit.group import (
    AnnotatedModule,
    DataCollection,
    GroupingCollate,
    LengthThresholdGrouper,
    UniGrouper,
    backward_by_group,
    group_batch,
    plan_from_partition,
    plan_groups,
    run_grouped,
)
from grabkit.order import GraBSampler
from grabkit.stats import PerSampleStats, SketchedStats

pytestmark = pytest.mark.usefixtures("float64")

VOCAB, WIDTH = 11, 6
LENGTHS = [3, 9, 1, 5, 9, 2, 7, 4]
ENTRY_POINTS = ["run", "run_grouped", "collate", "buckets", "backward_by_group"]


class MaskedMax(nn.Module):
    """Embedding, a Linear over positions, a masked max and a head: one output per item (the
    fill is finite, so that a padding row of no item, all masked, gets a zero gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(x))).masked_fill(~mask[..., None], -1e4)
        return self.head(h.max(1).values)[:, 0]


class TiedRecurrent(nn.Module):
    """Tied embedding and head, LayerNorm and a batch-first GRU, masked mean: one row of
    logits per item (the tied table's per-item gradient sums two uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.norm(self.emb(x)))
        m = mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def item_loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(n,) per-item losses."""
    if kind == "masked_max":
        return (out - target) ** 2
    return F.cross_entropy(out, target, reduction="none")


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MaskedMax() if kind == "masked_max" else TiedRecurrent()


def items(lengths: list[int], kind: str, seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    if kind == "masked_max":
        targets = torch.randn(len(lengths), generator=gen)
    else:
        targets = torch.randint(0, VOCAB, (len(lengths),), generator=gen)
    return tokens, targets


def per_item_gradients(hooked: nn.Module, kind: str, tokens, targets) -> torch.Tensor:
    """(n, d): each item run alone (unpadded) through ``torch.autograd.grad``, on an unhooked
    copy of ``hooked``."""
    model = make(kind)
    model.load_state_dict(hooked.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for x, t in zip(tokens, targets, strict=True):
        out = model(x[None], torch.ones(1, len(x), dtype=torch.bool))
        (loss,) = item_loss(kind, out, t[None])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def grouped_backward(entry: str, model: nn.Module, kind: str, tokens, targets) -> None:
    """The batch's mean loss backward through one of grabkit.group's entry points."""
    lengths = torch.tensor([len(x) for x in tokens])
    padded = pad_sequence(tokens, batch_first=True)
    plan = plan_from_partition([[0, 3, 6], [1, 4], [2, 5, 7]], lengths)
    if entry == "run":
        out = group_batch(padded, lengths, plan).run(model, pass_mask=True)
    elif entry == "run_grouped":  # the output lengths probed by calls of the model too
        out, _ = run_grouped(model, padded, lengths, plan=plan, pass_mask=True, return_lengths=True)
    elif entry == "collate":  # rows padded in group order (each group a slice), plan by the DP
        batch = GroupingCollate(overhead=0.0, alpha=0.0)(list(zip(tokens, targets, strict=True)))
        assert len(batch.plan) > 1
        out = batch.run(model, pass_mask=True)
    elif entry == "buckets":  # groups padded with rows of no item
        plan = plan_groups(lengths, alpha=0.0, size_buckets=[3, 8])
        assert any(r > len(g) for r, g in zip(plan.rows, plan.groups, strict=True))
        out = group_batch(padded, lengths, plan).run(model, pass_mask=True)
    else:
        batch = group_batch(padded, lengths, plan)
        backward_by_group(model, batch, lambda o, i: item_loss(kind, o, targets[i]), pass_mask=True)
        return
    item_loss(kind, out, targets).mean().backward()


def _tiering(entry: str, kind: str) -> object:
    """The recurrent model's other entry points in the slow tier (each costs seconds)."""
    slow = kind == "tied_recurrent" and entry not in ("run", "backward_by_group")
    return pytest.param(entry, kind, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(
    ("entry", "kind"),
    [_tiering(e, k) for e in ENTRY_POINTS for k in ("masked_max", "tied_recurrent")],
)
def test_grouped_statistics_equal_per_item_autograd(entry, kind, reference_tools):
    model = make(kind)
    tokens, targets = items(LENGTHS, kind)
    reference = per_item_gradients(model, kind, tokens, targets)
    with PerSampleStats(model, loss_reduction="mean") as stats:
        grouped_backward(entry, model, kind, tokens, targets)
        reference_tools.assert_matches(stats, reference)
        torch.testing.assert_close(
            torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * len(LENGTHS),
            reference.sum(0),
        )


@pytest.mark.parametrize("entry", ["run", "backward_by_group"])
def test_grouped_statistics_equal_the_padded_runs(entry):
    model = make("tied_recurrent")
    tokens, targets = items(LENGTHS, "tied_recurrent")
    with PerSampleStats(model) as stats:
        padded = pad_sequence(tokens, batch_first=True)
        mask = torch.arange(padded.shape[1])[None] < torch.tensor(LENGTHS)[:, None]
        item_loss("tied_recurrent", model(padded, mask), targets).mean().backward()
        padded_norms, padded_gram = stats.norms_squared(), stats.gram()
        model.zero_grad()
        grouped_backward(entry, model, "tied_recurrent", tokens, targets)
        torch.testing.assert_close(stats.norms_squared(), padded_norms)
        torch.testing.assert_close(stats.gram(), padded_gram)


@pytest.mark.parametrize("kind", ["masked_max", "tied_recurrent"])
@pytest.mark.parametrize("entry", ["run", "buckets", "backward_by_group"])
def test_grouped_sketches_equal_the_map_on_per_item_autograd(entry, kind):
    model = make(kind)
    tokens, targets = items(LENGTHS, kind)
    reference = per_item_gradients(model, kind, tokens, targets)
    with SketchedStats(model, dim=16, seed=4) as stats:
        grouped_backward(entry, model, kind, tokens, targets)
        sketches = stats.sketches()
        expected = reference @ stats.sketch.matrix().T
    assert sketches.shape == (len(LENGTHS), 16)
    torch.testing.assert_close(sketches, expected, rtol=1e-10, atol=1e-10 * expected.abs().max())


N, BATCH = 18, 6


def grab_run(entry: str, statistics: str) -> tuple[list[list[int]], list[list[int]]]:
    """Three epochs of hook-mode GraB on grouped batches beside a sampler given per-item
    autograd gradients (or their sketches) of the same batches: both samplers' orders."""
    model = make("masked_max")
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 12, (N,), generator=gen).tolist()
    tokens, targets = items(lengths, "masked_max", seed=6)
    data = list(zip(tokens, targets, strict=True))
    options = {"statistics": "sketch", "sketch_dim": 16} if statistics == "sketch" else {}
    hooked = GraBSampler(
        data, model=model, balance_type="pair", batch_size=BATCH, record_orders=True, **options
    )
    given = GraBSampler(data, balance_type="pair", record_orders=True)
    loader = DataLoader(
        data, batch_size=BATCH, sampler=hooked, collate_fn=GroupingCollate(alpha=0.0)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(3):
        iter(given)  # the next epoch, as the loader's iter() starts the hooked sampler's
        for batch in loader:
            ids = batch.extras  # targets in the batch's item order
            visit = [data_index(data, t) for t in ids]
            reference = per_item_gradients(model, "masked_max", [tokens[i] for i in visit], ids)
            opt.zero_grad()
            if entry == "run":
                item_loss("masked_max", batch.run(model, pass_mask=True), ids).mean().backward()
            else:
                backward_by_group(
                    model, batch, lambda o, i, t=ids: item_loss("masked_max", o, t[i]),
                    pass_mask=True,
                )  # fmt: skip
            hooked.step()
            if statistics == "sketch":
                reference = hooked.stats.sketch.apply_dense(reference)
            given.step(reference)
            opt.step()
    iter(hooked), iter(given)  # the order the third epoch decided
    hooked.close()
    return hooked.orders_history, given.orders_history


def data_index(data, target: torch.Tensor) -> int:
    """The dataset index of the item whose (distinct, random) target is ``target``."""
    return next(i for i, (_, t) in enumerate(data) if bool(t == target))


@pytest.mark.parametrize("statistics", ["exact", "sketch"])
@pytest.mark.parametrize("entry", ["run", "backward_by_group"])
def test_hook_mode_grab_on_grouped_batches_decides_on_the_right_items(entry, statistics):
    hooked, given = grab_run(entry, statistics)
    assert hooked == given
    assert len({tuple(o) for o in hooked}) > 1  # the orders did change


class AnnotatedPool(AnnotatedModule):
    """asym's API: a Linear per position, then a masked mean, (b, l_seq, m_in) -> (b, m_out)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 6), nn.LayerNorm(6)

    def forward(self, x, mask):
        h = self.norm(torch.tanh(self.linear(x)))
        m = mask[..., None].to(h.dtype)
        return {"pooled": (h * m).sum(1) / m.sum(1).clamp_min(1)}

    def get_input_annot(self):
        return "(b, l_seq, m_in)"

    def get_output_annot(self):
        return {"pooled": "(b, m_out)"}

    def get_mask_hint(self):
        return ["seq"]


def test_data_collection_apply_statistics_equal_per_item_autograd(reference_tools):
    torch.manual_seed(0)
    module = AnnotatedPool()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 4, generator=gen) for n in LENGTHS]
    params = list(module.parameters())
    rows = []
    for x in xs:
        (pooled,) = module(x[None], torch.ones(1, len(x), dtype=torch.bool))["pooled"]
        grads = torch.autograd.grad(pooled.square().sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    reference = torch.stack(rows)
    with PerSampleStats(module, loss_reduction="sum") as stats:
        dc = DataCollection("(B, L_seq, M_in)", xs)
        dc.group(LengthThresholdGrouper("seq", [2, 5]))
        assert len(dc.data_groups) == 3
        out = dc.apply(module)["pooled"]
        out.regroup(UniGrouper())  # one group in item order
        out.data_groups[0].value.square().sum().backward()
        reference_tools.assert_matches(stats, reference)


class Checkpointed(nn.Module):
    """MaskedMax with its Linear over positions under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = make("masked_max"), reentrant

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        e = inner.emb(x)
        h = torch.utils.checkpoint.checkpoint(inner.mix, e, use_reentrant=self.reentrant)
        h = torch.tanh(h).masked_fill(~mask[..., None], -1e4)
        return inner.head(h.max(1).values)[:, 0]


@pytest.mark.parametrize(
    ("entry", "reentrant"),
    [("run", False), ("backward_by_group", False), ("backward_by_group", True)],
)
def test_activation_checkpointing_in_grouped_batches(entry, reentrant, reference_tools):
    model = Checkpointed(reentrant)
    tokens, targets = items(LENGTHS, "masked_max")
    reference = per_item_gradients(model.inner, "masked_max", tokens, targets)
    with PerSampleStats(model) as stats:
        grouped_backward(entry, model, "masked_max", tokens, targets)
        reference_tools.assert_matches(stats, reference)


def test_reentrant_recomputation_after_the_grouped_run_is_refused():
    model = Checkpointed(reentrant=True)
    tokens, targets = items(LENGTHS, "masked_max")
    with (
        PerSampleStats(model),
        pytest.raises(ValueError, match="use_reentrant=False, or backward_by_group"),
    ):
        grouped_backward("run", model, "masked_max", tokens, targets)


def test_model_called_per_group_without_the_grouped_runner_is_refused():
    model = make("masked_max")
    tokens, targets = items(LENGTHS, "masked_max")
    lengths = torch.tensor(LENGTHS)
    padded = pad_sequence(tokens, batch_first=True)
    plan = plan_from_partition([[0, 3, 6], [1, 4], [2, 5, 7]], lengths)
    batch = group_batch(padded, lengths, plan)
    with PerSampleStats(model) as stats:
        outs = [model(x, m) for x, m in zip(batch.group_inputs(), batch.group_masks(), strict=True)]
        item_loss("masked_max", batch.merge(outs), targets).mean().backward()
        with pytest.raises(ValueError, match=r"group by group.*run_grouped"):
            stats.norms_squared()


class TablePositions(nn.Module):
    """Token vectors plus a Linear on a (T, d) sinusoidal table the forward makes without
    autograd (shared by the items), masked sum and a head: one output per item."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.table = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        frequencies = 10.0 ** -(torch.arange(WIDTH, dtype=e.dtype) / WIDTH)
        table = torch.sin(torch.arange(x.shape[1], dtype=e.dtype)[:, None] * frequencies)
        h = torch.tanh(e + self.table(table)) * mask[..., None]
        return self.head(h.sum(1))[:, 0]


@pytest.mark.parametrize("partition", [[[0, 1, 2], [3, 4]], [[0, 1], [2, 3, 4]]])
def test_a_table_made_in_the_forward_of_a_group_as_many_as_its_rows(partition, reference_tools):
    """A group whose padded length equals its number of rows (three items of length 3) makes a
    (3, d) table that looks like one row per item: refused, as for an ordinary batch (11.6% off
    in the norms on the old code, silently); grouped otherwise, exact."""
    torch.manual_seed(0)
    model, lengths = TablePositions(), [3, 3, 3, 5, 5]
    tokens, _ = items(lengths, "masked_max")
    ones = [torch.ones(1, n, dtype=torch.bool) for n in lengths]
    params = list(model.parameters())
    reference = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[None], m), params)])
            for x, m in zip(tokens, ones, strict=True)
        ]
    )
    plan = plan_from_partition(partition, lengths)
    batch = group_batch(pad_sequence(tokens, batch_first=True), torch.tensor(lengths), plan)
    with PerSampleStats(model, "sum") as stats:
        if len(partition[0]) == 3:
            with pytest.raises(ValueError, match=r"'table'.*T == B"):
                batch.run(model, pass_mask=True)
            return
        batch.run(model, pass_mask=True).sum().backward()
        reference_tools.assert_matches(stats, reference)


class GroupsInside(nn.Module):
    """A model whose own forward runs its padded batch group by group (positions shared by the
    batch inside each group), then a head on the merged output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(16, WIDTH)
        self.mix, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def body(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(x) + self.pos(torch.arange(x.shape[1]))))
        m = mask[..., None].to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, padded: torch.Tensor, lengths: torch.Tensor, plan=None) -> torch.Tensor:
        pooled = run_grouped(self.body, padded, lengths, plan=plan, pass_mask=True)
        return self.head(pooled)[:, 0]


def test_a_model_that_groups_inside_its_forward_is_exact(reference_tools):
    torch.manual_seed(0)
    model = GroupsInside()
    tokens, targets = items(LENGTHS, "masked_max")
    params = list(model.parameters())
    rows = []
    for x, t in zip(tokens, targets, strict=True):
        loss = (model(x[None], torch.tensor([len(x)]))[0] - t) ** 2
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    reference = torch.stack(rows)
    lengths = torch.tensor(LENGTHS)
    plan = plan_from_partition([[0, 3, 6], [1, 4], [2, 5, 7]], lengths)
    with PerSampleStats(model, loss_reduction="sum") as stats:
        out = model(pad_sequence(tokens, batch_first=True), lengths, plan)
        ((out - targets) ** 2).sum().backward()
        reference_tools.assert_matches(stats, reference)


def test_a_forward_before_the_grouped_run_is_refused():
    model = make("masked_max")
    tokens, _ = items(LENGTHS, "masked_max")
    lengths = torch.tensor(LENGTHS)
    padded = pad_sequence(tokens, batch_first=True)
    mask = torch.arange(padded.shape[1])[None] < lengths[:, None]
    with PerSampleStats(model) as stats:
        plain = model(padded, mask)
        grouped = run_grouped(model, padded, lengths, pass_mask=True, planning={"alpha": 0.0})
        (grouped + plain).sum().backward()
        with pytest.raises(ValueError, match="before the grouped batch's run"):
            stats.norms_squared()


class SplitTied(TiedRecurrent):
    """TiedRecurrent called in two parts: the body (grouped) and the tied head on its output."""

    def body(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.norm(self.emb(x)))
        m = mask[..., None].to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def split_reference(model: SplitTied, tokens, targets) -> torch.Tensor:
    params = list(model.parameters())
    rows = []
    for x, t in zip(tokens, targets, strict=True):
        out = model(x[None], torch.ones(1, len(x), dtype=torch.bool))
        (loss,) = item_loss("tied_recurrent", out, t[None])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def split_backward(entry: str, model: SplitTied, tokens, targets) -> None:
    """The body through a grouped runner, the head on its (merged or trimmed) output."""
    lengths = torch.tensor(LENGTHS)
    padded = pad_sequence(tokens, batch_first=True)
    plan = plan_from_partition([[0, 3, 6], [1, 4], [2, 5, 7]], lengths)
    if entry != "run":  # groups padded with rows of no item
        plan = plan_groups(lengths, alpha=0.0, size_buckets=[3, 8])
    batch = group_batch(padded, lengths, plan)
    if entry == "backward_by_group":  # the head inside loss_fn, on the trimmed rows
        backward_by_group(
            model.body, batch,
            lambda o, i: item_loss("tied_recurrent", model.head(o), targets[i]),
            pass_mask=True,
        )  # fmt: skip
        return
    logits = model.head(batch.run(model.body, pass_mask=True))
    item_loss("tied_recurrent", logits, targets).mean().backward()


@pytest.mark.parametrize("entry", ["run", "buckets", "backward_by_group"])
def test_a_head_on_the_merged_output_is_exact(entry, reference_tools):
    """Layers called outside the groups after the run hold the whole batch in item order; the
    tied table's per-item gradient sums its group's part (embedding) and the head's."""
    torch.manual_seed(0)
    model = SplitTied()
    tokens, targets = items(LENGTHS, "tied_recurrent")
    reference = split_reference(model, tokens, targets)
    with PerSampleStats(model) as stats:
        split_backward(entry, model, tokens, targets)
        reference_tools.assert_matches(stats, reference)


@pytest.mark.parametrize("entry", ["run", "backward_by_group"])
def test_a_head_on_the_merged_output_is_sketched_exactly(entry):
    torch.manual_seed(0)
    model = SplitTied()
    tokens, targets = items(LENGTHS, "tied_recurrent")
    reference = split_reference(model, tokens, targets)
    with SketchedStats(model, dim=16, seed=4) as stats:
        split_backward(entry, model, tokens, targets)
        sketches = stats.sketches()
        expected = reference @ stats.sketch.matrix().T
    torch.testing.assert_close(sketches, expected, rtol=1e-10, atol=1e-10 * expected.abs().max())


def test_two_grouped_batches_in_one_step_are_refused():
    model = make("masked_max")
    tokens, _ = items(LENGTHS, "masked_max")
    lengths = torch.tensor(LENGTHS)
    padded = pad_sequence(tokens, batch_first=True)
    with PerSampleStats(model):
        run_grouped(model, padded, lengths, pass_mask=True)
        with pytest.raises(ValueError, match="two grouped batches"):
            run_grouped(model, padded, lengths, pass_mask=True)


@pytest.mark.slow
def test_transformers_body_grouped_inside_the_model_is_exact(reference_tools):
    """grabkit.integrations' GroupedForward runs a transformers model's body group by group on a
    right-padded batch; the head and the loss run on the merged output."""
    pytest.importorskip("transformers")
    from tests.integrations.tiny import pad_right, ragged_lm_dataset, tiny_gpt2

    from grabkit.integrations.grouped_forward import GroupedForward

    model = tiny_gpt2(n_positions=32).double()
    rows = ragged_lm_dataset()[:6]

    def token_losses(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        per_token = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        return per_token.sum(dim=1)  # (n,) each row's summed token losses

    params = list(model.parameters())
    reference = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(token_losses(pad_right([r]))[0], params)
                ]
            )
            for r in rows
        ]
    )
    with (
        PerSampleStats(model, loss_reduction="sum") as stats,
        GroupedForward(model, alpha=0.0) as grouped,
    ):
        token_losses(pad_right(rows)).sum().backward()
        assert grouped.groups_run > 1
        reference_tools.assert_matches(stats, reference)


@pytest.mark.parametrize(("ours", "theirs"), [("mean", "mean"), ("sum", "sum"), ("sum", "mean")])
def test_backward_by_group_under_the_statistics_reduction_is_exact(ours, theirs, reference_tools):
    """A sum whose ``loss_fn`` divides by the count is the mean ``"mean"`` statistics expect."""
    model = make("masked_max")
    tokens, targets = items(LENGTHS, "masked_max")
    reference = per_item_gradients(model, "masked_max", tokens, targets)
    lengths = torch.tensor(LENGTHS)
    batch = group_batch(pad_sequence(tokens, batch_first=True), lengths, plan_groups(lengths))
    share = 1.0 / len(LENGTHS) if (ours, theirs) == ("sum", "mean") else 1.0
    with PerSampleStats(model, loss_reduction=theirs) as stats:
        backward_by_group(
            model, batch, lambda o, i: item_loss("masked_max", o, targets[i]) * share,
            pass_mask=True, reduction=ours,
        )  # fmt: skip
        reference_tools.assert_matches(stats, reference)


@pytest.mark.parametrize("statistics", ["exact", "sketch", "grab"])
def test_backward_by_group_taking_the_mean_under_sum_statistics_is_refused(statistics):
    """backward_by_group's mean under statistics told the loss is a sum would scale every
    item's gradient by 1/n (its norms by 1/n^2: 96% off for 5 items, silently on the old
    code): refused at read, naming both."""
    model = make("masked_max")
    tokens, targets = items(LENGTHS[:5], "masked_max")
    lengths = torch.tensor(LENGTHS[:5])
    batch = group_batch(pad_sequence(tokens, batch_first=True), lengths, plan_groups(lengths))
    if statistics == "grab":
        data = list(zip(tokens, targets, strict=True))
        hooked = GraBSampler(data, model=model, batch_size=5, loss_reduction="sum")
        read, close = hooked.step, hooked.close
        iter(hooked)
    else:
        if statistics == "exact":
            stats = PerSampleStats(model, loss_reduction="sum")
            read = stats.norms_squared
        else:
            stats = SketchedStats(model, dim=16, seed=4, loss_reduction="sum")
            read = stats.sketches
        close = stats.close
    try:
        backward_by_group(
            model, batch, lambda o, i: item_loss("masked_max", o, targets[i]), pass_mask=True
        )
        with pytest.raises(ValueError, match=r"reduction='mean'.*loss_reduction='sum'"):
            read()
    finally:
        close()
