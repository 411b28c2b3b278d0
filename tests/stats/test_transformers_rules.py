"""Hugging Face RMSNorm layers (Llama, Qwen, Mistral, Gemma's 1 + weight, T5's LayerNorm) and
Gemma's scaled word embedding: rules by class name, checked class by class and in tiny models
built from configs (no downloads) against per-example ``torch.autograd.grad`` in float64."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats, SketchedStats
from grabkit.stats.transformers_rules import TRANSFORMERS_RULES, ScaledEmbeddingRule

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("float64")

VOCAB = 13
NORMS = sorted(q for q, rule in TRANSFORMERS_RULES.items() if rule is not ScaledEmbeddingRule)
EMBEDDINGS = sorted(q for q, rule in TRANSFORMERS_RULES.items() if rule is ScaledEmbeddingRule)


def norm_class(qualified: str) -> type[nn.Module]:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


class Sandwich(nn.Module):
    """Linear -> the norm -> Linear over (B, T, features)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(5, 6), norm, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.inp(x)))).sum(dim=1)


def reference_rows(model: nn.Module, loss_of, inputs: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(inputs.shape[0]):
        grads = torch.autograd.grad(loss_of(model, inputs[i : i + 1]).sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def sandwich_losses(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum(dim=1)


@pytest.mark.parametrize("qualified", NORMS)
def test_every_named_norm_matches_per_example_autograd(qualified, reference_tools):
    torch.manual_seed(0)
    norm = norm_class(qualified)(6, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()  # Gemma's starts at zero, the others at one
    model = Sandwich(norm)
    x = torch.randn(4, 3, 5)
    reference = reference_rows(model, sandwich_losses, x)
    with PerSampleStats(model, "sum") as stats:
        sandwich_losses(model, x).sum().backward()
        reference_tools.assert_matches(stats, reference)


@pytest.mark.parametrize("qualified", EMBEDDINGS)
def test_scaled_embeddings_match_per_example_autograd(qualified, reference_tools):
    torch.manual_seed(0)
    model = nn.Sequential(norm_class(qualified)(VOCAB, 6, 0, embed_scale=2.5), nn.Linear(6, 3))
    idx = torch.randint(0, VOCAB, (4, 5))  # index 0 is padding_idx: no gradient there
    reference = reference_rows(model, lambda m, i: m(i).pow(2).sum(dim=(1, 2)), idx)
    with PerSampleStats(model, "sum") as stats:
        model(idx).pow(2).sum().backward()
        reference_tools.assert_matches(stats, reference)


def test_an_overridden_forward_gets_no_rule():
    class Shifted(norm_class("transformers.models.llama.modeling_llama.LlamaRMSNorm")):
        def forward(self, x):
            return super().forward(x) + 1.0

    with pytest.raises(ValueError, match="no rule for it"):
        PerSampleStats(Sandwich(Shifted(6)))


def causal_lm_losses(model, idx):
    logits = model(input_ids=idx).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
    return per_token.view(idx.shape).sum(dim=1)


def t5_losses(model, idx):
    logits = model(input_ids=idx, decoder_input_ids=idx).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
    return per_token.view(idx.shape).sum(dim=1)


SMALL = dict(vocab_size=VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=2)
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)


def tiny(name: str) -> nn.Module:
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[name]
    extra = {"head_dim": 4} if name == "gemma" else {}
    return model_class(config_class(**SMALL, **HEADS, **extra))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma", "t5"])
def test_tiny_models_match_per_example_autograd(name, reference_tools):
    torch.manual_seed(0)
    model = tiny(name).double()
    for module in model.modules():  # Gemma's norms start at zero weight: a plain gradient
        if type(module).__name__.endswith("RMSNorm"):
            with torch.no_grad():
                module.weight.normal_()
    loss_of = t5_losses if name == "t5" else causal_lm_losses
    idx = torch.randint(1, VOCAB, (3, 5))
    reference = reference_rows(model, loss_of, idx)
    with PerSampleStats(model, "sum") as stats:
        loss_of(model, idx).sum().backward()
        reference_tools.assert_matches(stats, reference)


def t5_masked_losses(model, idx, mask):
    logits = model(input_ids=idx, attention_mask=mask, decoder_input_ids=idx).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
    return (per_token.view(idx.shape) * mask).sum(dim=1)


def tiny_t5(attention: str) -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).double()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_t5_relative_position_bias_is_exact_and_the_model_unchanged(attention, padded):
    """T5 looks its relative position bias up with (T, S) buckets shared by the batch and
    permutes the (T, S, H) result; the engine's batch expansion must not change what it
    computes, and every parameter (the bias included) gets exact per-example gradients."""
    model = tiny_t5(attention)
    idx = torch.randint(1, VOCAB, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.float64)
    if padded:
        mask[0, 3:] = 0
        mask[2, 4:] = 0
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(3):
        loss = t5_masked_losses(model, idx[i : i + 1], mask[i : i + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    reference = torch.stack(rows)
    biases = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert len(biases) == 2  # encoder and decoder
    with torch.no_grad():
        plain = model(input_ids=idx, attention_mask=mask, decoder_input_ids=idx).logits
    with PerSampleStats(model, "sum") as stats:
        logits = model(input_ids=idx, attention_mask=mask, decoder_input_ids=idx).logits
        assert logits.shape == plain.shape
        torch.testing.assert_close(logits.detach(), plain, rtol=1e-12, atol=0)
        model.zero_grad()
        t5_masked_losses(model, idx, mask).sum().backward()
        expected = reference.square().sum(1)
        torch.testing.assert_close(stats.norms_squared(), expected, rtol=1e-10, atol=0)
        torch.testing.assert_close(stats.gram(), reference @ reference.T, rtol=1e-10, atol=1e-12)
    model.zero_grad()
    with SketchedStats(model, dim=32, seed=1, loss_reduction="sum") as sketched:
        t5_masked_losses(model, idx, mask).sum().backward()
        expected = sketched.sketch.apply_dense(reference)
        torch.testing.assert_close(sketched.sketches(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("length", ["encoder", "decoder"])
def test_t5_with_a_sequence_as_long_as_the_batch_is_refused(length, attention):
    """T5's (T, T) relative-position buckets, made inside the forward and shared by the batch,
    have the batch size in dim 0 when T == B, like a tensor of one row per example: the bias's
    per-example gradients were 74-450% off in their norms, silently. The model then permutes
    the bias's dim 0 away, which tells them apart at run time: refused, naming the fix."""
    model = tiny_t5(attention)
    idx = torch.randint(1, VOCAB, (3, 3 if length == "encoder" else 5))
    decoder = torch.randint(1, VOCAB, (3, 3 if length == "decoder" else 4))
    with PerSampleStats(model, "sum"), pytest.raises(ValueError, match="relative_attention_bias"):
        model(input_ids=idx, decoder_input_ids=decoder)
