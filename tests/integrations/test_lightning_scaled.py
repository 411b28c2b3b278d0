"""GraBCallback under Lightning's fp16 mixed precision (``MixedPrecision("16-mixed")`` with a
real ``torch.amp.GradScaler``, on the CPU): the loss scale, which changes during training, is
divided out of the hook statistics (the orders equal those of a run at a constant scale of 1),
and an overflowing step is skipped as the scaler skips it (training goes on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from grabkit import GraBSampler  # noqa: E402
from grabkit.integrations.lightning import ExampleGradientNormsCallback, GraBCallback  # noqa: E402

pytestmark = pytest.mark.slow

N, BATCH = 24, 4


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(scaler: torch.amp.GradScaler, tmp_path) -> list[list[int]]:
    torch.manual_seed(1)
    data = list(zip(torch.randn(N, 5), torch.randint(0, 3, (N,)), strict=True))
    module = Classifier()
    sampler = GraBSampler(
        data, model=module.net, seed=0, batch_size=BATCH, balance_type="pair", record_orders=True
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path), callbacks=[GraBCallback(sampler)],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, sampler=sampler, batch_size=BATCH))
    return sampler.orders_history


def test_a_growing_loss_scale_leaves_the_orders_of_a_constant_scale(tmp_path) -> None:
    constant = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    growing = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
    reference = fit(constant, tmp_path)
    assert fit(growing, tmp_path) == reference
    assert growing.get_scale() > 2.0**4


def test_overflowing_steps_are_skipped_and_training_goes_on(tmp_path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    orders = fit(scaler, tmp_path)
    assert scaler.get_scale() < 2.0**8 * 2**24  # it backed off: some steps overflowed
    assert len(orders) >= 4 and all(sorted(order) == list(range(N)) for order in orders)


def logged_norms(scaler: torch.amp.GradScaler, tmp_path, accumulate: int = 1) -> list[dict]:
    """The per-example norm summaries ExampleGradientNormsCallback made at each optimizer step."""
    torch.manual_seed(1)
    data = list(zip(torch.randn(N, 5), torch.randint(0, 3, (N,)), strict=True))
    module = Classifier()
    summaries: list[dict] = []

    class Keep(ExampleGradientNormsCallback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            summaries.append(dict(self.last))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path), callbacks=[Keep(module.net)],
        accumulate_grad_batches=accumulate,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return summaries


@pytest.mark.parametrize("accumulate", [1, 3])
def test_logged_per_example_norms_have_the_loss_scale_divided_out(tmp_path, accumulate) -> None:
    # the scale grows during the run (every 2 steps): the norms are those of a constant scale 1
    constant = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    growing = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)
    reference = logged_norms(constant, tmp_path, accumulate)
    scaled = logged_norms(growing, tmp_path, accumulate)
    assert growing.get_scale() > 2.0**6
    assert len(scaled) == len(reference) > 2
    for got, want in zip(scaled, reference, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-3), key
