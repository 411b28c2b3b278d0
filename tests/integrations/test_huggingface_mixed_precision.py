"""GrabkitTrainer under mixed precision on the CPU: ``bf16=True`` (accelerate's bf16 autocast),
and a ``torch.amp.GradScaler`` on the losses as Trainer's ``fp16=True`` puts one there on a GPU.

bf16: each capability against a slow reference under the same autocast (per-example
``torch.autograd.grad``, a plain accumulation loop, the run without the measurement, the
uninterrupted run). The GradScaler: accelerate builds one only for fp16 on an accelerator, so
the tests put a CPU ``GradScaler`` on the Trainer's accelerator, which then scales each loss
before its backward (``Accelerator.backward``) and unscales and steps through it
(``AcceleratedOptimizer.step``), as on a GPU; the scales are powers of two, so the run equals
the unscaled one and every statistic must too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from tests.integrations.test_huggingface import arguments, gnts  # noqa: E402
from tests.integrations.tiny import B, N, batch, dataset, params, tiny_bert  # noqa: E402

import grabkit.integrations.huggingface as huggingface  # noqa: E402
from grabkit.integrations.huggingface import GrabkitTrainer  # noqa: E402
from grabkit.noise import AccumulationNoiseScale  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402
from grabkit.stats import IdentityCheckError  # noqa: E402

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16


def bf16_arguments(out, **overrides):
    return arguments(out, bf16=True, **overrides)


# -- grab= -----------------------------------------------------------------------------------------
class _WithReferenceGradients(GrabkitTrainer):
    """Before each microbatch: its per-example gradients by ``torch.autograd.grad`` of each
    example's loss (Trainer's mean over 2 microbatches), from a twin of the model without hooks,
    under the same bf16 autocast, flattened (B, d) in ``named_parameters`` order."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        twin = tiny_bert()
        twin.load_state_dict(self.model.state_dict())
        with torch.autocast("cpu", dtype=BF16):
            logits = twin(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        losses = F.cross_entropy(logits.float(), inputs["labels"], reduction="none") / 2
        rows = []
        for loss in losses:
            grads = torch.autograd.grad(loss, list(twin.parameters()), retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        self.reference_gradients.append(torch.stack(rows))
        return super().training_step(model, inputs, num_items_in_batch)


def test_bf16_grab_balances_the_per_example_gradients_autograd_gives(tmp_path, monkeypatch):
    """Under bf16 autocast the hooks' per-example gradients are autograd's per example (to bf16's
    rounding), and the orders are those GraB computes from autograd's per-example gradients,
    the identity check passing at every step."""
    grams = []
    real_step = huggingface.step_sampler

    def recording_step(sampler, scaler=None):
        grams.append(sampler.stats.gram().double())
        real_step(sampler, scaler)

    monkeypatch.setattr(huggingface, "step_sampler", recording_step)
    options = {"record_orders": True, "stats_options": {"check_identity": "always"}}
    trainer = _WithReferenceGradients(
        tiny_bert(), bf16_arguments(tmp_path), train_dataset=dataset(), grab=options
    )
    trainer.reference_gradients = []
    trainer.model_accepts_loss_kwargs = False  # BERT's loss is a mean: Trainer divides by 2
    trainer.train()
    assert len(grams) == len(trainer.reference_gradients) == 2 * N // B
    for gram, rows in zip(grams, trainer.reference_gradients, strict=True):
        expected = rows.double() @ rows.double().T
        assert (gram - expected).abs().max() <= 2**-8 * expected.abs().max()

    reference = GraBSampler(dataset(), list(tiny_bert().parameters()), seed=0, record_orders=True)
    batches = iter(trainer.reference_gradients)
    for epoch in range(2):
        reference.set_epoch(epoch)
        list(reference)
        for _ in range(N // B):
            reference.step(next(batches))
    assert trainer.grab_sampler.orders_history == reference.orders_history


def test_grab_trains_a_bf16_model(tmp_path):
    """A model loaded in bf16 (torch_dtype=torch.bfloat16), with bf16=True: the identity check
    once took the bf16 gradients autograd delivers for float32 ones and raised at the first step."""
    options = {"record_orders": True, "stats_options": {"check_identity": "always"}}
    trainer = GrabkitTrainer(
        tiny_bert().to(BF16), bf16_arguments(tmp_path), train_dataset=dataset(), grab=options
    )
    trainer.train()
    assert trainer.grab_sampler.state_dict()["live"]["stepped"] == N
    assert len(trainer.grab_sampler.orders_history) == 2


class _Penalised(GrabkitTrainer):
    """A loss with an L2 penalty on the classifier: not a sum over examples."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss + model.classifier.weight.float().square().sum()


def test_bf16_grab_refuses_a_loss_that_is_not_a_sum_over_examples(tmp_path):
    """The penalty's gradient is about twice the data's: caught under bf16 autocast (it once
    passed, and GraB balanced the per-example gradients of another loss)."""
    trainer = _Penalised(
        tiny_bert(), bf16_arguments(tmp_path, num_train_epochs=1), train_dataset=dataset(),
        grab={"stats_options": {"check_identity": "always"}},
    )  # fmt: skip
    trainer.model_accepts_loss_kwargs = False
    with pytest.raises(IdentityCheckError, match=r"(?s)'classifier\.weight'.*batch_term"):
        trainer.train()


# -- noise_scale= ----------------------------------------------------------------------------------
def _bf16_noise_reference(steps_per_epoch: int = N // (2 * B)):
    """The plain loop under bf16 autocast: 2 microbatches of B a step, each mean loss / 2."""
    model, data = tiny_bert(), dataset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gns = AccumulationNoiseScale(model, update_rate=0.5)
    result = None
    for start in range(0, steps_per_epoch * 2 * B, 2 * B):
        for micro in (range(start, start + B), range(start + B, start + 2 * B)):
            with torch.autocast("cpu", dtype=BF16):
                loss = model(**batch(data, list(micro))).loss
            (loss.float() / 2).backward()
            gns.end_microbatch(B)
        result = gns.end_step()
        opt.step()
        opt.zero_grad()
    return result


def test_bf16_noise_scale_equals_the_plain_autocast_loop(tmp_path):
    args = bf16_arguments(tmp_path, num_train_epochs=1, train_sampling_strategy="sequential")
    trainer = GrabkitTrainer(
        tiny_bert(), args, train_dataset=dataset(), noise_scale={"update_rate": 0.5}
    )
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    expected, got = _bf16_noise_reference(), trainer.noise_scale_result
    assert got.observations == expected.observations == N // (2 * B)
    # finite (b_simple may be infinite: an unbiased |G|^2 estimate below 0 is an interval)
    assert torch.isfinite(torch.tensor([got.grad_norm_sq, got.trace_sigma])).all()
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-5)
    assert got.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-5)


def test_bf16_noise_scale_never_changes_training(tmp_path):
    def run(out, **kwargs):
        trainer = GrabkitTrainer(
            tiny_bert(), bf16_arguments(out, max_grad_norm=1.0), train_dataset=dataset(), **kwargs
        )
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return params(trainer.model), losses, trainer

    plain, plain_losses, _ = run(tmp_path / "plain")
    measured, losses, trainer = run(tmp_path / "noise", noise_scale={})
    assert losses == plain_losses
    for name, value in measured.items():
        assert torch.equal(value, plain[name]), name
    assert trainer.noise_scale_result is not None


# -- resume ----------------------------------------------------------------------------------------
def test_bf16_resume_mid_epoch_is_bitwise(tmp_path):
    def run(resume=None):
        args = bf16_arguments(tmp_path, save_strategy="steps", save_steps=2, num_train_epochs=3)
        trainer = GrabkitTrainer(
            tiny_bert(), args, train_dataset=dataset(), grab={}, noise_scale={"update_rate": 0.5}
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run()  # 3 updates an epoch: checkpoint-8 is inside epoch 2
    resumed = run(str(tmp_path / "checkpoint-8"))
    assert torch.equal(resumed.grab_sampler.order, full.grab_sampler.order)
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name
    assert resumed.noise_scale_result.as_dict() == full.noise_scale_result.as_dict()


# -- a GradScaler on the losses (Trainer's fp16 path) ----------------------------------------------
def _scaled(trainer: GrabkitTrainer) -> GrabkitTrainer:
    """Trainer's fp16 loss scaling, on the CPU: a GradScaler whose scale doubles every step
    (2^10, 2^11, ...), so that every window's gradients carry another factor."""
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return trainer


def test_a_loss_scale_is_divided_out_of_the_noise_scale(tmp_path):
    """Once silently measured on the scaled gradients: |G|^2 and tr(Sigma) off by the square of
    a scale that changes from window to window."""

    def run(out, scaled):
        args = arguments(out, num_train_epochs=1, train_sampling_strategy="sequential")
        trainer = GrabkitTrainer(
            tiny_bert(), args, train_dataset=dataset(), noise_scale={"update_rate": 0.5}
        )
        trainer.model_accepts_loss_kwargs = False
        (_scaled(trainer) if scaled else trainer).train()
        return trainer

    plain, scaled = run(tmp_path / "plain", False), run(tmp_path / "scaled", True)
    assert scaled.accelerator.scaler.get_scale() == 2.0 ** (10 + N // (2 * B))  # it scaled
    for name, value in params(scaled.model).items():
        assert torch.equal(value, params(plain.model)[name]), name  # powers of two: same run
    expected, got = plain.noise_scale_result, scaled.noise_scale_result
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-6)
    assert got.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-6)


def test_a_loss_scale_is_divided_out_of_grab(tmp_path):
    def run(out, scaled):
        trainer = GrabkitTrainer(
            tiny_bert(), arguments(out), train_dataset=dataset(), grab={"record_orders": True}
        )
        (_scaled(trainer) if scaled else trainer).train()
        return trainer

    plain, scaled = run(tmp_path / "plain", False), run(tmp_path / "scaled", True)
    assert scaled.accelerator.scaler.get_scale() == 2.0 ** (10 + N // B)
    assert scaled.grab_sampler.orders_history == plain.grab_sampler.orders_history
    for name, value in params(scaled.model).items():
        assert torch.equal(value, params(plain.model)[name]), name


def test_a_loss_scale_is_divided_out_of_the_logged_per_example_norms(tmp_path):
    """Once logged as backpropagated: each norm times a scale that doubles every step."""

    def run(out, scaled):
        norms = huggingface.ExampleGradientNormsCallback()
        kept = []
        trainer = GrabkitTrainer(
            tiny_bert(), arguments(out, num_train_epochs=1), train_dataset=dataset(),
            callbacks=[norms],
        )  # fmt: skip
        original = norms.after_backward

        def keep(scaler):
            original(scaler)
            kept.append(norms.norms.take())

        norms.after_backward = keep
        (_scaled(trainer) if scaled else trainer).train()
        return trainer, torch.cat(kept)

    (_, plain), (trainer, scaled) = run(tmp_path / "plain", False), run(tmp_path / "s", True)
    assert trainer.accelerator.scaler.get_scale() > 2.0**10  # it scaled, more each step
    torch.testing.assert_close(scaled, plain, rtol=1e-5, atol=0.0)


def test_per_example_norms_under_fp16_need_the_grabkit_trainer(tmp_path):
    """A plain Trainer gives callbacks no access to its GradScaler: raised, not logged scaled."""
    norms = huggingface.ExampleGradientNormsCallback()
    args = arguments(tmp_path, num_train_epochs=1)
    args.fp16 = True  # what the callback reads; fp16 itself needs a GPU
    with pytest.raises(ValueError, match=r"fp16=True.*GrabkitTrainer"):
        norms.on_train_begin(args, None, None, model=tiny_bert())


# -- accumulation= ---------------------------------------------------------------------------------
def _adaptive_args(out, **overrides):
    options = dict(
        gradient_accumulation_steps=1, max_grad_norm=0.1, lr_scheduler_type="linear",
        max_steps=12, train_sampling_strategy="sequential",
    )  # fmt: skip
    return arguments(out, **{**options, **overrides})


def test_bf16_adaptive_accumulation_equals_the_plain_autocast_loop(tmp_path):
    from transformers import get_linear_schedule_with_warmup

    trainer = GrabkitTrainer(
        tiny_bert(), _adaptive_args(tmp_path, bf16=True), train_dataset=dataset(), accumulation=gnts
    )
    trainer.train()
    model, data = tiny_bert(), dataset()
    wrapper = gnts(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper.clip_grad_norm = 0.1
    schedule = get_linear_schedule_with_warmup(wrapper, 0, 12)
    for step in range(12):
        with torch.autocast("cpu", dtype=BF16):
            loss = model(**batch(data, [(step * B + i) % N for i in range(B)])).loss
        loss.float().backward()
        wrapper.step(count=B)
        if step == 11:
            wrapper.flush()
        schedule.step()
    assert 0 < wrapper.num_steps == trainer._adaptive_wrapper().num_steps < 12
    for name, value in params(model).items():
        torch.testing.assert_close(params(trainer.model)[name], value, rtol=1e-5, atol=1e-7)


def test_a_loss_scale_leaves_adaptive_accumulation_unchanged(tmp_path):
    """The scaler unscales before the wrapper folds each microbatch in (AcceleratedOptimizer:
    scaler.step(wrapper)), so a scale that changes every microbatch changes nothing."""

    def run(out, scaled):
        trainer = GrabkitTrainer(
            tiny_bert(), _adaptive_args(out), train_dataset=dataset(), accumulation=gnts
        )
        (_scaled(trainer) if scaled else trainer).train()
        return trainer

    plain, scaled = run(tmp_path / "plain", False), run(tmp_path / "scaled", True)
    assert scaled.accelerator.scaler.get_scale() == 2.0 ** (10 + 12)
    assert scaled._adaptive_wrapper().num_steps == plain._adaptive_wrapper().num_steps
    for name, value in params(scaled.model).items():
        assert torch.equal(value, params(plain.model)[name]), name
