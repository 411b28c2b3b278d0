"""nn.MultiheadAttention and nn.TransformerEncoder against per-example ``torch.autograd.grad``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats

WIDTH, CLASSES = 8, 3


class EncoderClassifier(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 12, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        return self.head(self.encoder(x, mask=mask, is_causal=self.causal).mean(dim=1))


class Attention(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=self.need_weights)
        return self.head(out.sum(dim=1))


class PositionHead(nn.Module):
    """A Linear on every position of the attention output: with B == T that output (a
    transposed view on the CPU) has the batch size in two dims."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x)
        return self.head(out).mean(dim=1)


class MaskedAttention(nn.Module):
    """Attention with a per-example (B * heads, T, T) attention mask and a (B, T) key padding
    mask, one Linear per position after it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, attn_mask, padding):
        out, _ = self.attn(x, x, x, key_padding_mask=padding, attn_mask=attn_mask)
        return self.head(out).mean(dim=1)


def reference_rows(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Attention(need_weights=True),
        lambda: Attention(need_weights=False),
        lambda: EncoderClassifier(causal=True),
        lambda: EncoderClassifier(causal=False),
        PositionHead,
    ],
)
@pytest.mark.parametrize(("batch", "length"), [(3, 5), (4, 6), (5, 5)])
def test_attention_models_match_per_example_autograd(float64, reference_tools, make, batch, length):
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(batch, length, WIDTH), torch.randint(0, CLASSES, (batch,))
    reference = reference_rows(model, x, y)
    with PerSampleStats(model, "sum") as stats:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        reference_tools.assert_matches(stats, reference)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.MultiheadAttention(WIDTH, 2),
        lambda: nn.TransformerEncoderLayer(WIDTH, 2, 12, dropout=0.0),
        lambda: nn.Transformer(WIDTH, 2, 1, 1, 12, dropout=0.0),
    ],
)
def test_sequence_first_attention_is_refused(make):
    with pytest.raises(ValueError, match="batch_first=True"):
        PerSampleStats(make())


def test_attention_dropout_in_training_is_refused():
    model = nn.MultiheadAttention(WIDTH, 2, dropout=0.1, batch_first=True)
    with PerSampleStats(model), pytest.raises(ValueError, match="dropout"):
        model(*(torch.randn(3, 5, WIDTH),) * 3)


@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize(("batch", "length"), [(3, 5), (5, 5)])
def test_per_example_attention_masks_match_per_example_autograd(
    float64, reference_tools, kind, batch, length
):
    torch.manual_seed(0)
    model, heads = MaskedAttention(), 2
    x, y = torch.randn(batch, length, WIDTH), torch.randint(0, CLASSES, (batch,))
    if kind == "additive":
        attn_mask = torch.randn(batch * heads, length, length)
    else:  # True: not attended; every query keeps its own key
        attn_mask = (torch.rand(batch * heads, length, length) > 0.6) & ~torch.eye(length).bool()
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[:, -1] = torch.arange(batch) % 2 == 0  # some examples' last key is padding
    params = list(model.parameters())
    rows = []
    for i in range(batch):
        mask_i = attn_mask[i * heads : (i + 1) * heads]
        loss = F.cross_entropy(model(x[i : i + 1], mask_i, padding[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    reference = torch.stack(rows)
    with PerSampleStats(model, "sum") as stats:
        F.cross_entropy(model(x, attn_mask, padding), y, reduction="sum").backward()
        reference_tools.assert_matches(stats, reference)


class AttentionWeightsInTheLoss(nn.Module):
    """A loss term on the attention weights themselves (an entropy regulariser, a distillation
    target): a gradient reaches the layer through its second output."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attention(x, x, x)  # need_weights=True: (B, T, S), averaged heads
        entropy = -(weights * weights.clamp_min(1e-9).log()).sum(dim=(1, 2))
        return self.head(out).sum(dim=(1, 2)) + 0.1 * entropy


def test_a_loss_on_the_attention_weights_is_refused():
    """The rule replays only the layer's first output: the weights' share of each example's
    gradient was left out without a word (caught on the identity check's steps only)."""
    torch.manual_seed(0)
    model = AttentionWeightsInTheLoss()
    with PerSampleStats(model, "sum", check_identity=False) as stats:
        model(torch.randn(4, 5, 8)).square().sum().backward()
        with pytest.raises(NotImplementedError, match=r"'attention'.*attention weights"):
            stats.norms_squared()


class AttentionWeightsUnused(AttentionWeightsInTheLoss):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attention(x, x, x)  # the weights need grad, and no loss uses them
        return self.head(out).sum(dim=(1, 2))


def test_attention_weights_returned_but_not_in_the_loss_are_read_as_usual(float64, reference_tools):
    """``need_weights=True`` (the default) returns weights that need grad; unused, they receive
    no gradient, and the read is exact."""
    torch.manual_seed(0)
    model, x = AttentionWeightsUnused(), torch.randn(4, 5, 8)
    params = list(model.parameters())
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            model(x[i : i + 1]).square().sum(), params
        )])
        for i in range(4)
    ]  # fmt: skip
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, torch.stack(rows))
