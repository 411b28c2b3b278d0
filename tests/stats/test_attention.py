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
    ],
)
@pytest.mark.parametrize(("batch", "length"), [(3, 5), (4, 6)])
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
