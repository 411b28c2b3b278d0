"""The Lightning callbacks under manual optimization (``automatic_optimization = False``).

One ``manual_backward`` per batch: ``GraBCallback`` and ``AdaptiveAccumulationCallback`` give
the hand loop's orders and parameters, bitwise. Two backwards over one batch (two optimizers, a
GAN's generator and discriminator) would have GraB credit the second backward's gradients to the
next batch's examples: refused at that backward, naming the callback and the fix.
``NoiseScaleCallback`` measures Lightning's ``accumulate_grad_batches`` windows, which manual
optimization does not have: refused at fit start, naming what to use instead.
"""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from tests.integrations.lightning_hooks import classified_rows, small_classifier  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.lightning import (  # noqa: E402
    AdaptiveAccumulationCallback,
    GraBCallback,
    NoiseScaleCallback,
)
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow

N, BATCH = 32, 4


def _loss(net, x, y) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x), y)


class Manual(L.LightningModule):
    """One backward per batch (``optimizers``: "one", "wrapper") or one per optimizer of two."""

    def __init__(self, optimizers: str) -> None:
        super().__init__()
        self.net = small_classifier(8)
        self.kind = optimizers
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            self.manual_backward(_loss(self.net, x, y))
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        if self.kind == "two":
            first, last = self.net[0].parameters(), self.net[2].parameters()
            return torch.optim.SGD(first, lr=0.1), torch.optim.SGD(last, lr=0.1)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.kind == "wrapper":
            return OptimizerWrapperGNTS(optimizer, 4, norm_threshold=0.35)
        return optimizer


def _trainer(root, callbacks, **options):
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(root), callbacks=callbacks, **options,
    )  # fmt: skip


def _data() -> TensorDataset:
    x, y, _ = classified_rows(N)
    return TensorDataset(x, y)


def _hand_grab_loop():
    net, data = small_classifier(8), _data()
    sampler = GraBSampler(data, model=net, seed=0, record_orders=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, N, BATCH):
            x, y = data[order[start : start + BATCH]]
            _loss(net, x, y).backward()
            sampler.step()
            optimizer.step()
            optimizer.zero_grad()
    return sampler.orders_history, net.state_dict()


def _hand_wrapper_loop():
    net, (x, y) = small_classifier(8), _data().tensors
    wrapper = OptimizerWrapperGNTS(
        torch.optim.SGD(net.parameters(), lr=0.1), 4, norm_threshold=0.35
    )
    for _epoch in range(2):
        for start in range(0, N, BATCH):
            _loss(net, x[start : start + BATCH], y[start : start + BATCH]).backward()
            wrapper.step(count=BATCH)
            wrapper.zero_grad()
    wrapper.flush()
    return wrapper.num_steps, net.state_dict()


def _assert_same(got: dict, want: dict) -> None:
    for (name, value), expected in zip(got.items(), want.values(), strict=True):
        assert torch.equal(value, expected), name


def test_one_backward_per_batch_is_the_hand_loop(tmp_path):
    module, data = Manual("one"), _data()
    sampler = GraBSampler(data, model=module.net, seed=0, record_orders=True)
    _trainer(tmp_path, [GraBCallback(sampler)]).fit(
        module, DataLoader(data, sampler=sampler, batch_size=BATCH)
    )
    orders, weights = _hand_grab_loop()
    assert sampler.orders_history == orders
    _assert_same(module.net.state_dict(), weights)

    module, callback = Manual("wrapper"), AdaptiveAccumulationCallback()
    _trainer(tmp_path, [callback]).fit(module, DataLoader(_data(), batch_size=BATCH))
    updates, weights = _hand_wrapper_loop()
    assert callback.wrapper.num_steps == updates
    _assert_same(module.net.state_dict(), weights)


@pytest.mark.parametrize("limit", [None, 4])  # 4 of 8 batches: the sampler's examples suffice
def test_grab_refuses_a_second_backward_over_one_batch(tmp_path, limit):
    module, data = Manual("two"), _data()
    sampler = GraBSampler(data, model=module.net, seed=0)
    fit = _trainer(tmp_path, [GraBCallback(sampler)], limit_train_batches=limit)
    with pytest.raises(ValueError, match=r"GraBCallback: .*second backward.* batch 0"):
        fit.fit(module, DataLoader(data, sampler=sampler, batch_size=BATCH))


def test_the_noise_scale_refuses_manual_optimization_naming_what_to_use(tmp_path):
    fit = _trainer(tmp_path, [NoiseScaleCallback()])
    with pytest.raises(
        ValueError, match=r"NoiseScaleCallback.*manual optimization.*AccumulationNoiseScale"
    ):
        fit.fit(Manual("one"), DataLoader(_data(), batch_size=BATCH))
