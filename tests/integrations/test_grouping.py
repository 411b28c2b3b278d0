"""Length grouping in the frameworks, one line each, against the padded run: tiny GPT-2 in a
Hugging Face Trainer and tiny Llama in Lightning, on right-padded rows of 1 to 24 tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

from tests.integrations.test_huggingface import arguments  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    B,
    dataset,
    pad_right,
    params,
    ragged_lm_dataset,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
)
from torch.utils.data import DataLoader  # noqa: E402

from grabkit.integrations.huggingface import GrabkitTrainer  # noqa: E402
from grabkit.integrations.lightning import GraBCallback, GroupingCallback  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow
MICROBATCHES = 2 * 24 // B  # 2 epochs


def _close(got: dict, want: dict) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _hf_run(tmp_path, **kwargs):
    args = arguments(tmp_path, max_grad_norm=1.0)
    trainer = GrabkitTrainer(
        tiny_gpt2(n_positions=32), args, train_dataset=ragged_lm_dataset(),
        data_collator=pad_right, **kwargs,
    )  # fmt: skip
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses


def test_trainer_grouping_equals_the_padded_run(tmp_path):
    padded, padded_losses = _hf_run(tmp_path / "padded")
    grouped, losses = _hf_run(tmp_path / "grouped", grouping=True)
    assert grouped.grouped_forward.groups_run > MICROBATCHES  # batches were split by length
    assert losses == pytest.approx(padded_losses, rel=1e-5)
    _close(params(grouped.model), params(padded.model))


def test_grab_with_group_by_length_or_grouping_is_refused(tmp_path):
    """group_by_length would silently replace GraB's order (and grouping calls the layers once
    per group, which hook statistics cannot attribute yet): refused with the fix."""
    args = arguments(tmp_path, train_sampling_strategy="group_by_length")
    with pytest.raises(ValueError, match="default random sampling strategy with grab="):
        GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), grab={})
    with pytest.raises(NotImplementedError, match="use one of them"):
        GrabkitTrainer(tiny_bert(), arguments(tmp_path), train_dataset=dataset(), grab={},
                       grouping=True)  # fmt: skip


class LlamaModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.losses = tiny_llama(), []

    def training_step(self, batch, batch_idx):
        loss = self.net(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_run(root, callbacks=()):
    module = LlamaModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=list(callbacks),
    )  # fmt: skip
    loader = DataLoader(ragged_lm_dataset(), batch_size=B, collate_fn=pad_right)
    trainer.fit(module, loader)
    return module


def test_lightning_grouping_equals_the_padded_run(tmp_path):
    padded = _lightning_run(tmp_path / "padded")
    callback = GroupingCallback()
    grouped = _lightning_run(tmp_path / "grouped", [callback])
    assert sum(g.groups_run for g in callback.grouped) > MICROBATCHES
    assert "forward" not in vars(grouped.net.base_model)  # detached at fit end
    assert grouped.losses == pytest.approx(padded.losses, rel=1e-5)
    _close(params(grouped.net), params(padded.net))


def test_lightning_grouping_with_grab_is_refused(tmp_path):
    module = LlamaModule()
    sampler = GraBSampler(
        ragged_lm_dataset(), model=module.net, stats_options={"torch_func_fallback": True}
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        callbacks=[GraBCallback(sampler), GroupingCallback()])  # fmt: skip
    with pytest.raises(NotImplementedError, match="use one of them"):
        GroupingCallback().setup(trainer, module, "fit")
