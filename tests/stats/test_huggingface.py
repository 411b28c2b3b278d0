"""Hugging Face models from tiny configs (no downloads): GPT-2 (Conv1D, tied head, (1, T)
position ids) and BERT (token types, pooler), against per-example ``torch.autograd.grad``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grabkit.stats import PerSampleStats

transformers = pytest.importorskip("transformers")

VOCAB = 13


def reference_rows(model, loss_of, inputs) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(inputs.shape[0]):
        grads = torch.autograd.grad(loss_of(model, inputs[i : i + 1]).sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def gpt2_losses(model, idx):
    logits = model(input_ids=idx).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
    return per_token.view(idx.shape).sum(dim=1)


def bert_losses(model, idx):
    logits = model(input_ids=idx).logits
    return F.cross_entropy(logits, idx[:, 0] % 2, reduction="none")


def tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=8,
        n_embd=8,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
        pad_token_id=0,
    )
    return transformers.BertForSequenceClassification(config)


@pytest.mark.slow
@pytest.mark.parametrize(("make", "loss_of"), [(tiny_gpt2, gpt2_losses), (tiny_bert, bert_losses)])
@pytest.mark.parametrize(("batch", "length"), [(3, 5), (4, 4)])
def test_huggingface_models_match_per_example_autograd(
    float64, reference_tools, make, loss_of, batch, length
):
    torch.manual_seed(0)
    model = make()
    idx = torch.randint(1, VOCAB, (batch, length))
    reference = reference_rows(model, loss_of, idx)
    with PerSampleStats(model, "sum") as stats:
        loss_of(model, idx).sum().backward()
        reference_tools.assert_matches(stats, reference)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False])
def test_gpt2_gradient_checkpointing_gives_the_same_statistics(float64, reference_tools, reentrant):
    torch.manual_seed(1)
    model = tiny_gpt2()
    idx = torch.randint(1, VOCAB, (3, 5))
    reference = reference_rows(model, gpt2_losses, idx)  # without checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()  # Hugging Face checkpoints only in training mode (the tiny config has no dropout)
    calls = []
    model.transformer.h[0].ln_1.register_forward_hook(lambda *_: calls.append(1))
    with PerSampleStats(model, "sum") as stats:
        gpt2_losses(model, idx).sum().backward()
        assert len(calls) == 2  # the block ran again during the backward
        reference_tools.assert_matches(stats, reference)
