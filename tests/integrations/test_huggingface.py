"""GrabkitTrainer against the real transformers Trainer, tiny BERT from a config, CPU.

Each silent failure of the plain wiring is shown going wrong next to the integration
going right.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.integrations.tiny import (  # noqa: E402
    B,
    N,
    batch,
    dataset,
    lm_dataset,
    params,
    plain_grab_loop,
    plain_noise_scale,
    tiny_bert,
    tiny_gpt2,
)
from transformers import (  # noqa: E402
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.huggingface import GrabkitTrainer  # noqa: E402
from grabkit.noise import AccumulationNoiseScale  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


def arguments(out, **overrides) -> TrainingArguments:
    options = dict(
        per_device_train_batch_size=B, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
        seed=0, log_level="error",
    )  # fmt: skip
    options.update(overrides)
    return TrainingArguments(str(out), **options)


def test_grab_order_and_gradients_match_the_plain_loop(tmp_path):
    trainer = GrabkitTrainer(
        tiny_bert(), arguments(tmp_path), train_dataset=dataset(), grab={"record_orders": True}
    )
    trainer.model_accepts_loss_kwargs = False  # BERT's loss ignores num_items_in_batch: mean / 2
    trainer.train()
    orders, weights = plain_grab_loop()
    assert trainer.grab_sampler.orders_history == orders  # each epoch's visit order is GraB's
    assert trainer.grab_sampler.state_dict()["live"]["stepped"] == N  # every example stepped once
    for name, value in params(trainer.model).items():
        torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-6)


class _GraBSamplerTrainer(Trainer):
    """The naive wiring: a GraB sampler in Trainer, stepped from a callback."""

    def _get_train_sampler(self, train_dataset=None):
        if not hasattr(self, "grab_sampler"):
            self.grab_sampler = GraBSampler(self.train_dataset, model=self.model, seed=0)
        return self.grab_sampler


class _StepBeforeOptimizer(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.grab_sampler.step()


def test_a_callback_before_the_optimizer_step_balances_every_micro_batch(tmp_path):
    """Once silently half the examples; hook mode now balances every backward since step()."""
    trainer = _GraBSamplerTrainer(
        tiny_bert(), arguments(tmp_path, num_train_epochs=1), train_dataset=dataset()
    )
    trainer.add_callback(_StepBeforeOptimizer(trainer))
    trainer.train()
    assert trainer.grab_sampler.state_dict()["live"]["stepped"] == N  # every example


def _resumable(tmp_path, cls=GrabkitTrainer, workers=0, **kwargs):
    args = arguments(
        tmp_path, save_strategy="steps", save_steps=2, num_train_epochs=3,
        dataloader_num_workers=workers, dataloader_persistent_workers=workers > 0,
    )  # fmt: skip
    return cls(tiny_bert(), args, train_dataset=dataset(), **kwargs)


@pytest.mark.parametrize("workers", [0, 2])  # workers fetch batches ahead of training
def test_resume_from_trainer_checkpoint_is_bitwise(tmp_path, workers):
    full = _resumable(tmp_path / "full", workers=workers, grab={})
    full.train()  # 3 updates per epoch: checkpoint-8 is mid-epoch, after an epoch boundary
    resumed = _resumable(tmp_path / "full", grab={})
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))  # epoch 2
    assert torch.equal(resumed.grab_sampler.order, full.grab_sampler.order)
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name


def test_naive_resume_without_sampler_state_diverges(tmp_path):
    class Stepping(_GraBSamplerTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.grab_sampler.step()
            return loss

    full = _resumable(tmp_path / "full", cls=Stepping)
    full.train()
    resumed = _resumable(tmp_path / "full", cls=Stepping)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    assert not torch.equal(resumed.grab_sampler.order, full.grab_sampler.order)


def test_resume_from_a_checkpoint_without_sampler_state_is_refused(tmp_path):
    _resumable(tmp_path / "plain", cls=Trainer).train()
    trainer = _resumable(tmp_path / "plain", grab={})
    with pytest.raises(FileNotFoundError, match=r"grabkit_sampler\.pt"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))


def test_resume_with_ignore_data_skip_is_refused(tmp_path):
    trainer = GrabkitTrainer(
        tiny_bert(), arguments(tmp_path, ignore_data_skip=True), train_dataset=dataset(), grab={}
    )
    with pytest.raises(ValueError, match="ignore_data_skip=False"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# -- adaptive accumulation ------------------------------------------------------------------------
def gnts(optimizer):
    return OptimizerWrapperGNTS(optimizer, max_batch_draws=4, norm_threshold=0.1)


def _adaptive_reference(steps: int, clip: float):
    """The plain loop: every microbatch folded into the wrapper, the open window applied at the
    last microbatch, a linear LR schedule over the microbatches (Trainer's max_steps)."""
    from transformers import get_linear_schedule_with_warmup

    model, data = tiny_bert(), dataset()
    wrapper = gnts(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper.clip_grad_norm = clip
    schedule = get_linear_schedule_with_warmup(wrapper, 0, steps)
    for step in range(steps):
        rows = [(step * B + i) % N for i in range(B)]
        model(**batch(data, rows)).loss.backward()
        wrapper.step(count=B)
        if step == steps - 1:
            assert wrapper.flush()  # the open window, at the last microbatch's LR
        schedule.step()
    return model, wrapper


def test_adaptive_accumulation_applies_every_microbatch_and_the_schedule_reaches_zero(tmp_path):
    """The last window is applied at the last microbatch, and the linear schedule, counted in
    microbatches as Trainer counts it, ends at 0; the run equals the plain loop."""
    args = arguments(
        tmp_path, gradient_accumulation_steps=1, max_grad_norm=0.1, lr_scheduler_type="linear",
        max_steps=12, train_sampling_strategy="sequential",
    )  # fmt: skip
    trainer = GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), accumulation=gnts)
    trainer.train()
    wrapper = trainer._adaptive_wrapper()
    assert 0 < wrapper.num_steps < 12  # windows of several microbatches
    assert wrapper.counters.num_draws == 0  # nothing left unapplied
    assert wrapper.last_reason == "flushed"
    assert wrapper.clip_grad_norm == 0.1  # clipping handed to the wrapper, Trainer's is off
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0
    reference, reference_wrapper = _adaptive_reference(12, clip=0.1)
    assert reference_wrapper.num_steps == wrapper.num_steps
    for name, value in params(reference).items():
        torch.testing.assert_close(params(trainer.model)[name], value, rtol=1e-5, atol=1e-7)
    logged = [e for e in trainer.state.log_history if "grabkit/optimizer_updates" in e]
    assert logged[-1]["grabkit/optimizer_updates"] == wrapper.num_steps


def test_adaptive_accumulation_resumes_mid_window_bitwise(tmp_path):
    def run(resume=None):
        args = arguments(
            tmp_path, gradient_accumulation_steps=1, max_grad_norm=0.1, max_steps=12,
            lr_scheduler_type="linear", save_strategy="steps", save_steps=5,
        )  # fmt: skip
        trainer = GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), accumulation=gnts)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run()
    resumed = run(str(tmp_path / "checkpoint-5"))  # 5 microbatches: inside a window
    assert resumed._adaptive_wrapper().num_steps == full._adaptive_wrapper().num_steps
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name


def test_naive_wrapper_in_trainer_steps_every_microbatch(tmp_path):
    args = arguments(tmp_path, gradient_accumulation_steps=1, max_grad_norm=0.1, max_steps=12)
    model = tiny_bert()
    wrapper = gnts(torch.optim.SGD(model.parameters(), lr=0.1))
    Trainer(model, args, train_dataset=dataset(), optimizers=(wrapper, None)).train()
    assert wrapper.num_steps == 12  # Trainer clipped each microbatch to the threshold: no window


@pytest.mark.parametrize("capability", ["accumulation", "noise_scale"])
def test_a_microbatch_without_label_tokens_is_refused_naming_it(tmp_path, capability):
    # its weight would be 0 label tokens: accumulation= dropped the window as "not finite"
    data = lm_dataset()
    for row in data[B : 2 * B]:  # the second microbatch: every label ignored
        row["labels"] = torch.full_like(row["labels"], -100)
    accumulate = 1 if capability == "accumulation" else 2
    args = arguments(
        tmp_path, gradient_accumulation_steps=accumulate, max_steps=4,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    option = {"accumulation": gnts} if capability == "accumulation" else {"noise_scale": {}}
    trainer = GrabkitTrainer(tiny_gpt2(), args, train_dataset=data, **option)
    with pytest.raises(ValueError, match="no label tokens"):
        trainer.train()


def test_adaptive_accumulation_refuses_trainer_accumulation(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps should be 1"):
        GrabkitTrainer(tiny_bert(), arguments(tmp_path), train_dataset=dataset(), accumulation=gnts)


# -- noise scale ----------------------------------------------------------------------------------
def test_noise_scale_equals_the_plain_loop_and_is_measured_before_clipping(tmp_path):
    args = arguments(
        tmp_path, num_train_epochs=1, max_grad_norm=0.05, train_sampling_strategy="sequential"
    )
    trainer = GrabkitTrainer(
        tiny_bert(), args, train_dataset=dataset(), noise_scale={"update_rate": 0.5}
    )
    trainer.model_accepts_loss_kwargs = False  # Trainer divides each microbatch's mean by 2
    trainer.train()
    expected = plain_noise_scale(0.05)
    after_clipping = plain_noise_scale(0.05, measure_after_clipping=True)
    got = trainer.noise_scale_result
    assert got.observations == expected.observations == N // (2 * B)
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-5)
    assert got.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-5)
    assert after_clipping.grad_norm_sq != pytest.approx(expected.grad_norm_sq, rel=1e-2)
    logged = [e for e in trainer.state.log_history if "noise_scale/grad_norm_sq" in e]
    assert logged[-1]["noise_scale/grad_norm_sq"] == pytest.approx(expected.grad_norm_sq, rel=1e-5)


def test_noise_scale_in_tokens_for_a_causal_lm(tmp_path):
    """Tiny GPT-2, count="tokens": the loss averages the window's shifted label tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2():
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)

    ids = torch.randint(0, 40, (N, 8), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = arguments(tmp_path, num_train_epochs=1, train_sampling_strategy="sequential")
    trainer = GrabkitTrainer(
        gpt2(), args, train_dataset=data, noise_scale={"update_rate": 0.5}, count="tokens"
    )
    trainer.train()
    # Trainer divides each microbatch's token sum by the window's num_items_in_batch; this
    # transformers counts all 8 labels a row for GPT-2 (its loss_type is None, so the label
    # shift is not detected), and the integration counts tokens exactly as Trainer does, so
    # that the counts are the shares the loss was divided by.
    window_tokens = 2 * B * 8
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gns = AccumulationNoiseScale(model, update_rate=0.5)
    for start in range(0, N, 2 * B):
        for micro in (ids[start : start + B], ids[start + B : start + 2 * B]):
            token_sum = model(input_ids=micro, labels=micro).loss * B * 7  # 7 predicted a row
            (token_sum / window_tokens).backward()
            gns.end_microbatch(B * 8)
        expected = gns.end_step()
        opt.step()
        opt.zero_grad()
    got = trainer.noise_scale_result
    assert got.examples == expected.examples == N * 8
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-5)
    assert got.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-5)


def test_noise_scale_needs_trainer_accumulation(tmp_path):
    args = arguments(tmp_path, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps >= 2"):
        GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), noise_scale={})


def _trained(tmp_path, model_fn, data, kwargs, loss_kwargs=None, max_grad_norm=1.0):
    """Train 2 epochs (clipping on, as by default); parameters and logged losses."""
    args = arguments(tmp_path, max_grad_norm=max_grad_norm)
    trainer = GrabkitTrainer(model_fn(), args, train_dataset=data, **kwargs)
    if loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = loss_kwargs
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return params(trainer.model), losses, trainer


_MEASURING = {  # model, takes loss kwargs (None: as Trainer finds), GrabkitTrainer kwargs
    "gpt2-default": ("gpt2", None, {"noise_scale": {}}),
    "gpt2-tokens-examples-window": (
        "gpt2", None, {"noise_scale": {"window": "examples", "update_rate": 0.2}, "count": "tokens"}
    ),
    "bert-default": ("bert", None, {"noise_scale": {"confidence": 0.9}}),
    "bert-examples": ("bert", None, {"noise_scale": {}, "count": "examples"}),
    "bert-mean-losses": ("bert", False, {"noise_scale": {"population_size": N}}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_MEASURING))
def test_noise_scale_never_changes_training(tmp_path, case):
    """Every measuring option against the same run without it: parameters and logged losses
    bitwise (the noise scale once switched a causal LM's loss to microbatch means)."""
    kind, loss_kwargs, kwargs = _MEASURING[case]
    model_fn, data = (tiny_gpt2, lm_dataset()) if kind == "gpt2" else (tiny_bert, dataset())
    plain, plain_losses, _ = _trained(tmp_path / "plain", model_fn, data, {}, loss_kwargs)
    measured, losses, trainer = _trained(tmp_path / "noise", model_fn, data, kwargs, loss_kwargs)
    assert losses == plain_losses
    for name, value in measured.items():
        assert torch.equal(value, plain[name]), name
    assert trainer.noise_scale_result is not None  # and it measured
    assert any("noise_scale/b_simple" in e for e in trainer.state.log_history)


def test_causal_lm_noise_scale_is_per_token_by_default(tmp_path):
    """count="auto": Trainer normalizes a causal LM's window by its label tokens, so the
    microbatches are counted in tokens, as Trainer counts them (this transformers counts all 8
    labels of a row for GPT-2, whose loss_type is None); "examples" is refused."""
    *_, trainer = _trained(tmp_path, tiny_gpt2, lm_dataset(), {"noise_scale": {}})
    assert trainer.noise_scale_result.examples == 2 * N * 8  # 2 epochs of N rows of 8 tokens
    args = arguments(tmp_path / "examples")
    refused = GrabkitTrainer(
        tiny_gpt2(), args, train_dataset=lm_dataset(), noise_scale={}, count="examples"
    )
    with pytest.raises(ValueError, match=r'count="examples" would misweight.*"auto" or "tokens"'):
        refused.train()


def test_windows_of_unequal_microbatches_are_left_out_when_trainer_averages_means(tmp_path):
    """Trainer divides each microbatch's mean by the window's K: a window of microbatches of
    different sizes is not weighted by size, so it is not measured (N = 24 in batches of 5,
    K = 3: windows (5, 5, 5) and (5, 4))."""
    args = arguments(
        tmp_path, per_device_train_batch_size=5, gradient_accumulation_steps=3,
        num_train_epochs=1,
    )  # fmt: skip
    trainer = GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), noise_scale={})
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    assert trainer.noise_scale_result.observations == 1
    assert trainer.noise_scale_result.examples == 15
