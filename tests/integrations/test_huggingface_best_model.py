"""``accumulation=`` with ``load_best_model_at_end=True`` and training stopped early.

A run stopped inside an adaptive window (``should_training_stop``: ``EarlyStoppingCallback``, or
any callback) applies the open window when training ends; Trainer loads the best checkpoint
before its train-end callbacks, so that update landed on the best model: the final weights were
neither the best checkpoint's nor the trained ones. They must be the best checkpoint's, as with a
plain optimizer.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file
from tests.integrations.test_huggingface import arguments
from tests.integrations.tiny import StopAt, dataset, params, tiny_bert

from grabkit import OptimizerWrapperGNTS
from grabkit.integrations.huggingface import GrabkitTrainer

pytestmark = pytest.mark.slow


def _windows_of_four(optimizer):
    return OptimizerWrapperGNTS(optimizer, 4, norm_threshold=0.0)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_final_model_is_the_best_checkpoint_after_an_early_stop(tmp_path, adaptive):
    args = arguments(
        tmp_path, gradient_accumulation_steps=1, max_steps=12, eval_strategy="steps",
        eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="loss",
    )  # fmt: skip
    extra = {"accumulation": _windows_of_four} if adaptive else {}
    trainer = GrabkitTrainer(
        tiny_bert(), args, train_dataset=dataset(), eval_dataset=dataset(),
        callbacks=[StopAt(5)], **extra,  # microbatch 5: inside the second window
    )  # fmt: skip
    trainer.train()
    best = load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    for name, value in params(trainer.model).items():
        if name in best:
            assert torch.equal(value, best[name]), name


def _continued(root, max_steps: int, resume: str | None = None) -> GrabkitTrainer:
    args = arguments(
        root, gradient_accumulation_steps=1, max_steps=max_steps, save_strategy="steps",
        save_steps=5, train_sampling_strategy="sequential",
    )  # fmt: skip
    trainer = GrabkitTrainer(
        tiny_bert(), args, train_dataset=dataset(), accumulation=_windows_of_four
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_continuing_a_run_whose_end_applied_an_open_window_warns(tmp_path):
    """max_steps=10 ends inside a window of four, which the run applies at its last microbatch
    (its final model needs it); its checkpoint-10 holds that early update, so a fit continued
    from it to 20 steps is not the uninterrupted 20-step run (one update more): warned. A
    checkpoint from inside the uninterrupted run resumes it exactly, without a warning."""
    full = _continued(tmp_path / "full", 20)
    _continued(tmp_path / "short", 10)
    with pytest.warns(UserWarning, match=r"applied its open accumulation window"):
        continued = _continued(tmp_path / "short", 20, str(tmp_path / "short" / "checkpoint-10"))
    assert continued._adaptive_wrapper().num_steps == full._adaptive_wrapper().num_steps + 1
    resumed = _continued(tmp_path / "full", 20, str(tmp_path / "full" / "checkpoint-10"))
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name
