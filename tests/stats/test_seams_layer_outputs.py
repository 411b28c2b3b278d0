"""More seams, each checked against per-example ``torch.autograd.grad`` in float64:

* a layer output changed in place (``h.mul_()``, ``relu_``, ``F.relu(inplace=True)``, a slice
  assignment), where the output is a view of a tensor made inside the layer (a Linear on a 3-D
  input: a matmul and a view): the in-place op rebuilds the view's graph;
* a forward hook of the user's that changes a layer's output, registered before the
  statistics were attached (it runs before or after the engine's own hook);
* a layer whose input is one of the model's parameters or buffers (learned latent queries, a
  slice of a position table), shared by the batch, whose dim 0 has the batch size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats

pytestmark = pytest.mark.usefixtures("float64")

B, T, WIDTH = 4, 3, 5


def per_example_rows(model: nn.Module, losses: torch.Tensor) -> torch.Tensor:
    """(B, d): gradient of each entry of ``losses`` over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, grads, strict=True)
                ]
            )
        )
    return torch.stack(rows)


def squared_errors(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.reshape(len(y), -1).sum(1) - y) ** 2


def assert_exact(model: nn.Module, forward, steps: int = 2) -> None:
    """Norms, Gram matrix and total of ``PerSampleStats`` equal the per-example reference."""
    torch.manual_seed(1)
    y = torch.randn(B)
    reference = per_example_rows(model, squared_errors(forward(model), y))
    model.zero_grad()
    with PerSampleStats(model) as stats:
        for _ in range(steps):
            model.zero_grad()
            squared_errors(forward(model), y).mean().backward()
            torch.testing.assert_close(stats.norms_squared(), reference.square().sum(1))
            torch.testing.assert_close(stats.gram(), reference @ reference.T)
            torch.testing.assert_close(stats.statistics().total(), reference.sum(0))


class InPlaceAfterLayer(nn.Module):
    def __init__(self, change) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)
        self.change = change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.change(h)
        return self.b(h)


IN_PLACE = {
    "mul_": lambda h: h.mul_(2.0),
    "relu_": lambda h: h.relu_(),
    "tanh_": lambda h: h.tanh_(),
    "F.relu(inplace=True)": lambda h: F.relu(h, inplace=True),
    "slice": lambda h: h[:, 0].mul_(3.0),
}


@pytest.mark.parametrize("change", IN_PLACE.values(), ids=IN_PLACE.keys())
@pytest.mark.parametrize("dims", [2, 3])
def test_layer_output_changed_in_place_is_exact(change, dims: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, WIDTH) if dims == 2 else torch.randn(B, T, WIDTH)
    assert_exact(InPlaceAfterLayer(change), lambda m: m(x))


def test_in_place_relu_module_after_embedding_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, 1))
    ids = torch.randint(0, 11, (B, T))
    assert_exact(model, lambda m: m(ids))


@pytest.mark.parametrize("dims", [2, 3])
def test_forward_hook_of_the_user_that_changes_the_output_is_exact(dims: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    model[0].register_forward_hook(lambda module, args, out: out * 2.0)
    model[2].register_forward_hook(lambda module, args, out: torch.tanh(out))
    x = torch.randn(B, WIDTH) if dims == 2 else torch.randn(B, T, WIDTH)
    assert_exact(model, lambda m: m(x))


class LatentQueries(nn.Module):
    """Learned queries (``count`` frozen rows, no batch dim) attending over the positions."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(count, WIDTH), requires_grad=False)
        self.q, self.k = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(self.latents)  # (count, WIDTH), broadcast against the batch below
        scores = torch.softmax(q @ self.k(x).transpose(1, 2), -1)  # (B, count, T)
        return self.out(scores @ x)


@pytest.mark.parametrize("count", [B - 1, B], ids=["count != B", "count == B"])
def test_layer_on_latent_parameters_is_exact_or_refused(count: int) -> None:
    """Latent queries are shared by the batch whatever their count: with count == B they must
    not be taken as one row per example (a matmul broadcast of a shared input is refused,
    whatever the count)."""
    torch.manual_seed(0)
    x = torch.randn(B, T, WIDTH)
    try:
        assert_exact(LatentQueries(count), lambda m: m(x))
    except ValueError as error:
        assert "shared by the batch" in str(error) and "'q'" in str(error)


class PositionTable(nn.Module):
    """A sinusoid-like table in a buffer, sliced to the sequence length and mixed by a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(16, WIDTH))
        self.pos, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, L, WIDTH)
        return self.out(torch.tanh(x + self.pos(self.table[: x.shape[1]])))


@pytest.mark.parametrize("length", [T, B], ids=["L != B", "L == B"])
def test_layer_on_a_buffer_slice_of_the_batch_size_is_exact(length: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, length, WIDTH)
    assert_exact(PositionTable(), lambda m: m(x))


class HookedActivation(nn.Module):
    """A gradient hook of the user's on a layer's output (scaling, as a gradient-reversal or
    loss-balancing hook does), registered in the forward after the layer's call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda grad: -0.5 * grad)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("dims", [2, 3])
def test_gradient_hook_of_the_user_on_a_layer_output_is_exact(dims: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, WIDTH) if dims == 2 else torch.randn(B, T, WIDTH)
    assert_exact(HookedActivation(), lambda m: m(x))


class RoutedExperts(nn.Module):
    """A mixture of experts: each token (of B * T) goes to one expert, which sees its tokens as
    rows (as Mixtral's sparse block does); the rows are tokens, not examples."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        tokens = torch.tanh(self.inp(x)).reshape(-1, WIDTH)  # (B * T, WIDTH)
        mixed = torch.zeros_like(tokens)
        for k, expert in enumerate(self.experts):
            rows = (route.reshape(-1) == k).nonzero()[:, 0]
            mixed = mixed.index_add(0, rows, expert(tokens[None, rows].reshape(-1, WIDTH)))
        return self.out(mixed.reshape(x.shape))


def test_experts_given_as_many_tokens_as_examples_are_refused() -> None:
    """Each expert gets exactly B tokens: dim 0 has the batch size by chance; taking its rows
    as the examples would be silently wrong."""
    torch.manual_seed(0)
    x, route = torch.randn(B, 2, WIDTH), torch.tensor([[0, 0], [0, 1], [0, 1], [1, 1]])
    model = RoutedExperts()
    refused = r"'experts\.0'.*selected by indexing"
    with PerSampleStats(model), pytest.raises(ValueError, match=refused):
        model(x, route)


class MaskedPositionsHead(nn.Module):
    """A head applied to the masked positions only (a masked-LM head): rows are tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))[masked])  # (masked tokens, 1)


def test_a_head_on_as_many_masked_tokens_as_examples_is_refused() -> None:
    torch.manual_seed(0)
    masked = torch.zeros(B, T, dtype=torch.bool)
    masked[0, :2] = masked[1, 0] = masked[2, 2] = True  # B tokens, not one per example
    model = MaskedPositionsHead()
    with PerSampleStats(model), pytest.raises(ValueError, match=r"'head'.*selected by indexing"):
        model(torch.randn(B, T, WIDTH), masked)


class LastTokenHead(nn.Module):
    """A head on each example's last real token, picked by indexing: one row per example."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h[torch.arange(len(x)), last])


def test_a_head_on_each_examples_last_token_is_exact() -> None:
    torch.manual_seed(0)
    x, last = torch.randn(B, T, WIDTH), torch.tensor([2, 0, 1, 2])
    assert_exact(LastTokenHead(), lambda m: m(x, last))


class VmappedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.vmap(lambda row: torch.tanh(self.a(row)))(x))


def test_a_layer_run_inside_vmap_is_refused_naming_the_transform() -> None:
    model = VmappedLayer()
    with PerSampleStats(model) as stats:
        model(torch.randn(B, WIDTH)).sum().backward()
        with pytest.raises(RuntimeError, match=r"'a'.*torch\.vmap"):
            stats.norms_squared()
