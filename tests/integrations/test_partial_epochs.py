"""Epochs the framework ends before the sampler's last example: Lightning's
``limit_train_batches``, a loader with ``drop_last=True`` whose last batch is partial.

The framework counts such an epoch as over when its last batch is trained, and a checkpoint taken
there resumes with the next epoch; so must the sampler (its state is "ended" although examples
of the epoch were never stepped). A resume from any checkpoint then equals the uninterrupted run:
the same batches, orders and parameters.
"""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from tests.integrations.test_epoch_end import (  # noqa: E402
    accelerate_run,
    fresh_accelerator_state,  # noqa: F401
    grab_trainer_run,
)
from tests.integrations.test_lightning import Module, trainer  # noqa: E402
from tests.integrations.tiny import dataset, params  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from grabkit.integrations.lightning import GraBCallback  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


class _Batches(L.Callback):
    """The first input token of every trained row, batch by batch."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch["input_ids"][:, 0].tolist())


def _lightning_fit(
    root, ckpt_path=None, *, batch_size=4, drop_last=False, loader_class=DataLoader, **options
):
    module, data = Module(), dataset()
    sampler = GraBSampler(data, model=module.net, seed=0, record_orders=True)
    loader = loader_class(data, sampler=sampler, batch_size=batch_size, drop_last=drop_last)
    saver = L.callbacks.ModelCheckpoint(
        dirpath=str(root), filename="{step}", save_top_k=-1, every_n_train_steps=1
    )
    batches = _Batches()
    fit = trainer(
        root, [GraBCallback(sampler), saver, batches], max_epochs=3, enable_checkpointing=True,
        **options,
    )  # fmt: skip
    fit.fit(module, loader, ckpt_path=ckpt_path)
    return module, sampler, batches.seen


@pytest.mark.parametrize(
    ("options", "step"),
    [
        ({"limit_train_batches": 4}, 2),  # 2 updates an epoch: step 2 ends epoch 0
        ({"limit_train_batches": 4}, 3),  # inside epoch 1
        ({"batch_size": 5, "drop_last": True}, 2),  # 4 batches of 5 an epoch, 4 examples dropped
    ],
)
def test_lightning_resume_after_an_epoch_cut_short_equals_the_uninterrupted_run(
    tmp_path, options, step
):
    full_module, full_sampler, full_seen = _lightning_fit(tmp_path, **options)
    module, sampler, seen = _lightning_fit(
        tmp_path / "again", tmp_path / f"step={step}.ckpt", **options
    )
    assert seen == full_seen[2 * step :]  # the batches after the checkpoint, in the same order
    assert sampler.orders_history[-1] == full_sampler.orders_history[-1]
    for name, value in params(module.net).items():
        assert torch.equal(value, params(full_module.net)[name]), name


def test_trainer_resume_after_an_epoch_that_dropped_its_last_batch(tmp_path):
    """dataloader_drop_last=True, 4 batches of 5 an epoch: checkpoint-4 is epoch 0's last step,
    with 4 examples of the epoch never stepped; Trainer resumes with epoch 1."""

    options = dict(
        save_strategy="steps", save_steps=4, num_train_epochs=3, per_device_train_batch_size=5,
        gradient_accumulation_steps=1, dataloader_drop_last=True,
    )  # fmt: skip
    full = grab_trainer_run(tmp_path, **options)
    resumed = grab_trainer_run(tmp_path, str(tmp_path / "checkpoint-4"), **options)
    assert resumed.state.global_step == full.state.global_step == 12
    assert resumed.grab_sampler.orders_history[-1] == full.grab_sampler.orders_history[-1]
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_accelerate_recipe_after_an_epoch_that_dropped_its_last_batch(tmp_path):
    """4 batches of 5 an epoch: step 4 ends epoch 0, with 4 examples never stepped; the recipe
    resumes with epoch step // len(loader) = 1 and calls set_epoch(1), which starts it."""
    full_model, full_sampler, full_trained = accelerate_run(
        tmp_path, stop_after=4, batch_size=5, drop_last=True
    )
    model, sampler, trained = accelerate_run(tmp_path, resume=4, batch_size=5, drop_last=True)
    assert trained == full_trained - 4 * 5  # nothing lost, nothing repeated
    assert sampler.orders_history[-1] == full_sampler.orders_history[-1]
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name


def test_lightning_resume_of_a_stateful_loader_at_an_epoch_end_is_refused(tmp_path):
    """Lightning restores a StatefulDataLoader's snapshot after GraBCallback's state: a
    checkpoint at an epoch's last step resumes with that epoch's empty (or, cut short, untrained)
    rest counted as the next epoch, so one epoch of training is lost; refused, naming the fix.
    A checkpoint inside the epoch resumes exactly."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    options = {"limit_train_batches": 4, "loader_class": stateful}
    full_module, _, full_seen = _lightning_fit(tmp_path, **options)
    with pytest.raises(
        ValueError, match=r"epoch's last step with a StatefulDataLoader.*plain DataLoader"
    ):
        _lightning_fit(tmp_path / "again", tmp_path / "step=2.ckpt", **options)
    module, _, seen = _lightning_fit(tmp_path / "inside", tmp_path / "step=3.ckpt", **options)
    assert seen == full_seen[2 * 3 :]
    for name, value in params(module.net).items():
        assert torch.equal(value, params(full_module.net)[name]), name
