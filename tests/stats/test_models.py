"""Language-model shapes: tied embedding / head, positions shared by the batch, layouts.

Reference: the gradient of each example's own loss term by ``torch.autograd.grad``, one example
at a time, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats

VOCAB, WIDTH = 11, 6


class TinyGPT(nn.Module):
    """nanoGPT's skeleton: token + position embeddings, a block, LayerNorm, tied head."""

    def __init__(self, positions: str = "arange", tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(16, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        self.positions = positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t)
        if self.positions == "hf":  # Hugging Face: (1, T) position ids
            pos = pos.unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        x = x + torch.tanh(self.mix(x))
        return self.head(self.ln(x))


def token_losses(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B,) summed next-token cross entropy per example."""
    per_token = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
    return per_token.view(idx.shape).sum(dim=1)


def reference_gradients(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """(B, d) gradient of each example's own loss term, one autograd.grad per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(idx.shape[0]):
        loss = token_losses(model(idx[i : i + 1]), idx[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("positions", "tied", "batch", "length"),
    [
        ("arange", True, 3, 5),
        ("arange", False, 3, 5),
        ("hf", True, 3, 5),
        ("hf", True, 4, 4),  # T == B: was silently wrong
        ("arange", True, 1, 5),
    ],
)
def test_language_model_matches_per_example_autograd(
    float64, reference_tools, positions, tied, batch, length
):
    torch.manual_seed(0)
    model = TinyGPT(positions, tied)
    idx = torch.randint(0, VOCAB, (batch, length))
    reference = reference_gradients(model, idx)
    with PerSampleStats(model, "sum") as stats:
        token_losses(model(idx), idx).sum().backward()
        reference_tools.assert_matches(stats, reference)


def test_positions_without_batch_dim_and_t_equal_b_is_refused(float64):
    model = TinyGPT("arange")
    idx = torch.randint(0, VOCAB, (4, 4))
    with PerSampleStats(model, "sum") as stats, pytest.raises(ValueError, match="wpe"):
        token_losses(model(idx), idx).sum().backward()
        stats.norms_squared()


def test_mean_loss_with_tied_head(float64, reference_tools):
    torch.manual_seed(1)
    model = TinyGPT("arange")
    idx = torch.randint(0, VOCAB, (3, 5))
    reference = reference_gradients(model, idx)  # g_i: gradient of l_i itself
    with PerSampleStats(model, "mean") as stats:
        token_losses(model(idx), idx).mean().backward()
        reference_tools.assert_matches(stats, reference)


class SequenceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize("length", [4, 5])
def test_sequence_first_layer_is_refused(length):
    model = SequenceFirst()
    x = torch.randn(4, length, 3)
    with PerSampleStats(model, "sum") as stats, pytest.raises(ValueError, match="batch_first"):
        model(x).sum().backward()
        stats.norms_squared()


class Gain(nn.Module):
    """A layer with no rule: y = x * gain."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


@pytest.mark.parametrize("model_kind", ["tied-arange", "hf", "fallback"])
def test_hook_mode_sampler_decides_as_dense_reference(float64, model_kind):
    from grabkit.order import GraBSampler

    torch.manual_seed(2)
    n, batch, length = 12, 4, 5
    idx_all = torch.randint(0, VOCAB, (n, length))

    def make() -> nn.Module:
        if model_kind == "fallback":
            return nn.Sequential(nn.Embedding(VOCAB, WIDTH), Gain(WIDTH), nn.Linear(WIDTH, VOCAB))
        return TinyGPT("hf" if model_kind == "hf" else "arange")

    model = make()
    options = {"torch_func_fallback": True} if model_kind == "fallback" else {}
    # the reference runs on an unhooked copy: its per-example backwards are not training steps
    reference_model = make()
    dataset = torch.utils.data.TensorDataset(idx_all)
    hooked = GraBSampler(
        dataset, model=model, balance_type="pair", loss_reduction="sum", stats_options=options
    )
    dense = GraBSampler(dataset, dict(model.named_parameters()), balance_type="pair")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        order = list(iter(hooked))
        assert order == list(iter(dense))
        for start in range(0, n, batch):
            idx = idx_all[torch.tensor(order[start : start + batch])]
            reference_model.load_state_dict(model.state_dict())
            reference = reference_gradients(reference_model, idx)
            opt.zero_grad()
            token_losses(model(idx), idx).sum().backward()
            hooked.step()
            dense.step(reference)
            opt.step()
    assert list(iter(hooked)) == list(iter(dense))
    hooked.stats.close()
