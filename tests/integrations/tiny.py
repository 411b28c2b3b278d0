"""The tiny model, data and plain-loop references shared by the framework tests."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from grabkit.noise import AccumulationNoiseScale
from grabkit.order import GraBSampler

N, T, B = 24, 6, 4


class StopAt(TrainerCallback):
    """Stop training after optimizer step ``at`` (as ``EarlyStoppingCallback`` does)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=T, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def tiny_gpt2(n_positions: int = 8):
    """A causal LM whose loss is the window's token sum over ``num_items_in_batch``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=40, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def lm_dataset(length: int = 8) -> list[dict[str, torch.Tensor]]:
    """N rows of ``length`` tokens, labels = inputs (the model shifts them)."""
    ids = torch.randint(0, 40, (N, length), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": row, "labels": row} for row in ids]


def ragged_lm_dataset(longest: int = 24) -> list[dict[str, torch.Tensor]]:
    """N token rows of lengths 1 .. ``longest`` (a tiny vocabulary of 40)."""
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, longest + 1, (N,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, 40, (n,), generator=g)} for n in lengths]


def pad_right(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: attention_mask, and labels -100 at padding."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = row["input_ids"]
        mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tiny_llama(max_positions: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (N, T), generator=g)
    labels = torch.randint(0, 2, (N,), generator=g)
    # position_ids in the batch: per-example statistics need the batch in dim 0 of every layer
    positions = torch.arange(T)
    return [{"input_ids": ids[i], "position_ids": positions, "labels": labels[i]} for i in range(N)]


def batch(data, indices) -> dict[str, torch.Tensor]:
    return {k: torch.stack([data[i][k] for i in indices]) for k in data[0]}


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def plain_grab_loop(epochs: int = 2):
    """The reference: the same model, data and sampler, stepped after every microbatch."""
    model, data = tiny_bert(), dataset()
    sampler = GraBSampler(data, model=model, seed=0, record_orders=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, N, 2 * B):
            for micro in (order[start : start + B], order[start + B : start + 2 * B]):
                (model(**batch(data, micro)).loss / 2).backward()
                sampler.step()  # the loss is each microbatch's mean / 2
            opt.step()
            opt.zero_grad()
    return sampler.orders_history, params(model)


def plain_noise_scale(clip: float, measure_after_clipping: bool = False):
    """The reference loop: 2 microbatches a step, clipped at ``clip`` as Trainer does."""
    model, data = tiny_bert(), dataset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gns = AccumulationNoiseScale(model, update_rate=0.5)
    result = None
    for start in range(0, N, 2 * B):
        for micro in (range(start, start + B), range(start + B, start + 2 * B)):
            (model(**batch(data, list(micro))).loss / 2).backward()
            gns.end_microbatch(B)
        if not measure_after_clipping:
            result = gns.end_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if measure_after_clipping:
            result = gns.end_step()
        opt.step()
        opt.zero_grad()
    return result
