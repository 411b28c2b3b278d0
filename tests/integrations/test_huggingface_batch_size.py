"""``TrainingArguments(auto_find_batch_size=True)``: Trainer runs its training loop again with half
the batch size after an out-of-memory error, keeping the optimizer it created and the sampler.

The run after the retry must be the fresh run at the batch size found: the same parameters,
bitwise, the same GraB orders, noise-scale estimate and adaptive updates. The out-of-memory
error is raised by the model itself for batches above 4 examples (Trainer recognises
PyTorch's CPU allocator message), at the first batch or after a microbatch of the first
window was trained (the failed attempt applied no update: a retry after one would start from the
updated model, as Trainer's does, and no run is fresh).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.test_huggingface import arguments
from tests.integrations.tiny import dataset, params, tiny_bert
from transformers import BertForSequenceClassification, TrainerCallback

from grabkit import OptimizerWrapperGNTS
from grabkit.integrations.huggingface import ExampleGradientNormsCallback, GrabkitTrainer

pytestmark = pytest.mark.slow

FITS = 4  # the largest batch the model accepts


class OutOfMemoryAbove(BertForSequenceClassification):
    """tiny BERT that fails as an out-of-memory allocation on batches above ``FITS``, from its
    ``fails_at``-th training forward on (1: the first; 2: after a microbatch was trained)."""

    fails_at = 1

    def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
        if torch.is_grad_enabled():
            self.forwards = getattr(self, "forwards", 0) + 1
            if input_ids.shape[0] > FITS and self.forwards >= self.fails_at:
                raise RuntimeError(
                    "DefaultCPUAllocator: can't allocate memory: you tried to allocate"
                )
        return super().forward(input_ids=input_ids, position_ids=position_ids, labels=labels)


def _model(fails_at: int | None):
    model = tiny_bert()
    if fails_at is None:
        return model
    failing = OutOfMemoryAbove(model.config)
    failing.load_state_dict(model.state_dict())
    failing.fails_at = fails_at
    return failing


def _gnts(optimizer):
    """Windows of 3 microbatches (a threshold never met): the failed attempt applies nothing."""
    return OptimizerWrapperGNTS(optimizer, 3, norm_threshold=0.0)


CAPABILITIES = {
    "grab": ({"grab": {"record_orders": True}}, {}),
    "noise": ({"noise_scale": {"update_rate": 0.5}}, {}),
    "adaptive": ({"accumulation": _gnts}, {"gradient_accumulation_steps": 1}),
}


def _train(root, capability: str, batch_size: int, fails_at: int | None) -> GrabkitTrainer:
    grabkit_options, options = CAPABILITIES[capability]
    args = arguments(
        root, per_device_train_batch_size=batch_size, auto_find_batch_size=fails_at is not None,
        train_sampling_strategy="sequential" if capability != "grab" else "random", **options,
    )  # fmt: skip
    trainer = GrabkitTrainer(_model(fails_at), args, train_dataset=dataset(), **grabkit_options)
    trainer.train()
    return trainer


def _outcome(trainer: GrabkitTrainer, capability: str):
    if capability == "grab":
        return trainer.grab_sampler.orders_history
    if capability == "noise":
        result = trainer.noise_scale_result
        return result.grad_norm_sq, result.trace_sigma, result.observations
    return trainer._adaptive_wrapper().statistics()


@pytest.mark.parametrize("fails_at", [1, 2])  # 2: inside the first window (noise, adaptive)
@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_the_run_after_a_smaller_batch_was_found_is_the_fresh_run(tmp_path, capability, fails_at):
    found = _train(tmp_path / "found", capability, 2 * FITS, fails_at)
    assert found._train_batch_size == FITS  # one retry, at half the batch
    fresh = _train(tmp_path / "fresh", capability, FITS, None)
    assert _outcome(found, capability) == _outcome(fresh, capability)
    for name, value in params(found.model).items():
        assert torch.equal(value, params(fresh.model)[name]), name


class _LoggedNorms(TrainerCallback):
    """The (count, mean) of every logged per-example norm summary."""

    def __init__(self) -> None:
        self.logged: list[tuple[float, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm_per_example/count" in logs:
            self.logged.append(
                (logs["grad_norm_per_example/count"], logs["grad_norm_per_example/mean"])
            )


def _logged_norms(root, batch_size: int, fails_at: int | None) -> list[tuple[float, float]]:
    logged = _LoggedNorms()
    args = arguments(
        root, per_device_train_batch_size=batch_size, auto_find_batch_size=fails_at is not None,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    callbacks = [ExampleGradientNormsCallback(), logged]
    GrabkitTrainer(_model(fails_at), args, train_dataset=dataset(), callbacks=callbacks).train()
    return logged.logged


def test_the_per_example_norms_of_the_failed_attempt_are_not_logged(tmp_path):
    """The failed attempt trained one microbatch of 8 examples, which the retry trains again:
    the first log counted them twice (16 norms for a step of 8)."""
    found = _logged_norms(tmp_path / "found", 2 * FITS, fails_at=2)
    fresh = _logged_norms(tmp_path / "fresh", FITS, None)
    assert [count for count, _ in found] == [count for count, _ in fresh]
    assert [mean for _, mean in found] == pytest.approx([mean for _, mean in fresh], rel=1e-12)
