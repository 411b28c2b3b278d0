"""Lightning's ``Tuner`` before a fit: ``scale_batch_size`` and ``lr_find`` run trial fits with
the callbacks taken out, then restore the checkpoint they saved before the trials.

The trials iterate the train loader, so a ``GraBSampler`` is drawn from and its hooks see the
trials' backwards, with no ``GraBCallback`` to step it. The fit after the tuning must be the fit
a fresh run makes with the tuned batch size and learning rate: the same orders and parameters,
bitwise. The other callbacks are left out of the trials altogether, and their fits must equal
the fresh ones as well.
"""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
tuner = pytest.importorskip("lightning.pytorch.tuner")

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

N = 64


class Tuned(L.LightningModule):
    """A classifier whose ``batch_size`` and ``lr`` the tuner sets; ``grab``: its loader draws
    from a GraB sampler the module holds (found by ``GraBCallback()``)."""

    def __init__(self, grab: bool, wrap: bool = False, batch_size: int = 4, lr: float = 0.1):
        super().__init__()
        self.net = small_classifier(8)
        x, y, _ = classified_rows(N)
        self.data = TensorDataset(x, y)
        self.batch_size, self.lr, self.wrap = batch_size, lr, wrap
        self.sampler = (
            GraBSampler(self.data, model=self.net, seed=0, record_orders=True) if grab else None
        )

    def train_dataloader(self):
        return DataLoader(self.data, sampler=self.sampler, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.wrap:
            return OptimizerWrapperGNTS(optimizer, 4, norm_threshold=0.3)
        return optimizer


def _trainer(root, callback, accumulate: int):
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(root),
        callbacks=[callback],
    )  # fmt: skip


def _tune(tuned: L.Trainer, module: Tuned, how: str) -> None:
    search = tuner.Tuner(tuned)
    if how == "batch size":
        search.scale_batch_size(module, mode="power", steps_per_trial=2, max_trials=2, init_val=4)
        assert module.batch_size > 4  # the trials ran and grew it
    else:
        search.lr_find(module, num_training=6, min_lr=1e-3, max_lr=0.5, update_attr=False)


CALLBACKS = {
    "grab": (lambda: GraBCallback(), 2),
    "noise": (lambda: NoiseScaleCallback(update_rate=0.3), 2),
    "adaptive": (lambda: AdaptiveAccumulationCallback(), 1),
}


def _outcome(name: str, module: Tuned, callback) -> object:
    if name == "grab":
        return module.sampler.orders_history
    if name == "noise":
        result = callback.result
        return result.grad_norm_sq, result.trace_sigma, result.observations
    return callback.wrapper.statistics()


@pytest.mark.parametrize("how", ["batch size", "lr"])
@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_a_fit_after_tuning_is_the_fresh_fit_at_the_tuned_settings(tmp_path, name, how):
    make, accumulate = CALLBACKS[name]
    module, callback = Tuned(grab=name == "grab", wrap=name == "adaptive"), make()
    tuned = _trainer(tmp_path / "tuned", callback, accumulate)
    _tune(tuned, module, how)
    tuned.fit(module)

    fresh_module = Tuned(name == "grab", name == "adaptive", module.batch_size, module.lr)
    fresh_callback = make()
    _trainer(tmp_path / "fresh", fresh_callback, accumulate).fit(fresh_module)
    assert _outcome(name, module, callback) == _outcome(name, fresh_module, fresh_callback)
    for (key, value), fresh in zip(
        module.net.state_dict().items(), fresh_module.net.state_dict().values(), strict=True
    ):
        assert torch.equal(value, fresh), key
