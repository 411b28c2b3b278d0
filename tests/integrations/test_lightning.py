"""grabkit's Lightning callbacks against the real Lightning Trainer, tiny BERT, CPU.

Each silent failure of the plain wiring is shown going wrong next to the callback
going right.
"""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from tests.integrations.tiny import (  # noqa: E402
    B,
    N,
    dataset,
    params,
    plain_grab_loop,
    plain_noise_scale,
    tiny_bert,
)
from torch.utils.data import DataLoader  # noqa: E402

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.lightning import (  # noqa: E402
    AdaptiveAccumulationCallback,
    GraBCallback,
    NoiseScaleCallback,
)
from grabkit.order import GraBBatchSampler, GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


class Module(L.LightningModule):
    def __init__(self, wrapper_factory=None, schedule=False):
        super().__init__()
        self.net = tiny_bert()
        self.wrapper_factory, self.schedule = wrapper_factory, schedule

    def training_step(self, batch, batch_idx):
        return self.net(**batch).loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.wrapper_factory is None:
            return optimizer
        optimizer = self.wrapper_factory(optimizer)
        if not self.schedule:
            return optimizer
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def trainer(root, callbacks=(), **options):
    settings = dict(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), num_sanity_val_steps=0,
    )  # fmt: skip
    settings.update(options)
    return L.Trainer(callbacks=list(callbacks), **settings)


def grab_setup(num_workers=0, **sampler_options):
    module, data = Module(), dataset()
    sampler = GraBSampler(data, model=module.net, seed=0, **sampler_options)
    workers = {"num_workers": num_workers, "persistent_workers": num_workers > 0}
    return module, sampler, DataLoader(data, sampler=sampler, batch_size=B, **workers)


def test_grab_order_and_gradients_match_the_plain_loop(tmp_path):
    module, sampler, loader = grab_setup(record_orders=True)
    trainer(tmp_path, [GraBCallback(sampler)]).fit(module, loader)
    orders, weights = plain_grab_loop()
    assert sampler.orders_history == orders
    assert sampler.state_dict()["live"]["stepped"] == N
    for name, value in params(module.net).items():
        torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-6)


def test_batch_sampler_form(tmp_path):
    module, data = Module(), dataset()
    batches = GraBBatchSampler(data, model=module.net, seed=0, batch_size=B, record_orders=True)
    trainer(tmp_path, [GraBCallback(batches)]).fit(module, DataLoader(data, batch_sampler=batches))
    assert batches.sampler.orders_history == plain_grab_loop()[0]


class GraBData(L.LightningDataModule):
    """Builds the sampler in setup(), as under DDP (where the process group is up by then)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.data = module, dataset()

    def setup(self, stage):
        self.sampler = GraBSampler(self.data, model=self.module.net, seed=0, record_orders=True)

    def train_dataloader(self):
        return DataLoader(self.data, sampler=self.sampler, batch_size=B)


def test_callback_finds_the_sampler_built_in_setup(tmp_path):
    module = Module()
    data = GraBData(module)
    trainer(tmp_path, [GraBCallback()]).fit(module, datamodule=data)
    assert data.sampler.orders_history == plain_grab_loop()[0]


def test_callback_without_a_sampler_to_find_is_refused(tmp_path):
    module, _, loader = grab_setup()
    with pytest.raises(ValueError, match=r"found 0 GraBSamplers.*setup\(\)"):
        trainer(tmp_path, [GraBCallback()]).fit(module, loader)


def _checkpointed_fit(root, callback_cls, ckpt_path=None, num_workers=0, every="step"):
    module, sampler, loader = grab_setup(num_workers)
    cadence = {"every_n_train_steps": 2} if every == "step" else {"every_n_epochs": 1}
    saver = L.callbacks.ModelCheckpoint(
        dirpath=str(root), filename=f"{{{every}}}", save_top_k=-1, **cadence
    )
    fit = trainer(root, [callback_cls(sampler), saver], max_epochs=3, enable_checkpointing=True)
    fit.fit(module, loader, ckpt_path=ckpt_path)
    return module, sampler


@pytest.mark.parametrize("step", [8, 6])  # 3 updates per epoch: mid-epoch 2; epoch 1's last
def test_resume_from_lightning_checkpoint_is_bitwise(tmp_path, step):
    full_module, full_sampler = _checkpointed_fit(tmp_path, GraBCallback)
    module, sampler = _checkpointed_fit(
        tmp_path / "again", GraBCallback, tmp_path / f"step={step}.ckpt"
    )
    assert torch.equal(sampler.order, full_sampler.order)
    for name, value in params(module.net).items():
        assert torch.equal(value, params(full_module.net)[name]), name


def test_resume_from_an_epoch_end_checkpoint_is_bitwise(tmp_path):
    """Saved in on_train_epoch_end: Lightning resumes with the next epoch, so must GraB."""
    full_module, full_sampler = _checkpointed_fit(tmp_path, GraBCallback, every="epoch")
    module, sampler = _checkpointed_fit(
        tmp_path / "again", GraBCallback, tmp_path / "epoch=0.ckpt", every="epoch"
    )
    assert torch.equal(sampler.order, full_sampler.order)
    for name, value in params(module.net).items():
        assert torch.equal(value, params(full_module.net)[name]), name


class _SnapshotAsIs(GraBCallback):
    """The naive state: the sampler's snapshot, with the loader's prefetched batches counted."""

    def state_dict(self):
        return {"sampler": self.sampler.state_dict()}

    def _load(self, state_dict):
        self.sampler.load_state_dict(state_dict["sampler"])


@pytest.mark.parametrize(("callback", "exact"), [(GraBCallback, True), (_SnapshotAsIs, False)])
def test_worker_prefetch_needs_the_handed_back_snapshot(tmp_path, callback, exact):
    """A loader worker prefetches batches: the naive snapshot counts them as trained."""
    full_module, full_sampler = _checkpointed_fit(tmp_path, callback, num_workers=1)
    module, sampler = _checkpointed_fit(tmp_path / "again", callback, tmp_path / "step=8.ckpt")
    same = torch.equal(sampler.order, full_sampler.order) and all(
        torch.equal(v, params(full_module.net)[k]) for k, v in params(module.net).items()
    )
    assert same is exact


def test_a_one_process_sampler_is_refused_under_ddp(tmp_path):
    """Exact hook statistics (or any sampler of another world size) under DDP: refused at fit
    start, naming the fix (tests/integrations/test_lightning_ddp.py runs the sketch mode)."""
    module, sampler, _ = grab_setup()
    ddp = trainer(tmp_path, devices=2, strategy="ddp")
    with pytest.raises(ValueError, match=r'num_replicas=1.*setup\(\).*statistics="sketch"'):
        GraBCallback(sampler).setup(ddp, module, "fit")


# -- adaptive accumulation ------------------------------------------------------------------------
def gnts(optimizer):
    return OptimizerWrapperGNTS(optimizer, max_batch_draws=4, norm_threshold=0.1)


def test_adaptive_accumulation_skips_and_the_schedule_follows_real_updates(tmp_path):
    module = Module(gnts, schedule=True)
    callback = AdaptiveAccumulationCallback()
    fit = trainer(
        tmp_path, [callback], accumulate_grad_batches=1, gradient_clip_val=0.1, max_steps=12
    )
    fit.fit(module, DataLoader(dataset(), batch_size=B))
    wrapper = callback.wrapper
    assert 0 < wrapper.num_steps < 12
    assert wrapper.counters.num_draws == 0  # the window open at train end was applied
    assert wrapper.clip_grad_norm == 0.1
    flushed = wrapper.last_reason == "flushed"  # at train end, after the scheduler's last step
    assert fit.lr_scheduler_configs[0].scheduler.last_epoch == wrapper.num_steps - flushed
    assert float(wrapper.last_step_count) == B * wrapper.last_step_num_draws


def test_a_count_fn_giving_no_positive_weight_is_refused_naming_it(tmp_path):
    callback = AdaptiveAccumulationCallback(count_fn=lambda batch: 0)
    fit = trainer(tmp_path, [callback], accumulate_grad_batches=1, max_steps=4)
    with pytest.raises(ValueError, match=r"count_fn\(batch\) gave 0 for batch 0"):
        fit.fit(Module(gnts), DataLoader(dataset(), batch_size=B))


def test_naive_wrapper_in_lightning_steps_every_microbatch(tmp_path):
    module = Module(gnts, schedule=True)
    fit = trainer(tmp_path, accumulate_grad_batches=1, gradient_clip_val=0.1, max_steps=12)
    fit.fit(module, DataLoader(dataset(), batch_size=B))
    wrapper = fit.optimizers[0]
    assert wrapper.num_steps == 12  # Lightning clipped every microbatch to the threshold
    assert fit.lr_scheduler_configs[0].scheduler.last_epoch == 12


# -- noise scale ----------------------------------------------------------------------------------
def test_noise_scale_equals_the_plain_loop_and_is_measured_before_clipping(tmp_path):
    callback = NoiseScaleCallback(update_rate=0.5)
    fit = trainer(tmp_path, [callback], max_epochs=1, gradient_clip_val=0.05)
    fit.fit(Module(), DataLoader(dataset(), batch_size=B))
    expected = plain_noise_scale(0.05)
    assert callback.result.observations == expected.observations
    assert callback.result.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-5)
    assert callback.result.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-5)
    logged = fit.callback_metrics["noise_scale/grad_norm_sq"]
    assert float(logged) == pytest.approx(expected.grad_norm_sq, rel=1e-5)
