"""``GrabkitTrainer`` at Trainer lifecycle edges, tiny BERT from a config, CPU.

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
from tests.integrations.tiny import batch, dataset, params, tiny_bert

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
