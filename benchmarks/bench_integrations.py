"""Overhead of each framework integration over the same framework without it.

One short training run (tiny BERT from a config, 1 epoch) per call; each integration is timed
side by side with the framework's own run on the same data (interleaved rounds, medians):

* HF Trainer: ``GrabkitTrainer(grab=...)``, ``(noise_scale=...)`` vs ``Trainer`` (accumulation 2);
  ``GrabkitTrainer(accumulation=GNTS)`` vs ``Trainer(optimizers=(GNTS wrapper, None))``.
* Lightning: ``GraBCallback``, ``NoiseScaleCallback``, ``AdaptiveAccumulationCallback`` vs the
  same ``Trainer`` without the callback (the GraB run's loader uses the sampler either way).
* accelerate: the loop with ``sampler.step()`` + ``SamplerCheckpoint`` vs the loop with a random
  sampler; ``adaptive_step(count=)`` vs ``optimizer.step()`` on the same wrapper.

The ratios include GraB's and the estimators' own work (per-example statistics, balancing),
which is what a user pays for switching the capability on. Usage:
``python benchmarks/run.py integrations [--quick]``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings

import torch

from benchmarks.common import machine_description, time_side_by_side

N, T, B = 128, 32, 16


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=T, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def dataset():
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 500, (N, T), generator=g), torch.randint(0, 2, (N,), generator=g)
    positions = torch.arange(T)
    return [{"input_ids": ids[i], "position_ids": positions, "labels": labels[i]} for i in range(N)]


def gnts(optimizer):
    from grabkit import OptimizerWrapperGNTS

    return OptimizerWrapperGNTS(optimizer, max_batch_draws=4, norm_threshold=0.1)


def huggingface(root: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from grabkit.integrations.huggingface import GrabkitTrainer

    def args(accumulation=2):
        return TrainingArguments(
            root, per_device_train_batch_size=B, gradient_accumulation_steps=accumulation,
            num_train_epochs=1, optim="sgd", report_to=[], use_cpu=True, save_strategy="no",
            disable_tqdm=True, log_level="error", logging_steps=1000,
        )  # fmt: skip

    def wrapped_plain():
        model = tiny_bert()
        wrapper = gnts(torch.optim.SGD(model.parameters(), lr=0.1))
        Trainer(model, args(1), train_dataset=dataset(), optimizers=(wrapper, None)).train()

    return {
        "HF Trainer": lambda: Trainer(tiny_bert(), args(), train_dataset=dataset()).train(),
        "HF GrabkitTrainer(grab)": lambda: GrabkitTrainer(
            tiny_bert(), args(), train_dataset=dataset(), grab={}
        ).train(),
        "HF GrabkitTrainer(noise_scale)": lambda: GrabkitTrainer(
            tiny_bert(), args(), train_dataset=dataset(), noise_scale={}
        ).train(),
        "HF Trainer + GNTS wrapper": wrapped_plain,
        "HF GrabkitTrainer(accumulation=GNTS)": lambda: GrabkitTrainer(
            tiny_bert(), args(1), train_dataset=dataset(), accumulation=gnts
        ).train(),
    }


def lightning(root: str) -> dict:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from grabkit.integrations.lightning import (
        AdaptiveAccumulationCallback,
        GraBCallback,
        NoiseScaleCallback,
    )
    from grabkit.order import GraBSampler

    class Module(L.LightningModule):
        def __init__(self, wrap=False):
            super().__init__()
            self.net, self.wrap = tiny_bert(), wrap

        def training_step(self, batch, batch_idx):
            return self.net(**batch).loss

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return gnts(optimizer) if self.wrap else optimizer

    def fit(callback=None, grab=False, wrap=False, accumulation=2):
        module, data = Module(wrap), dataset()
        sampler = GraBSampler(data, model=module.net) if grab else None
        loader = DataLoader(data, batch_size=B, sampler=sampler)
        callbacks = [] if callback is None else [callback(sampler) if grab else callback()]
        L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulation,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
        ).fit(module, loader)  # fmt: skip

    return {
        "Lightning": lambda: fit(),
        "Lightning + GraBCallback": lambda: fit(GraBCallback, grab=True),
        "Lightning + NoiseScaleCallback": lambda: fit(NoiseScaleCallback),
        "Lightning + GNTS wrapper": lambda: fit(wrap=True, accumulation=1),
        "Lightning + AdaptiveAccumulationCallback": lambda: fit(
            AdaptiveAccumulationCallback, wrap=True, accumulation=1
        ),
    }


def accelerate_loops(root: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from grabkit.integrations.accelerate import SamplerCheckpoint, adaptive_step
    from grabkit.order import GraBSampler

    def loop(grab=False, adaptive=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True)
        model, data = tiny_bert(), dataset()
        sampler = GraBSampler(data, model=model) if grab else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if adaptive is not None:
            optimizer = gnts(optimizer)
        loader = DataLoader(data, batch_size=B, sampler=sampler, shuffle=not grab)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if grab:
            accelerator.register_for_checkpointing(SamplerCheckpoint(sampler))
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            if grab:
                sampler.step()
            if adaptive:
                adaptive_step(optimizer, count=B)
            else:
                optimizer.step()
            optimizer.zero_grad()

    return {
        "accelerate loop": lambda: loop(),
        "accelerate loop + GraB": lambda: loop(grab=True),
        "accelerate loop + GNTS optimizer.step()": lambda: loop(adaptive=False),
        "accelerate loop + GNTS adaptive_step(count=)": lambda: loop(adaptive=True),
    }


PAIRS = [
    ("HF GrabkitTrainer(grab)", "HF Trainer"),
    ("HF GrabkitTrainer(noise_scale)", "HF Trainer"),
    ("HF GrabkitTrainer(accumulation=GNTS)", "HF Trainer + GNTS wrapper"),
    ("Lightning + GraBCallback", "Lightning"),
    ("Lightning + NoiseScaleCallback", "Lightning"),
    ("Lightning + AdaptiveAccumulationCallback", "Lightning + GNTS wrapper"),
    ("accelerate loop + GraB", "accelerate loop"),
    ("accelerate loop + GNTS adaptive_step(count=)", "accelerate loop + GNTS optimizer.step()"),
]


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as root:
        contenders = {**huggingface(root), **lightning(root), **accelerate_loops(root)}
        times = time_side_by_side(contenders, rounds=2 if quick else 5, warmup=1)
    print(machine_description())
    print(f"\ntiny BERT (2 layers, width 64), {N} examples of {T} tokens, batch {B}, 1 epoch\n")
    print("| integration | baseline | integration s | baseline s | ratio |")
    print("|---|---|---|---|---|")
    for name, base in PAIRS:
        ratio = times[name] / times[base]
        print(f"| {name} | {base} | {times[name]:.2f} | {times[base]:.2f} | {ratio:.2f}x |")
