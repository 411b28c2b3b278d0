"""A layer input whose dim 0 has the batch size but holds positions (T == B): a sequence-first
copy of an activation has a batch-first layout, so only the autograd graph that made it tells
(``grabkit.stats.batch_dim``). Refused where the graph shows dim 0 moved; the layouts that
keep the examples in dim 0 stay exact against per-example ``torch.autograd.grad`` in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grabkit.order import GraBSampler
from grabkit.stats import PerSampleStats

pytestmark = pytest.mark.usefixtures("float64")

B = T = 4


def per_example_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, d): gradient of each example's squared output, one ``torch.autograd.grad`` each."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model(x[i : i + 1]).square().sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def sequence_first(how: str, h: torch.Tensor) -> torch.Tensor:
    """(B, T, F) -> a contiguous (T, B, F) copy, made ``how``."""
    if how == "transpose, contiguous":
        return h.transpose(0, 1).contiguous()
    if how == "permute, clone":
        return h.permute(1, 0, 2).clone(memory_format=torch.contiguous_format)
    if how == "einsum":
        return torch.einsum("btf->tbf", h).contiguous()
    if how == "stack of positions":  # torch.stack's default dim=0, as a manual RNN loop has it
        return torch.stack([h[:, t] for t in range(h.shape[1])])
    if how == "cat of unbound positions":
        return torch.cat([row.unsqueeze(0) for row in h.unbind(1)])
    raise AssertionError(how)


def batch_first(how: str, h: torch.Tensor) -> torch.Tensor:
    """(B, T, F) -> (B, T, F) through sequence-first intermediates that come back."""
    if how == "transposed there and back":
        return torch.tanh(h.transpose(0, 1)).cumsum(0).transpose(0, 1).contiguous()
    if how == "stack of positions along dim 1":
        return torch.stack([h[:, t] * (t + 1) for t in range(h.shape[1])], dim=1)
    if how == "stack of examples":
        return torch.stack([h[i] for i in range(h.shape[0])])
    if how == "a position mix":
        return torch.einsum("ts,bsf->btf", torch.ones(T, T).tril(), h).contiguous()
    raise AssertionError(how)


class Rearranged(nn.Module):
    def __init__(self, arrange, how: str) -> None:
        super().__init__()
        self.arrange, self.how = arrange, how
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.arrange(self.how, torch.tanh(self.first(x))))


SEQUENCE_FIRST = [
    "transpose, contiguous",
    "permute, clone",
    "einsum",
    "stack of positions",
    "cat of unbound positions",
]


@pytest.mark.parametrize("how", SEQUENCE_FIRST)
def test_a_sequence_first_copy_of_an_activation_is_refused_when_t_equals_b(how):
    """Silently wrong on the old code: position t's gradient credited to example t (16-78% off
    in the norms)."""
    torch.manual_seed(0)
    model = Rearranged(sequence_first, how)
    x = torch.randn(B, T, 3)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="dim 0 is dim 1 of the"):
        model(x)


@pytest.mark.parametrize(
    "how",
    [
        "transposed there and back",
        "stack of positions along dim 1",
        "stack of examples",
        "a position mix",
    ],
)
def test_layouts_that_keep_the_examples_in_dim_0_stay_exact(how, reference_tools):
    torch.manual_seed(0)
    model = Rearranged(batch_first, how)
    x = torch.randn(B, T, 3)
    expected = per_example_rows(model, x)
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, expected)


def test_a_sequence_first_copy_is_refused_in_hook_mode_grab():
    torch.manual_seed(0)
    model = Rearranged(sequence_first, "transpose, contiguous")
    data = torch.utils.data.TensorDataset(torch.randn(8, T, 3))
    sampler = GraBSampler(data, model=model, batch_size=B)
    order = list(iter(sampler))
    with pytest.raises(ValueError, match="sequence-first copy"):
        model(data.tensors[0][order[:B]])
    sampler.close()


# -- rows reordered between layers -----------------------------------------------------------
def reorder(how: str, h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The second layer's input: ``h``'s rows sorted by ``key`` (``how``); the forward sorts
    back after the layer, so each output row is still its own example's."""
    order = torch.argsort(key)
    if how == "index":
        return h[order]
    if how == "index_select":
        return h.index_select(0, order)
    if how == "gather":
        return torch.gather(h, 0, order[:, None].expand_as(h))
    if how == "flip":
        return torch.tanh(h.flip(0))
    if how == "index_put":
        placed = torch.empty_like(h)
        placed[torch.argsort(order)] = h  # row order[j] of h lands in row j
        return placed
    if how == "index_copy":
        return torch.zeros_like(h).index_copy(0, torch.argsort(order), h)
    raise AssertionError(how)


def restore(how: str, out: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    if how == "flip":
        return out.flip(0)
    return out[torch.argsort(torch.argsort(key))]


class SortedInside(nn.Module):
    """Sorts the examples by their first feature between its two layers and back after."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return restore(self.how, self.second(reorder(self.how, h, x[:, 0])), x[:, 0])


@pytest.mark.parametrize(
    "how", ["index", "index_select", "gather", "flip", "index_put", "index_copy"]
)
def test_rows_reordered_between_layers_are_refused(how):
    """Each output row is its own example's, yet the second layer's row j is another example's:
    silently wrong on the old code (16-40% off in the norms; the identity check cannot see it,
    the rows still add up)."""
    torch.manual_seed(0)
    model = SortedInside(how)
    x = torch.randn(5, 3)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="reordered by"):
        model(x)


def test_the_last_position_of_each_example_is_no_reorder(reference_tools):
    """``h[arange(B), last]`` keeps example i in row i."""
    torch.manual_seed(0)

    class LastPosition(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            return self.second(h[torch.arange(x.shape[0]), x.shape[1] - 1])

    model = LastPosition()
    x = torch.randn(B, 3, 3)
    expected = per_example_rows(model, x)
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, expected)


# -- rows moved by pieces: slices, chunks, splits and unbound rows put back in another order ----
def moved_in_pieces(how: str, h: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B, F) with its rows in another order, made of pieces of ``h``."""
    if how == "chunks swapped":
        first, second = h.chunk(2, 0)
        return torch.cat([second, first])
    if how == "rolled by slices":
        return torch.cat([h[1:], h[:1]])
    if how == "split, swapped":
        first, second = h.split([2, h.shape[0] - 2])
        return torch.cat([second, first])
    if how == "rows unbound, stacked reversed":
        return torch.stack(list(h.unbind(0))[::-1])
    if how == "rows selected, stacked shifted":
        return torch.stack([h[(i + 1) % h.shape[0]] for i in range(h.shape[0])])
    if how == "shifted down by a padding row":
        return torch.cat([torch.zeros_like(h[:1]), h])[: h.shape[0]]
    raise AssertionError(how)


def restored_from_pieces(how: str, out: torch.Tensor) -> torch.Tensor:
    """Each example's output back in its own row."""
    b = out.shape[0]
    inverse = {
        "chunks swapped": lambda: torch.cat([out[b - (b + 1) // 2 :], out[: b - (b + 1) // 2]]),
        "rolled by slices": lambda: torch.cat([out[-1:], out[:-1]]),
        "split, swapped": lambda: torch.cat([out[b - 2 :], out[: b - 2]]),
        "rows unbound, stacked reversed": lambda: out.flip(0),
        "rows selected, stacked shifted": lambda: out.roll(1, 0),
        "shifted down by a padding row": lambda: torch.cat([out[1:], out[:1]]),
    }
    return inverse[how]()


def kept_in_pieces(how: str, h: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B, F) made of pieces of ``h``, each row still its own example's."""
    if how == "chunks in order":
        return torch.cat(h.chunk(2, 0))
    if how == "split and cat back, scaled":
        first, second = h.split([2, h.shape[0] - 2])
        return torch.cat([2 * first, torch.tanh(second)])
    if how == "rows unbound, stacked in order":
        return torch.stack([torch.tanh(row) for row in h.unbind(0)])
    if how == "padded, then sliced":
        return torch.cat([h, torch.zeros_like(h[:1])])[: h.shape[0]]
    if how == "features sliced":
        return torch.cat([h[:, :3], h[:, 3:] * 2], dim=1)
    raise AssertionError(how)


class Pieces(nn.Module):
    def __init__(self, arrange, restore=None) -> None:
        super().__init__()
        self.arrange, self.restore = arrange, restore
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.second(self.arrange(torch.tanh(self.first(x))))
        return out if self.restore is None else self.restore(out)


MOVED_IN_PIECES = [
    "chunks swapped",
    "rolled by slices",
    "split, swapped",
    "rows unbound, stacked reversed",
    "rows selected, stacked shifted",
    "shifted down by a padding row",
]


@pytest.mark.parametrize("how", MOVED_IN_PIECES)
def test_rows_moved_in_pieces_between_layers_are_refused(how):
    """Row j of the second layer's input is another example's row, put there by slices,
    chunks, splits or unbound rows concatenated or stacked in another order: silently wrong
    on the old code (the walk took a cat or stack along dim 0 for one that keeps the rows;
    the largest per-example norm 41-204% off; `out[perm] = h` and `index_copy` 58%)."""
    torch.manual_seed(0)
    model = Pieces(lambda h: moved_in_pieces(how, h), lambda out: restored_from_pieces(how, out))
    x = torch.randn(6, 3)
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="reordered by"):
        model(x)


@pytest.mark.parametrize(
    "how",
    [
        "chunks in order",
        "split and cat back, scaled",
        "rows unbound, stacked in order",
        "padded, then sliced",
        "features sliced",
    ],
)
def test_pieces_put_back_in_order_stay_exact(how, reference_tools):
    torch.manual_seed(0)
    model = Pieces(lambda h: kept_in_pieces(how, h))
    x = torch.randn(6, 3)
    params = list(model.parameters())
    out = model(x)  # the pieces depend on the batch size: each example's term in the batch
    expected = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(row.square().sum(), params, retain_graph=True)
                ]
            )
            for row in out
        ]
    )
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, expected)
