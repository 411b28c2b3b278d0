"""Every layer rule against torch.func per-example gradients in float64 (relative error <= 1e-6)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from grabkit.stats import PerSampleStats

pytestmark = pytest.mark.usefixtures("float64")

B = 5


def classification_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def sequence_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(dim=1)


def batch_loss(per_example: torch.Tensor, reduction: str) -> torch.Tensor:
    return per_example.mean() if reduction == "mean" else per_example.sum()


class TinyLM(nn.Module):
    """Embedding + positions + LayerNorm + causal attention from Linear projections + MLP."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 2, length: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, dim, padding_idx=0)
        self.positions = nn.Embedding(length, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 16), nn.GELU(), nn.Linear(16, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h = self.tokens(idx) + self.positions(torch.arange(t).expand(b, t))
        a = self.ln1(h)

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.query(a)), split(self.key(a)), split(self.value(a))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        h = h + self.out(attn.transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.ln2(h))
        return self.head(h)


def mlp_with_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 10),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(10, 12),
        nn.ReLU(inplace=True),
        nn.Linear(12, 3),
    )


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, padding_mode="reflect"),
        nn.BatchNorm2d(6),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 3),
    )


def small_cnn1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(3, 4, 3, padding="same", dilation=2),
        nn.ReLU(),
        nn.Conv1d(4, 4, 2, stride=2, padding=1, padding_mode="circular", bias=False),
        nn.Flatten(),
        nn.Linear(20, 2),
    )


def run_and_compare(model, inputs, targets, loss, reduction, tools, masks_needed=False, **options):
    """Hooked forward/backward vs the torch.func reference on the same batch."""
    masks, handles = tools.record_dropout_masks(model)
    with PerSampleStats(model, loss_reduction=reduction, **options) as stats:
        batch_loss(loss(model(inputs), targets), reduction).backward()
        for handle in handles:
            handle.remove()
        # g_i is example i's own loss term under both reductions
        reference = tools.per_sample(model, loss, inputs, targets, masks if masks_needed else None)
        tools.assert_matches(stats, reference)
    return stats


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mlp_with_dropout(reduction, reference_tools):
    torch.manual_seed(0)
    model = mlp_with_dropout().train()
    x, y = torch.randn(B, 6), torch.randint(0, 3, (B,))
    run_and_compare(model, x, y, classification_loss, reduction, reference_tools, True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_small_cnn(reduction, reference_tools):
    torch.manual_seed(1)
    model = small_cnn().eval()  # BatchNorm on running statistics: exact
    with torch.no_grad():
        model[4].running_mean.uniform_(-0.5, 0.5)
        model[4].running_var.uniform_(0.5, 2.0)
    x, y = torch.randn(B, 2, 6, 6), torch.randint(0, 3, (B,))
    run_and_compare(model, x, y, classification_loss, reduction, reference_tools)


def test_conv1d_padding_modes(reference_tools):
    torch.manual_seed(2)
    model = small_cnn1d()
    x, y = torch.randn(B, 3, 8), torch.randint(0, 2, (B,))
    run_and_compare(model, x, y, classification_loss, "mean", reference_tools)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_transformer_block_on_sequences(reduction, reference_tools):
    torch.manual_seed(3)
    model = TinyLM()
    idx = torch.randint(0, 11, (B, 6))
    idx[0, :3] = 0  # padding_idx rows get no gradient
    idx[1, :] = 4  # one token repeated: rows of the embedding gradient add up
    targets = torch.randint(0, 11, (B, 6))
    run_and_compare(model, idx, targets, sequence_loss, reduction, reference_tools)


def test_frozen_layer_is_skipped(reference_tools):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.PReLU(), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    model[3].requires_grad_(False)  # a layer without a rule is fine when frozen
    model[4].bias.requires_grad_(False)
    x, y = torch.randn(B, 4), torch.randint(0, 2, (B,))
    stats = run_and_compare(model, x, y, classification_loss, "mean", reference_tools)
    assert list(stats.param_shapes) == ["2.weight", "2.bias", "4.weight"]


def test_layer_called_twice_in_one_forward(reference_tools):
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(5, 5)
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    torch.manual_seed(5)
    x, y = torch.randn(B, 5), torch.randint(0, 3, (B,))
    run_and_compare(Twice(), x, y, classification_loss, "sum", reference_tools)


def test_batchnorm_training_mode_raises_by_default():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).train()
    with PerSampleStats(model), pytest.raises(ValueError, match=r"eval mode.*GroupNorm"):
        model(torch.randn(B, 4))
    model.eval()
    with PerSampleStats(model) as stats:
        model(torch.randn(B, 4)).sum().backward()
        assert stats.norms_squared().shape == (B,)


def test_batchnorm_constant_statistics_match_their_definition(float64):
    # Documented definition: each layer's per-example share of the batch gradient,
    # sum_t D[i, t] A[i, t]^T with D the batch loss's gradient at the layer output.
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).train()
    x = torch.randn(B, 4)
    outputs = []  # the layers' outputs, read by forward hooks of the model's own forward
    for k in (0, 1, 3):
        model[k].register_forward_hook(lambda module, args, output: outputs.append(output))
    with pytest.warns(UserWarning, match="batch mean and variance as constants"):
        stats = PerSampleStats(model, "sum", batch_norm_constant_statistics=True)
        model(x)
    h1, h2, out = outputs
    loss = out.square().sum()
    d1, d2, d3 = torch.autograd.grad(loss, (h1, h2, out), retain_graph=True)
    loss.backward()  # the engine's hooks see d1, d2, d3 (autograd.grad's own task is no step)
    xhat = (h1 - h1.mean(0)) / torch.sqrt(h1.var(0, unbiased=False) + model[1].eps)
    a3 = model[2](h2)
    rows = torch.cat(
        [
            (d1[:, :, None] * x[:, None, :]).reshape(B, -1),
            d1,
            d2 * xhat,
            d2,
            (d3[:, :, None] * a3[:, None, :]).reshape(B, -1),
            d3,
        ],
        dim=1,
    )
    torch.testing.assert_close(stats.gram(), rows @ rows.T)
    torch.testing.assert_close(stats.norms_squared(), rows.square().sum(1))
    stats.close()


def test_batchnorm_training_mode_treats_batch_statistics_as_constants(reference_tools):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).train()
    x, y = torch.randn(B, 4), torch.randint(0, 2, (B,))
    with pytest.warns(UserWarning, match="batch mean and variance as constants"):
        stats = PerSampleStats(model, batch_norm_constant_statistics=True)
        classification_loss(model(x), y).mean().backward()
    # Reference: the same network normalising with this batch's statistics held fixed.
    frozen = copy.deepcopy(model).eval()
    with torch.no_grad():
        h = model[0](x)
        frozen[1].running_mean.copy_(h.mean(0))
        frozen[1].running_var.copy_(h.var(0, unbiased=False))
    reference = reference_tools.per_sample(frozen, classification_loss, x, y)
    # The first Linear sits before BatchNorm: its output gradient carries the coupling through
    # the batch statistics, so only BatchNorm's own parameters and the layers after it are
    # compared (vectors and weights that are zero on the first layer).
    d_first = sum(p.numel() for p in model[0].parameters())
    tail = reference[:, d_first:]
    vectors = torch.randn(2, tail.shape[1])
    weights = torch.randn(B)
    batch = stats.gradient_batch()
    padded = torch.cat([torch.zeros(2, d_first), vectors], dim=1)
    err_dot = reference_tools.relative_error(batch.dot(padded), tail @ vectors.T)
    err_sum = reference_tools.relative_error(batch.weighted_sum(weights)[d_first:], weights @ tail)
    assert max(err_dot, err_sum) <= 1e-6, (err_dot, err_sum)
    stats.close()


class Gain(nn.Module):
    """A custom layer with its own parameter and a child layer: no rule for it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.inner = nn.Linear(6, 6)

    def forward(self, x):
        return self.inner(x) * self.gain


def test_torch_func_fallback_for_layers_without_rules(reference_tools):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.PReLU(6), Gain(), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(B, 4), torch.randint(0, 3, (B,))
    with pytest.raises(ValueError, match="torch_func_fallback=True"):
        PerSampleStats(model)
    run_and_compare(
        model, x, y, classification_loss, "mean", reference_tools, torch_func_fallback=True
    )


# The fixtures (float64 default dtype, reference helpers) hold no per-example state.
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 5),
    width=st.integers(1, 6),
    hidden=st.integers(1, 9),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_random_sequence_models_match_reference(
    batch, length, width, hidden, reduction, seed, reference_tools
):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.Tanh(), nn.Linear(hidden, 3)
    )
    x, y = torch.randn(batch, length, width), torch.randint(0, 3, (batch, length))
    run_and_compare(model, x, y, sequence_loss, reduction, reference_tools)
