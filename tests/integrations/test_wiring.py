"""The obvious wiring of grabkit objects into the frameworks, without the integration, warns once
with the integration to use; the integrations themselves warn nothing. Real transformers and
Lightning Trainers, tiny BERT."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

from tests.integrations.test_huggingface import arguments  # noqa: E402
from tests.integrations.test_lightning import Module, gnts, trainer  # noqa: E402
from tests.integrations.tiny import B, dataset, tiny_bert  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from grabkit.integrations.huggingface import GrabkitTrainer  # noqa: E402
from grabkit.integrations.lightning import AdaptiveAccumulationCallback, GraBCallback  # noqa: E402
from grabkit.noise import AccumulationNoiseScale  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


def _grabkit_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("grabkit:")]


class _SamplerGlue(Trainer):
    """A GraB sampler in a plain Trainer, stepped after each microbatch: no checkpoint state."""

    def _get_train_sampler(self, train_dataset=None):
        if not hasattr(self, "grab_sampler"):
            self.grab_sampler = GraBSampler(self.train_dataset, model=self.model, seed=0)
        return self.grab_sampler

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.grab_sampler.step()
        return loss


class _NoiseAfterClipping(TrainerCallback):
    """The noise scale closed in a callback: Trainer has clipped the gradient by then."""

    def __init__(self, model):
        self.gns = AccumulationNoiseScale(model)

    def on_substep_end(self, args, state, control, **kwargs):
        self.gns.end_microbatch(B)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.gns.end_microbatch(B)
        self.gns.end_step()


def _wrapper_trainer(tmp_path):
    model = tiny_bert()
    wrapper = gnts(torch.optim.SGD(model.parameters(), lr=0.1))
    args = arguments(tmp_path, gradient_accumulation_steps=1, max_grad_norm=0.1, max_steps=4)
    return Trainer(model, args, train_dataset=dataset(), optimizers=(wrapper, None))


def _noise_trainer(tmp_path):
    model = tiny_bert()
    args = arguments(tmp_path, max_grad_norm=1.0, max_steps=3)
    return Trainer(model, args, train_dataset=dataset(), callbacks=[_NoiseAfterClipping(model)])


def _glue_trainer(tmp_path):
    return _SamplerGlue(tiny_bert(), arguments(tmp_path, max_steps=3), train_dataset=dataset())


@pytest.mark.parametrize(
    ("build", "advice"),
    [
        (_wrapper_trainer, r"GrabkitTrainer\(accumulation="),
        (_noise_trainer, r"GrabkitTrainer\(noise_scale="),
        (_glue_trainer, r"GrabkitTrainer\(grab="),
    ],
    ids=["gqc-wrapper", "noise-callback", "sampler-glue"],
)
def test_plain_trainer_wiring_warns_once_with_the_integration(tmp_path, build, advice):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(tmp_path).train()
    messages = _grabkit_warnings(record)
    assert len(messages) == 1, messages
    assert re.search(advice, messages[0]), messages


def test_the_integrations_warn_nothing(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        args = arguments(tmp_path / "grab", max_steps=3)
        GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), grab={}, noise_scale={}).train()
        args = arguments(tmp_path / "gqc", gradient_accumulation_steps=1, max_steps=4)
        GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), accumulation=gnts).train()
        module = Module(gnts)
        fit = trainer(tmp_path / "pl", [AdaptiveAccumulationCallback()], accumulate_grad_batches=1,
                      gradient_clip_val=0.1, max_steps=4)  # fmt: skip
        fit.fit(module, DataLoader(dataset(), batch_size=B))
        module = Module()
        sampler = GraBSampler(dataset(), model=module.net, seed=0)
        fit = trainer(tmp_path / "pl-grab", [GraBCallback(sampler)], max_steps=2)
        fit.fit(module, DataLoader(dataset(), sampler=sampler, batch_size=B))
    assert _grabkit_warnings(record) == []


def test_lightning_wiring_without_the_callbacks_warns(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit = trainer(tmp_path / "gqc", accumulate_grad_batches=1, gradient_clip_val=0.1,
                      max_steps=4)  # fmt: skip
        fit.fit(Module(gnts), DataLoader(dataset(), batch_size=B))
        module = Module()
        sampler = GraBSampler(dataset(), model=module.net, seed=0)
        trainer(tmp_path / "grab", max_steps=2).fit(
            module, DataLoader(dataset(), sampler=sampler, batch_size=B)
        )
    messages = _grabkit_warnings(record)
    assert len(messages) == 2, messages
    assert "AdaptiveAccumulationCallback()" in messages[0]
    assert "GraBCallback(sampler)" in messages[1]
