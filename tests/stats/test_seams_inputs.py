"""A model called on its batch inside a container (``model(batch)`` with a dict, a list, a tuple
of tensors): the examples are dim 0 of the first tensor in it, and everything the engine does
at the model's input (a new step, following the trainable set, watching for functional uses,
telling inputs shared by the batch from per-example ones) happens as for a bare tensor; checked
against per-example ``torch.autograd.grad`` in float64.
"""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats

pytestmark = pytest.mark.usefixtures("float64")

B, VOCAB, WIDTH = 4, 9, 5

CONTAINERS = {
    "dict": lambda ids: {"ids": ids},
    "list": lambda ids: [ids],
    "tuple": lambda ids: (ids,),
    "nested": lambda ids: {"inputs": [ids, ids.shape]},
    "UserDict": lambda ids: UserDict(ids=ids),
}


def ids_of(batch) -> torch.Tensor:
    """The (B, T) token ids inside any of ``CONTAINERS``."""
    if isinstance(batch, (dict, UserDict)):
        batch = batch.get("ids", batch.get("inputs"))
    return batch[0] if isinstance(batch, (list, tuple)) else batch


class Positions(nn.Module):
    """Token and position embeddings: the positions, ``arange(T)``, are shared by the batch;
    with T == B they are told apart from the examples only by the model's input."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(8, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, batch) -> torch.Tensor:
        ids = ids_of(batch)
        h = torch.tanh(self.mix(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))))
        return F.linear(h, self.tokens.weight) if self.tied else h


def rows_of_examples(model: nn.Module, loss_of_example) -> torch.Tensor:
    """(B, d): ``torch.autograd.grad`` of ``loss_of_example(i)``, example i run alone, over the
    trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_of_example(i), params)])
        for i in range(B)
    ]
    return torch.stack(rows)


def assert_exact(model: nn.Module, loss_of, reference_tools) -> None:
    """The hooks' statistics of ``loss_of(slice(None))`` (the whole batch) equal the per-example
    reference, ``loss_of(slice(i, i + 1))`` run for each example alone."""
    expected = rows_of_examples(model, lambda i: loss_of(slice(i, i + 1)))
    with PerSampleStats(model, "sum") as stats:
        loss_of(slice(None)).backward()
        reference_tools.assert_matches(stats, expected)


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_shared_positions_of_a_batch_in_a_container_are_exact(container, reference_tools):
    """Reading raised on the old code (the positions counted as T examples)."""
    torch.manual_seed(0)
    model, wrap, ids = Positions(), CONTAINERS[container], torch.randint(0, VOCAB, (B, B + 2))
    assert_exact(model, lambda rows: model(wrap(ids[rows])).square().sum(), reference_tools)


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_positions_as_many_as_the_examples_are_refused_as_for_a_bare_tensor(container):
    """With T == B the positions were taken for examples silently on the old code (2-5% off in
    the norms); a bare tensor input had them refused already."""
    torch.manual_seed(0)
    model, wrap = Positions(), CONTAINERS[container]
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="shared by all of them"):
        model(wrap(torch.randint(0, VOCAB, (B, B))))


def test_a_tied_head_of_a_model_called_on_a_dict_is_computed(reference_tools):
    """The functional-use watch runs for a dict input too (the identity check raised)."""
    torch.manual_seed(0)
    model, wrap, ids = Positions(tied=True), CONTAINERS["dict"], torch.randint(0, VOCAB, (B, 3))
    assert_exact(model, lambda rows: model(wrap(ids[rows])).square().sum(), reference_tools)


def test_parameters_unfrozen_later_are_followed_for_a_dict_input(reference_tools):
    """Left out of every g_i silently on the old code (37% off in the norms)."""
    torch.manual_seed(0)
    model = Positions()
    model.mix.requires_grad_(False)
    ids, wrap = torch.randint(0, VOCAB, (B, 3)), CONTAINERS["dict"]
    with PerSampleStats(model, "sum") as stats:
        model(wrap(ids)).square().sum().backward()
        stats.norms_squared()
        model.mix.requires_grad_(True)
        expected = rows_of_examples(model, lambda i: model(wrap(ids[i : i + 1])).square().sum())
        model.zero_grad()
        model(wrap(ids)).square().sum().backward()
        assert "mix.weight" in stats.param_shapes
        reference_tools.assert_matches(stats, expected)


class TimeConditioned(nn.Module):
    """A model called as ``model(t, x)`` with a 0-dim time ``t`` first (a diffusion step): ``t``
    holds no examples, ``x`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x) * t))


def test_a_zero_dim_first_input_is_passed_over_for_the_batch(reference_tools):
    """The examples are dim 0 of the first input that has a dim 0. A 0-dim first input was taken
    for no batch at all: the layers were refused as "called outside the model's forward"."""
    torch.manual_seed(0)
    model, t, x = TimeConditioned(), torch.tensor(0.7), torch.randn(B, WIDTH)
    assert_exact(model, lambda rows: model(t, x[rows]).square().sum(), reference_tools)


class Scaled(nn.Module):
    """The first layer reads a scaled copy of the input, not the input itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x * 2.0)))


def test_an_input_refilled_in_place_before_the_read_is_refused():
    """A loop that refills its input buffer (``x.copy_(next_batch)``) between the backward and
    the read: the first layer's kept input is that buffer, so the statistics described the new
    values without a word (32% off in the norms with the identity check off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))
    x = torch.randn(B, WIDTH)
    with PerSampleStats(model, "sum", check_identity=False) as stats:
        model(x).square().sum().backward()
        x.copy_(torch.randn(B, WIDTH))
        with pytest.raises(ValueError, match=r"model's input .* changed in place"):
            stats.norms_squared()


def test_an_input_changed_in_place_that_no_layer_kept_is_harmless(reference_tools):
    """Where every layer keeps a tensor of its own (here ``x * 2``), refilling ``x`` changes no
    statistic, and the read goes on."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(B, WIDTH)
    expected = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(
                        model(x[i : i + 1]).square().sum(), list(model.parameters())
                    )
                ]
            )
            for i in range(B)
        ]
    )
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        x.mul_(3.0)
        reference_tools.assert_matches(stats, expected)


class ClampsItsInput(nn.Module):
    """A forward that changes its own input in place before its first layer reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.clamp_(-0.5, 0.5))


def test_a_forward_that_changes_its_own_input_is_read_as_usual(reference_tools):
    """The input's version is taken when the model's forward ends, not when it starts."""
    torch.manual_seed(0)
    model, x = ClampsItsInput(), torch.randn(B, WIDTH)
    expected = rows_of_examples(model, lambda i: model(x[i : i + 1].clone()).square().sum())
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, expected)


class PositionsGiven(nn.Module):
    """Position ids passed to the model beside the tokens, as Hugging Face models take them:
    one (T,) row shared by the batch, or a (B, T) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(8, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids) + self.positions(position_ids)
        return self.head(torch.tanh(h)).mean(dim=1)


@pytest.mark.parametrize("first", ["input_ids", "position_ids"])
def test_given_positions_as_many_as_the_examples_are_refused(first):
    """A (T,) position row given as a model input with T == B: its dim 0 has the batch size by
    chance, and each position's embedding row was taken for one example's (0.5% off in the
    norms on the old code, whichever input came first); with T != B it was refused already."""
    torch.manual_seed(0)
    model = PositionsGiven()
    ids, positions = torch.randint(0, VOCAB, (B, B)), torch.arange(B)
    kwargs = {"input_ids": ids, "position_ids": positions}
    if first == "position_ids":
        kwargs = dict(reversed(kwargs.items()))
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'positions'.*T == B"):
        model(**kwargs)


def test_given_positions_with_a_batch_dim_are_exact(reference_tools):
    """The fix the refusal names: positions expanded to (B, T) hold one row per example."""
    torch.manual_seed(0)
    model = PositionsGiven()
    ids = torch.randint(0, VOCAB, (B, B))
    positions = torch.arange(B).expand(B, -1)
    assert_exact(
        model, lambda rows: model(ids[rows], positions[rows]).square().sum(), reference_tools
    )


def test_a_column_of_the_first_input_holds_the_examples(reference_tools):
    """A view of the model's input along its examples (``x[:, 0]``, fewer dims than the input,
    B == T) stays a per-example input; a row of it (``x[0]``) would not, and is refused."""
    torch.manual_seed(0)

    class FirstToken(nn.Module):
        def __init__(self, row: bool) -> None:
            super().__init__()
            self.row = row
            self.tokens, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            picked = ids[0] if self.row else ids[:, 0]
            return self.head(torch.tanh(self.tokens(picked)))

    ids = torch.randint(0, VOCAB, (B, B))
    model = FirstToken(row=False)
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)
    model_row = FirstToken(row=True)
    with PerSampleStats(model_row, "sum"), pytest.raises(ValueError, match="T == B"):
        model_row(ids)


class ImageAndTable(nn.Module):
    """An image through a convolution beside a (B, f) vector of features through a Linear."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.table = nn.Conv2d(channels, WIDTH, 3), nn.Linear(3, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, image: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(image)).mean(dim=(2, 3)) + self.table(table))


@pytest.mark.parametrize(("channels", "side"), [(B, 6), (2, B + 2)])
def test_a_narrower_input_beside_an_image_with_the_batch_size_in_it_is_exact(
    channels, side, reference_tools
):
    """(B, f) features beside (B, C, H, W) images where C == B or W == B: the features cannot
    be broadcast along the image's C or W, so their dim 0 holds the examples (refused on the
    old code, which refused any input of fewer dims than one holding B elsewhere)."""
    torch.manual_seed(0)
    model = ImageAndTable(channels)
    image, table = torch.randn(B, channels, side, B), torch.randn(B, 3)
    assert_exact(
        model, lambda rows: model(image[rows], table[rows]).square().sum(), reference_tools
    )


class EmbeddedTokens(nn.Module):
    """Token vectors given outright, (B, T, d), beside (B, T) token type ids (Hugging Face's
    ``inputs_embeds`` with ``token_type_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.types, self.head = nn.Embedding(2, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, inputs_embeds: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(inputs_embeds + self.types(token_type_ids))).mean(dim=1)


def test_token_types_beside_given_token_vectors_with_t_equal_to_b_are_exact(reference_tools):
    torch.manual_seed(0)
    model = EmbeddedTokens()
    vectors, types = torch.randn(B, B, WIDTH), torch.randint(0, 2, (B, B))
    assert_exact(
        model, lambda rows: model(vectors[rows], types[rows]).square().sum(), reference_tools
    )


class PositionsExpanded(PositionsGiven):
    """(T,) position ids given, expanded to (B, T) by the model itself: every row the same."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, position_ids.expand(input_ids.shape[0], -1))


def test_given_positions_expanded_by_the_model_are_exact(reference_tools):
    torch.manual_seed(0)
    model = PositionsExpanded()
    ids, positions = torch.randint(0, VOCAB, (B, B)), torch.arange(B)
    assert_exact(model, lambda rows: model(ids[rows], positions).square().sum(), reference_tools)


class Labelled(nn.Module):
    """Token ids and one label per example, passed labels first (the label unused here)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, labels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(input_ids))).mean(dim=1)


def test_ids_sharing_a_buffer_with_their_labels_are_exact(reference_tools):
    """Ids and labels cut from one collated (B, T + 1) buffer share its storage: the ids are
    a view of it along the examples whichever input came first."""
    torch.manual_seed(0)
    model = Labelled()
    buffer = torch.randint(0, VOCAB, (B, B + 1))
    labels, ids = buffer[:, -1], buffer[:, :-1]
    assert_exact(model, lambda rows: model(labels[rows], ids[rows]).square().sum(), reference_tools)


class ShiftedPositions(PositionsGiven):
    """Labels first, then tokens and (T,) position ids, which the model offsets (a copy)."""

    def forward(self, labels, input_ids, position_ids):  # type: ignore[override]
        return super().forward(input_ids, position_ids + 1)


def test_a_copy_of_given_positions_behind_a_one_dim_first_input_is_refused():
    """The first input, (B,) class labels, has no other dim, but the tokens beside it do
    (T == B): a (T,) copy of the position ids made in the forward is as ambiguous as after
    (B, T) tokens (12.8% off in the norms on the old code)."""
    torch.manual_seed(0)
    model = ShiftedPositions()
    ids, positions = torch.randint(0, VOCAB, (B, B)), torch.arange(B)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'positions'.*T == B"):
        model(torch.zeros(B, dtype=torch.long), ids, positions)


class UserAndItems(nn.Module):
    """A recommender: one user id per example beside (B, T) item ids."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(VOCAB, WIDTH), nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        user = self.users(users).reshape(items.shape[0], 1, WIDTH)
        return self.head(torch.tanh(self.items(items) + user)).mean(dim=1)


def test_one_id_per_example_beside_t_equal_to_b_is_refused_naming_a_trailing_dim(
    reference_tools,
):
    """(B,) user ids beside (B, T) items with T == B cannot be told from (T,) positions: the
    refusal says how to pass them, and (B, 1) user ids are exact."""
    torch.manual_seed(0)
    model = UserAndItems()
    items, users = torch.randint(0, VOCAB, (B, B)), torch.randint(0, VOCAB, (B,))
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"\(B, 1\)"):
        model(items, users)
    users = users[:, None]
    assert_exact(
        model, lambda rows: model(items[rows], users[rows]).square().sum(), reference_tools
    )


@pytest.mark.parametrize("length", [B, B + 2])
def test_given_positions_of_one_row_are_shared_by_the_batch(length, reference_tools):
    """(1, T) position ids given as a model input, the shape Hugging Face models make
    themselves: dim 0 broadcasts over the examples, so they are shared by the batch (refused on
    the old code as "computed from the model's input", at any T)."""
    torch.manual_seed(0)
    model = PositionsGiven()
    ids, positions = torch.randint(0, VOCAB, (B, length)), torch.arange(length)[None]
    assert_exact(model, lambda rows: model(ids[rows], positions).square().sum(), reference_tools)


class MadeInForward(nn.Module):
    """An Embedding on a tensor the forward makes without autograd, of shape (B, T) with T == B:
    zero token types, one row per example (BERT's when none are given), or (T, T) relative
    positions shared by the batch, broadcast against (B, T, T, d), unsqueezed, or permuted (T5's
    bias)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.tokens, self.kinds = nn.Embedding(VOCAB, WIDTH), nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tokens(ids)  # (B, T, d)
        if self.use == "types":
            return self.head(torch.tanh(h + self.kinds(torch.zeros_like(ids)))).mean(dim=1)
        relative = torch.arange(t)[None, :] - torch.arange(t)[:, None] + t - 1  # (T, T), shared
        bias = self.kinds(relative)  # (T, T, d)
        if self.use == "broadcast":
            pairs = h[:, :, None, :] * h[:, None, :, :] + bias  # (B, T, T, d)
        elif self.use == "unsqueeze":
            pairs = h[:, :, None, :] * torch.tanh(bias).unsqueeze(0)
        else:
            pairs = h[:, :, None, :] * bias.permute(1, 0, 2).unsqueeze(0)
        return self.head(torch.tanh(pairs)).mean(dim=(1, 2))


def test_types_made_in_the_forward_as_many_as_the_examples_are_exact(reference_tools):
    """(B, T) zero token types made in the forward, T == B: one row per example, met by the
    tokens' (B, T, d) in dim 0, so exact (what a refusal by shape alone would have broken)."""
    torch.manual_seed(0)
    model, ids = MadeInForward("types"), torch.randint(0, VOCAB, (B, B))
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)


@pytest.mark.parametrize("use", ["broadcast", "permute", "unsqueeze"])
def test_relative_positions_made_in_the_forward_as_many_as_the_examples_are_refused(use):
    """(T, T) positions shared by the batch with T == B look like one row per example; the
    model's use of the output (a broadcast against more dims, a permute of dim 0) shows they
    are not: refused (silently wrong on the old code)."""
    torch.manual_seed(0)
    model = MadeInForward(use)
    refused = r"'kinds'.*(moves its dim 0|more dims)"
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=refused):
        model(torch.randint(0, VOCAB, (B, B)))


@pytest.mark.parametrize("use", ["broadcast", "permute", "unsqueeze"])
def test_relative_positions_made_in_the_forward_are_shared_otherwise(use, reference_tools):
    torch.manual_seed(0)
    model, ids = MadeInForward(use), torch.randint(0, VOCAB, (B, B + 1))
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)


HEADS = 2


class FloatMadeInForward(nn.Module):
    """A Linear on a floating tensor the forward makes without autograd, shared by the batch: a
    (T, T, 1) relative-position feature, whose (T, T, H) output is permuted to (H, T, T) and
    added to the (B, H, T, T) attention scores, or a (T, d) sinusoidal table, whose output is
    added to the (B, T, d) token vectors (as it is, given a batch dim by ``[None]``, or expanded
    to (B, T, d)). With T == B its dim 0 has the batch size by chance."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.tokens, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2)
        if use.startswith("table"):
            self.table = nn.Linear(WIDTH, WIDTH)
        else:
            self.relative, self.query = nn.Linear(1, HEADS), nn.Linear(WIDTH, HEADS * WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tokens(ids)  # (B, T, d)
        if self.use.startswith("table"):
            frequencies = 10.0 ** -(torch.arange(WIDTH, dtype=h.dtype) / WIDTH)
            table = torch.sin(torch.arange(t, dtype=h.dtype)[:, None] * frequencies)  # (T, d)
            positions = self.table(table)
            if self.use == "table[None]":
                positions = positions[None]
            elif self.use == "table.expand":
                positions = positions.expand(b, -1, -1)
            return self.head(torch.tanh(h + positions)).mean(dim=1)
        offsets = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        bias = self.relative(offsets.to(h.dtype).unsqueeze(-1))  # (T, T, H)
        if self.use == "relative[..., :1].squeeze":
            bias = bias[..., :1].squeeze(-1)  # (T, T): one bias for every head
        elif self.use == "relative.sum":
            bias = bias.sum(dim=-1)
        else:
            bias = bias.permute(2, 0, 1)  # (H, T, T)
        q = self.query(h).view(b, t, HEADS, WIDTH).transpose(1, 2)  # (B, H, T, d)
        scores = q @ q.transpose(-1, -2) + bias
        return self.head((scores.softmax(dim=-1) @ q).mean(dim=1)).mean(dim=1)


RELATIVE_USES = ["relative", "relative[..., :1].squeeze", "relative.sum"]


@pytest.mark.parametrize("use", [*RELATIVE_USES, "table", "table[None]", "table.expand"])
def test_floats_made_in_the_forward_as_many_as_the_examples_are_refused(use):
    """A floating tensor shared by the batch, made in the forward, with T == B looks like one
    row per example; the model's use of the layer's output (a permute of its dim 0, a
    broadcast against more dims, also after an index, a squeeze or a sum that keep dim 0, new
    dims put in front of it) shows it is not: refused, naming the layer and the fix. On the old
    code the layer's own per-example norms were silently 98% (relative feature), 2302% (its
    index and squeeze), 94% (its sum) and 128% (sinusoidal table, also given a batch dim)
    off."""
    torch.manual_seed(0)
    model = FloatMadeInForward(use)
    refused = r"'(relative|table)'.*(moves its dim 0|more dims).*batch size that differs"
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=refused):
        model(torch.randint(0, VOCAB, (B, B)))


@pytest.mark.parametrize("use", ["relative", "table"])
def test_floats_made_in_the_forward_are_shared_otherwise(use, reference_tools):
    torch.manual_seed(0)
    model, ids = FloatMadeInForward(use), torch.randint(0, VOCAB, (B, B + 1))
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)


@pytest.mark.parametrize(
    "use", ["relative[..., :1].squeeze", "relative.sum", "table[None]", "table.expand"]
)
def test_an_index_or_an_expand_of_a_table_s_output_is_refused_otherwise_too(use):
    """With T != B the table's output is expanded to (B, ...) for the batch, and an index, a sum
    or an expand of it would change what the model computes: refused by that check instead."""
    torch.manual_seed(0)
    model = FloatMadeInForward(use)
    refused = r"'(relative|table)'.*shared by the batch"
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=refused):
        model(torch.randint(0, VOCAB, (B, B + 1)))


class RelativeWithMask(nn.Module):
    """``FloatMadeInForward("relative")`` with the bias first added to a tensor of its own
    shape that is not the examples either: a (T, T, 1) causal mask made in the forward, a slice
    of a (T, T, H) buffer, or a view of the (T, T, 1) feature itself. The bias is then permuted
    to (H, T, T) and added to the (B, H, T, T) scores, as before."""

    def __init__(self, other: str) -> None:
        super().__init__()
        self.other = other
        self.tokens, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2)
        self.relative, self.query = nn.Linear(1, HEADS), nn.Linear(WIDTH, HEADS * WIDTH)
        self.register_buffer("table", torch.randn(8, 8, HEADS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tokens(ids)
        offsets = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).to(h.dtype)[..., None]
        bias = self.relative(offsets)  # (T, T, H)
        if self.other == "mask":
            bias = bias + torch.triu(torch.full((t, t, 1), -1.0, dtype=h.dtype), diagonal=1)
        elif self.other == "buffer":
            bias = bias + self.table[:t, :t]
        else:
            bias = bias * offsets.tanh()
        q = self.query(h).view(b, t, HEADS, WIDTH).transpose(1, 2)  # (B, H, T, d)
        scores = q @ q.transpose(-1, -2) + bias.permute(2, 0, 1)
        return self.head((scores.softmax(dim=-1) @ q).mean(dim=1)).mean(dim=1)


@pytest.mark.parametrize("other", ["mask", "buffer", "feature"])
def test_a_table_s_output_added_to_another_table_is_still_refused(other):
    """Rows meet the examples only in an element-wise op with a tensor that holds them (an
    activation of the step's layers, the model's input). A mask, a buffer or the feature
    itself of the bias's own shape does not: the check goes on to the permute. On the old code
    it ended at the first element-wise op, and the relative Linear's per-example norms were
    silently 26x off (a mask) and more."""
    torch.manual_seed(0)
    model = RelativeWithMask(other)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'relative'.*moves"):
        model(torch.randint(0, VOCAB, (B, B)))


@pytest.mark.parametrize("other", ["mask", "buffer", "feature"])
def test_a_table_s_output_added_to_another_table_is_shared_otherwise(other, reference_tools):
    torch.manual_seed(0)
    model, ids = RelativeWithMask(other), torch.randint(0, VOCAB, (B, B + 1))
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)


class ShawAttention(nn.Module):
    """Relative position representations (Shaw et al.): a (T, T, 1) offset feature made in the
    forward through a Linear to (T, T, d) vectors, which the attention scores take by
    ``einsum("bqd,qkd->bqk", q, rel)``, by ``matmul`` against the (B, T, 1, d) queries, or
    concatenated with another table along the features first. With T == B the feature's dim 0
    has the batch size by chance; the model contracts it with the queries' positions."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.tokens, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2)
        self.relative = nn.Linear(1, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        q = self.tokens(ids)  # (B, T, d)
        offsets = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).to(q.dtype)[..., None]
        rel = self.relative(offsets)  # (T, T, d)
        if self.use == "einsum":
            scores = torch.einsum("bqd,qkd->bqk", q, rel)
        elif self.use == "cat":
            rel = torch.cat([rel, offsets.expand(t, t, WIDTH)], dim=-1)  # (T, T, 2d)
            scores = torch.einsum("bqd,qkd->bqk", torch.cat([q, q], dim=-1), rel)
        else:
            scores = (q[:, :, None, :] @ rel.transpose(-1, -2)).squeeze(2)  # (B, T, T)
        return self.head((scores.softmax(dim=-1) @ q).mean(dim=1))


@pytest.mark.parametrize("use", ["einsum", "matmul", "cat"])
def test_relative_representations_taken_by_einsum_or_matmul_are_refused(use):
    """An ``einsum`` that takes the table's dim 0 to another dim than the batch's, a ``matmul``
    that broadcasts it against more dims, a ``torch.cat`` along later dims with another table:
    the rows are not the examples, and the check follows them there. On the old code each op
    ended the check, and the relative Linear's per-example norms were silently wrong."""
    torch.manual_seed(0)
    model = ShawAttention(use)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="'relative'"):
        model(torch.randint(0, VOCAB, (B, B)))


@pytest.mark.parametrize("use", ["einsum", "matmul"])
def test_relative_representations_are_shared_otherwise(use, reference_tools):
    """With T != B the (T, T, d) table is shared by the batch and handed to the model expanded
    to (B, T, T, d): the ``einsum`` gets the batch's letter on it, and the ``matmul``
    (after a transpose of the table's own dims) broadcasts it against the queries' batch as the
    model's own call would, so each example gets its own copy: exact (a torch error on the old
    code: the einsum's equation, the transpose refused)."""
    torch.manual_seed(0)
    model, ids = ShawAttention(use), torch.randint(0, VOCAB, (B, B + 1))
    assert_exact(model, lambda rows: model(ids[rows]).square().sum(), reference_tools)


def test_a_table_shared_by_the_batch_that_fails_expanded_is_refused_clearly():
    """An op that fails on the expanded table (a ``torch.cat`` with a tensor of the model's
    shape) is refused with the layer named and the fix, the torch error chained, where the
    torch error alone said nothing of the expansion."""
    torch.manual_seed(0)
    model = ShawAttention("cat")
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'relative'.*'cat'"):
        model(torch.randint(0, VOCAB, (B, B + 1)))


class TimestepUNet(nn.Module):
    """A diffusion model's shape: images (B, C, H, W) through a convolution, plus a (B, 6)
    sinusoidal embedding of the (B,) time steps, made in the forward without autograd, through
    a Linear and added per channel (``[:, :, None, None]``). With H == B the embedding's dim 0
    has the batch size while the images hold it elsewhere too. ``use="table"`` embeds the H
    rows (positions) instead and contracts them with the features by ``einsum``: a table, not
    the examples."""

    def __init__(self, use: str = "steps") -> None:
        super().__init__()
        self.use = use
        self.conv, self.time = nn.Conv2d(2, WIDTH, 3, padding=1), nn.Linear(6, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, image: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        h = self.conv(image)  # (B, d, H, W)
        frequencies = 10.0 ** -torch.arange(3, dtype=image.dtype)
        where = torch.arange(image.shape[2]) if self.use == "table" else steps
        angles = where.to(image.dtype)[:, None] * frequencies  # (B, 3), or (H, 3)
        embedding = self.time(torch.cat([angles.sin(), angles.cos()], dim=-1))
        if self.use == "table":
            h = h + torch.einsum("bdhw,hd->bdhw", h, embedding)
        else:
            h = h + embedding[:, :, None, None]
        return self.head(torch.tanh(h).mean(dim=(2, 3)))


def test_a_time_embedding_beside_images_with_h_equal_to_b_is_exact(reference_tools):
    """The (B, 6) embedding has fewer dims than the images that hold B in dim 2: refused on the
    old code by its shape alone. Its rows meet the convolution's (B, d, H, W) output in dim 0,
    which shows they are the examples: exact."""
    torch.manual_seed(0)
    model = TimestepUNet()
    image, steps = torch.randn(B, 2, B, 3), torch.randint(0, 1000, (B,))
    assert_exact(
        model, lambda rows: model(image[rows], steps[rows]).square().sum(), reference_tools
    )


def test_a_table_of_the_image_rows_beside_images_with_h_equal_to_b_is_refused():
    """The same shapes, but the embedding is a table of the H rows that ``einsum`` contracts
    with the features: nothing shows its rows are the examples, so it is refused (an op the
    check cannot follow ends it in a refusal for such an input)."""
    torch.manual_seed(0)
    model = TimestepUNet("table")
    image, steps = torch.randn(B, 2, B, 3), torch.randint(0, 1000, (B,))
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="'time'"):
        model(image, steps)


class FloatPositionsGiven(PositionsGiven):
    """(T,) position ids given beside the tokens, fed to a Linear as a (T, 1) float copy."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Linear(1, WIDTH)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        positions = position_ids.to(self.head.weight.dtype)[:, None]  # (T, 1), made here
        h = self.tokens(input_ids) + self.positions(positions)
        return self.head(torch.tanh(h)).mean(dim=1)


@pytest.mark.parametrize("length", [B, B + 1])
def test_a_float_copy_of_given_positions_is_refused_as_many_as_the_examples(
    length, reference_tools
):
    """With T == B the (T, 1) copy looks like one row per example, and its output is added to
    the (B, T, d) tokens: refused (on the old code the Linear's own per-example norms were
    silently 89% off, the whole gradient's 4.2%); with T != B it is shared by the batch."""
    torch.manual_seed(0)
    model = FloatPositionsGiven()
    ids, positions = torch.randint(0, VOCAB, (B, length)), torch.arange(length)
    if length == B:
        with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'positions'.*T == B"):
            model(ids, positions)
        return
    assert_exact(model, lambda rows: model(ids[rows], positions).square().sum(), reference_tools)


class FloatsOfTheExamples(nn.Module):
    """Floating tensors made in the forward without autograd that do hold one row per example,
    with the batch size in another dim of the model's input (T == B, H == W == B): the tokens
    one-hot (B, T, V) into a Linear whose output is added to the token vectors, an image
    normalised in the forward into a Conv2d, a ReLU and a Linear head, (B, T, d) vectors
    scaled in the forward into a MultiheadAttention (whose output is the first of two) or
    through a Linear and a LayerNorm into a TransformerEncoderLayer (which transposes its input
    inside), or an image normalised into 1x1 patches plus position embeddings shared by the
    batch (expanded for it) and a TransformerEncoderLayer."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.head = nn.Linear(WIDTH, 2)
        if use == "image":
            self.conv, self.pixels = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3 * B * B, WIDTH)
        elif use == "attention":
            self.attn = nn.MultiheadAttention(WIDTH, 1, batch_first=True)
        elif use == "encoder":
            self.inputs, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)
            self.encoder = nn.TransformerEncoderLayer(WIDTH, 1, 8, dropout=0.0, batch_first=True)
        elif use == "patches":
            self.conv, self.positions = nn.Conv2d(2, WIDTH, 1), nn.Embedding(B * B, WIDTH)
            self.encoder = nn.TransformerEncoderLayer(WIDTH, 1, 8, dropout=0.0, batch_first=True)
        else:
            self.tokens, self.one_hot = nn.Embedding(VOCAB, WIDTH), nn.Linear(VOCAB, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "image":
            features = torch.relu(self.conv((x - 0.5) / 2)).flatten(1)
            return self.head(torch.tanh(self.pixels(features)))
        if self.use == "attention":
            h = x * 0.5
            out, _ = self.attn(h, h, h)
            return self.head(torch.tanh(out)).mean(dim=1)
        if self.use == "encoder":
            return self.head(self.encoder(self.norm(self.inputs(x * 0.5))).mean(dim=1))
        if self.use == "patches":
            patches = self.conv((x - 0.5) / 2).flatten(2).transpose(1, 2)  # (B, H * W, d)
            h = patches + self.positions(torch.arange(patches.shape[1]))
            return self.head(self.encoder(h).mean(dim=1))
        one_hot = F.one_hot(x, VOCAB).to(self.head.weight.dtype)  # (B, T, V), made here
        h = self.tokens(x) + self.one_hot(one_hot)
        return self.head(torch.tanh(h)).mean(dim=1)


@pytest.mark.parametrize("use", ["one_hot", "image", "attention", "encoder", "patches"])
def test_floats_made_in_the_forward_from_the_examples_are_exact(use, reference_tools):
    """What the model does with their layers' outputs treats dim 0 as the batch, so the
    run-time check lets them through at T == B."""
    torch.manual_seed(0)
    model = FloatsOfTheExamples(use)
    shapes = {"image": (B, 2, B, B), "patches": (B, 2, B, B)}
    shapes |= {"attention": (B, B, WIDTH), "encoder": (B, B, WIDTH)}
    x = torch.randn(shapes[use]) if use in shapes else torch.randint(0, VOCAB, (B, B))
    assert_exact(model, lambda rows: model(x[rows]).square().sum(), reference_tools)


class SequenceFirstAfterALinear(nn.Module):
    """The model's (B, T, f) features scaled in the forward (a copy made without autograd), a
    Linear, then its output made sequence-first for a GRU with ``batch_first=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs, self.gru = nn.Linear(3, WIDTH), nn.GRU(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inputs(x * 0.5).transpose(0, 1)  # (T, B, d)
        return self.head(self.gru(h)[0][-1])


@pytest.mark.parametrize("length", [B, B + 1])
def test_a_copy_of_the_examples_made_sequence_first_after_its_layer(length, reference_tools):
    """With T == B, a copy of the examples made without autograd cannot be told by its shape
    from a table of T rows shared by the batch, and moving its layer's output's dim 0 away is
    what a shared table's use would do: refused, naming the fix (another batch size), though
    the rows were the examples; with T != B exact."""
    torch.manual_seed(0)
    model, x = SequenceFirstAfterALinear(), torch.randn(B, length, 3)
    if length == B:
        with PerSampleStats(model, "sum"), pytest.raises(ValueError, match=r"'inputs'.*T == B"):
            model(x)
        return
    assert_exact(model, lambda rows: model(x[rows]).square().sum(), reference_tools)


class CheckpointedSequenceFirst(nn.Module):
    """Token vectors through a reentrant checkpoint of a Linear whose output is made
    sequence-first for a GRU: the recomputed call's input is a leaf that requires grad, made
    by the checkpoint without autograd history."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.mix = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.gru, self.head = nn.GRU(WIDTH, WIDTH), nn.Linear(WIDTH, 2)
        self.checkpointed = True

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return self.mix(h).transpose(0, 1)  # (T, B, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        else:
            h = self.block(h)
        return self.head(self.gru(h)[0][-1])


def test_a_reentrant_checkpoint_s_recomputed_input_is_not_in_doubt(reference_tools):
    """With T == B, the recomputed input (a leaf that requires grad) is autograd's, not a
    tensor made without it: the sequence-first output after it stays exact."""
    torch.manual_seed(0)
    model, ids = CheckpointedSequenceFirst(), torch.randint(0, VOCAB, (B, B))
    model.checkpointed = False  # torch.autograd.grad cannot run a reentrant checkpoint
    expected = rows_of_examples(model, lambda i: model(ids[i : i + 1]).square().sum())
    model.checkpointed = True
    with PerSampleStats(model, "sum") as stats:
        model(ids).square().sum().backward()
        reference_tools.assert_matches(stats, expected)
