"""``GrabkitTrainer`` at Trainer lifecycle edges, tiny BERT from a config, CPU: evaluation
during training, a fit stopped by a callback or ended, then resumed with more epochs, and the
weighting of a model whose loss ignores ``num_items_in_batch``.

Trainer decides how a window's microbatches are weighted from the model's signature: a forward
that takes ``**kwargs`` is taken to normalize its loss by ``num_items_in_batch`` (the window's
label count), so Trainer does not divide the loss by ``gradient_accumulation_steps``. A model
that computes its own mean anyway (``BertForSequenceClassification``) then accumulates the
*sum* of its microbatch means, and a noise scale that weights the microbatches by their labels
would measure a window that is not what it assumes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.integrations.test_huggingface import arguments
from tests.integrations.tiny import StopAt, batch, dataset, params, tiny_bert

from grabkit.integrations.huggingface import GrabkitTrainer
from grabkit.noise import AccumulationNoiseScale

pytestmark = pytest.mark.slow


def test_a_loss_that_ignores_num_items_is_weighted_as_trainer_weights_it(tmp_path):
    """BERT's forward takes ``**kwargs`` but its loss is its own microbatch mean: Trainer adds
    the means of a window (equal shares). 22 examples in batches of 4, windows of 2: the last
    window holds 4 + 2 examples, whose gradient g_1 + g_2 is no count-weighted mean, so it is
    left out; the other windows are measured as the plain loop over the same sums measures
    them (|G|^2 and tr(Sigma) of the sum, B_simple unchanged)."""
    args = arguments(
        tmp_path, num_train_epochs=1, max_grad_norm=0.0, train_sampling_strategy="sequential"
    )
    data = dataset()[:22]
    trainer = GrabkitTrainer(
        tiny_bert(), args, train_dataset=data, noise_scale={"update_rate": 0.5}
    )
    trainer.train()
    model = tiny_bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    estimator = AccumulationNoiseScale(model, update_rate=0.5)
    for start in range(0, 22, 2 * 4):
        micros = [range(start, min(start + 4, 22)), range(start + 4, min(start + 8, 22))]
        for micro in micros:
            model(**batch(data, list(micro))).loss.backward()  # Trainer divides by nothing
            estimator.end_microbatch(len(micro))
        if len({len(m) for m in micros}) == 1:
            estimator.end_step()
        else:
            estimator.discard_step()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in params(model).items():  # the same training
        torch.testing.assert_close(params(trainer.model)[name], value, rtol=1e-5, atol=1e-6)
    got, expected = trainer.noise_scale_result, estimator.estimate
    assert got.observations == expected.observations == 2
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-5)
    assert got.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-5)


class _NormalisedHead(torch.nn.Module):
    """A classifier with a BatchNorm whose forward takes ``**kwargs`` (so Trainer passes it
    ``num_items_in_batch``) and returns its own mean loss, as BERT's does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        ).double()

    def forward(self, x, labels=None, **kwargs):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_the_weighting_probe_leaves_the_running_statistics_as_training_left_them(tmp_path):
    """The probe's two extra forwards run in training mode: a BatchNorm's running statistics
    must end as in the run without the noise scale, bitwise, with the parameters."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (20,), generator=gen)
    data = [{"x": x[i], "labels": y[i]} for i in range(20)]
    runs = []
    for options in ({}, {"noise_scale": {"update_rate": 0.5}}):
        args = arguments(tmp_path, num_train_epochs=1, train_sampling_strategy="sequential")
        trainer = GrabkitTrainer(_NormalisedHead(), args, train_dataset=data, **options)
        trainer.train()
        runs.append(trainer.model.state_dict())
    assert runs[1]["net.1.num_batches_tracked"] == runs[0]["net.1.num_batches_tracked"] == 5
    for name, value in runs[0].items():
        assert torch.equal(runs[1][name], value), name


def _run(out, resume=None, callbacks=(), **overrides) -> GrabkitTrainer:
    """3 updates an epoch; GraB and the noise scale; Trainer divides each mean by the steps."""
    trainer = GrabkitTrainer(
        tiny_bert(), arguments(out, **overrides), train_dataset=dataset(),
        eval_dataset=dataset()[:8], grab={"record_orders": True},
        noise_scale={"update_rate": 0.5}, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.model_accepts_loss_kwargs = False
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _assert_same_run(got: GrabkitTrainer, expected: GrabkitTrainer) -> None:
    assert got.state.global_step == expected.state.global_step
    assert got.grab_sampler.orders_history[-1] == expected.grab_sampler.orders_history[-1]
    for name, value in params(expected.model).items():
        assert torch.equal(params(got.model)[name], value), name
    assert got.noise_scale_result.as_dict() == expected.noise_scale_result.as_dict()


def test_evaluation_stops_and_continued_fits_leave_the_uninterrupted_run(tmp_path):
    """Evaluation after every step (forwards without gradients) changes nothing; a fit stopped
    by a callback mid-epoch, or ended after 2 epochs, and resumed from its checkpoint with 3
    epochs ends with the 3-epoch run's order, parameters and estimate."""
    plain = _run(tmp_path / "plain", num_train_epochs=3)
    evaluated = _run(tmp_path / "eval", num_train_epochs=3, eval_strategy="steps", eval_steps=1)
    _assert_same_run(evaluated, plain)
    assert any("eval_loss" in entry for entry in evaluated.state.log_history)
    saving = {"save_strategy": "steps", "save_steps": 4}
    _run(tmp_path / "stopped", callbacks=[StopAt(4)], num_train_epochs=3, **saving)
    resumed = _run(
        tmp_path / "stopped", str(tmp_path / "stopped" / "checkpoint-4"), num_train_epochs=3
    )
    _assert_same_run(resumed, plain)
    _run(tmp_path / "two", num_train_epochs=2, save_strategy="epoch")
    continued = _run(tmp_path / "two", str(tmp_path / "two" / "checkpoint-6"), num_train_epochs=3)
    _assert_same_run(continued, plain)
