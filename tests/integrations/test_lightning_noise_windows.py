"""``NoiseScaleCallback`` on one process at the windows Lightning does not form as means, and
under fp16 mixed precision.

Lightning divides every microbatch's loss by ``accumulate_grad_batches`` (A), whatever the window
holds, so a window's accumulated gradient is the mean over its examples only when it has A
microbatches of equal size. The epoch's last window, when the epoch's batches are not a multiple
of A, holds fewer (shares 1 / A, summing to less than 1); a partial last batch makes the shares
unequal per example. Neither is a mean: such a window is left out, and the estimate equals a
plain loop that measures the other windows. Under ``precision="16-mixed"`` the GradScaler's
scale multiplies every gradient the estimator reads and changes during training: it is divided
out, so the estimate equals that of a constant scale of 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from grabkit.integrations.lightning import NoiseScaleCallback  # noqa: E402
from grabkit.noise import AccumulationNoiseScale  # noqa: E402

pytestmark = pytest.mark.slow

BATCH, LR = 4, 0.05


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    return list(zip(x, y, strict=True))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _fit(n: int, accumulate: int, epochs: int = 1, scaler=None) -> NoiseScaleCallback:
    callback = NoiseScaleCallback(update_rate=0.5)
    plugins = [] if scaler is None else [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, callbacks=[callback], plugins=plugins,
    )  # fmt: skip
    trainer.fit(Classifier(), DataLoader(_data(n), batch_size=BATCH))
    return callback


def _plain_loop(n: int, accumulate: int):
    """Lightning's loop written out: each loss over A, a step after A batches and at the
    epoch's end; the windows of A equal microbatches measured, the others left out."""
    net, data = _net(), _data(n)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    gns = AccumulationNoiseScale(net, update_rate=0.5)
    batches = [data[i : i + BATCH] for i in range(0, n, BATCH)]
    for start in range(0, len(batches), accumulate):
        window = batches[start : start + accumulate]
        for rows in window:
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            (F.cross_entropy(net(x), y) / accumulate).backward()
            gns.end_microbatch(len(rows))
        if len(window) == accumulate and len({len(rows) for rows in window}) == 1:
            gns.end_step()
        else:
            gns.discard_step()
        optimizer.step()
        optimizer.zero_grad()
    return gns.estimate


@pytest.mark.parametrize(
    ("n", "accumulate"),
    [
        (24, 4),  # 6 batches: windows of 4 and 2 microbatches
        (22, 2),  # batches 4, 4, 4, 4, 4, 2: the last window's microbatches differ in size
    ],
)
def test_windows_that_are_not_means_are_left_out(n, accumulate):
    got, want = _fit(n, accumulate).result, _plain_loop(n, accumulate)
    assert got.observations == want.observations
    assert got.grad_norm_sq == pytest.approx(want.grad_norm_sq, rel=1e-5)
    assert got.trace_sigma == pytest.approx(want.trace_sigma, rel=1e-5)


def test_the_loss_scale_is_divided_out_under_16_mixed():
    constant = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    growing = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)
    want = _fit(24, 2, epochs=2, scaler=constant).result
    got = _fit(24, 2, epochs=2, scaler=growing).result
    assert growing.get_scale() > 2.0**6
    assert got.observations == want.observations == 6
    assert got.grad_norm_sq == pytest.approx(want.grad_norm_sq, rel=1e-3)
    assert got.trace_sigma == pytest.approx(want.trace_sigma, rel=1e-3)
