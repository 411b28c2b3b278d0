"""grabkit's Lightning callbacks at lifecycle edges: an epoch that Lightning ends early, resumed.

``trainer.should_stop`` (``EarlyStopping``, ``Timer(max_time)``, a callback) and a hook that
returns -1 from ``on_train_batch_start`` end an epoch after any batch, inside an accumulation
window too; Lightning then runs the epoch's end (``ModelCheckpoint`` saves there) and a run
resumed from that checkpoint starts the *next* epoch (a plain ``DataLoader`` trains it whole).
The GraB sampler must do the same: its epoch is over although examples of it were never
stepped; and the noise scale must measure the next epoch's first window, which starts from a
zero gradient (no window was cut by the checkpoint). The reference is the obvious loop: the cut
epoch's batches (the open window's gradient never applied), then whole epochs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from tests.integrations.lightning_hooks import classified_rows, small_classifier  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.lightning import (  # noqa: E402
    AdaptiveAccumulationCallback,
    ExampleGradientNormsCallback,
    GraBCallback,
    NoiseScaleCallback,
)
from grabkit.noise import AccumulationNoiseScale  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

N, B, ACCUMULATE, LR, RATE = 24, 2, 2, 0.3, 0.5  # 12 batches, 6 updates an epoch


def data() -> TensorDataset:
    x, y, _ = classified_rows(N)
    return TensorDataset(x, y, torch.arange(N))


def network() -> torch.nn.Module:
    return small_classifier(8)


class Classifier(L.LightningModule):
    """Records the rows it trains, in order; ends its first epoch after batch ``stop_at``
    (0-based): ``should_stop`` ends the fit there, ``-1`` returned from
    ``on_train_batch_start`` (a LightningModule hook's answer) only the epoch."""

    def __init__(self, stop_at: int | None = None, how: str = "stop") -> None:
        super().__init__()
        self.net, self.rows = network(), []
        self.stop_at, self.how = stop_at, how

    def on_train_batch_start(self, batch, batch_idx):
        first_epoch = self.stop_at is not None and self.current_epoch == 0
        if self.how == "skip" and first_epoch and batch_idx == self.stop_at + 1:
            return -1
        return None

    def training_step(self, batch, batch_idx):
        x, y, rows = batch
        self.rows += rows.tolist()
        if self.how == "stop" and self.stop_at is not None and batch_idx == self.stop_at:
            self.trainer.should_stop = True
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(root, ckpt_path=None, stop_at=None, how="stop"):
    module, dataset = Classifier(stop_at, how), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0, record_orders=True)
    saver = L.callbacks.ModelCheckpoint(dirpath=str(root), filename="{epoch}", save_top_k=-1)
    trainer = grab_trainer(root, sampler, saver, max_epochs=3)
    trainer.fit(module, DataLoader(dataset, sampler=sampler, batch_size=B), ckpt_path=ckpt_path)
    return module, sampler


def grab_trainer(root, sampler: GraBSampler, saver, **limits) -> L.Trainer:
    """A quiet CPU Trainer accumulating ``ACCUMULATE`` batches, with ``GraBCallback(sampler)``
    and the checkpoint callback ``saver``; ``limits``: ``max_epochs`` or ``max_steps``."""
    return L.Trainer(
        accelerator="cpu", devices=1, accumulate_grad_batches=ACCUMULATE, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(root), callbacks=[GraBCallback(sampler), saver], **limits,
    )  # fmt: skip


def reference(first_epoch_batches: int, epochs: int):
    """The plain loop: epoch 0 cut after ``first_epoch_batches`` (an open window's gradient
    dropped, as the stopped run never applies it), then whole epochs, the loss of each batch
    divided by the accumulation as Lightning divides it."""
    net, dataset = network(), data()
    sampler = GraBSampler(dataset, model=net, seed=0, record_orders=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    rows: list[int] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = first_epoch_batches if epoch == 0 else N // B
        for index in range(batches):
            picked = order[index * B : (index + 1) * B]
            x, y, row = dataset[picked]
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
            sampler.step()
            rows += row.tolist()
            if (index + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
        optimizer.zero_grad()
    return net, sampler, rows


@pytest.mark.parametrize("how", ["stop", "skip"])
@pytest.mark.parametrize("at", [2, 5])  # inside the second window; at the end of the third
def test_a_resume_after_an_epoch_ended_early_starts_the_next_epoch(tmp_path, how, at):
    """Saved at the end of the cut epoch 0 (``should_stop`` ends the fit there, -1 only the
    epoch): the resumed run trains epochs 1 and 2 whole, as with a plain ``DataLoader``."""
    first, first_sampler = fit(tmp_path / "first", stop_at=at, how=how)
    resumed, sampler = fit(tmp_path / "resumed", tmp_path / "first" / "epoch=0.ckpt")
    net, expected, rows = reference(at + 1, 3)
    cut = (at + 1) * B
    assert first.rows[:cut] + resumed.rows == rows  # the cut epoch's rest never trained
    if how == "skip" and (at + 1) % ACCUMULATE == 0:  # the uninterrupted run (an open
        # window's gradient would stay in .grad into the next epoch: Lightning's, not GraB's)
        assert first.rows == rows
        assert first_sampler.orders_history[-1] == expected.orders_history[-1]
    assert sampler.orders_history[-1] == expected.orders_history[-1]
    for name, value in net.named_parameters():
        assert torch.equal(dict(resumed.net.named_parameters())[name], value), name


def noise_fit(root, ckpt_path=None, stop_at=None):
    module = Classifier(stop_at)
    noise = NoiseScaleCallback(update_rate=RATE)
    saver = L.callbacks.ModelCheckpoint(dirpath=str(root), filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, accumulate_grad_batches=ACCUMULATE,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(root), callbacks=[noise, saver],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=B), ckpt_path=ckpt_path)
    return module, noise.result


def noise_reference(first_epoch_batches: int):
    """The plain loop: epoch 0's first batches (an open window never closed, so not measured),
    then whole epochs, every full window measured."""
    net, dataset = network(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    estimator = AccumulationNoiseScale(net, update_rate=RATE)
    for epoch in range(3):
        batches = first_epoch_batches if epoch == 0 else N // B
        for index in range(batches):
            x, y, _ = dataset[index * B : (index + 1) * B]
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
            estimator.end_microbatch(B)
            if (index + 1) % ACCUMULATE == 0:
                estimator.end_step()
                optimizer.step()
                optimizer.zero_grad()
        if batches % ACCUMULATE:
            estimator.discard_step()
            optimizer.zero_grad()
    return net, estimator.estimate


@pytest.mark.parametrize("at", [2, 5])
def test_the_noise_scale_resumed_after_an_early_stop_measures_the_next_epochs_windows(tmp_path, at):
    """``should_stop`` inside a window: Lightning resumes with the next epoch, whose first
    window is whole (its gradient starts at zero) and measured; no window was cut."""
    noise_fit(tmp_path / "first", stop_at=at)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: no window was cut
        warnings.filterwarnings("ignore", message=r"(?s)(?!NoiseScaleCallback).*")
        resumed, result = noise_fit(tmp_path / "resumed", tmp_path / "first" / "epoch=0.ckpt")
    net, expected = noise_reference(at + 1)
    for name, value in net.named_parameters():
        assert torch.equal(dict(resumed.net.named_parameters())[name], value), name
    assert result.observations == expected.observations
    assert result.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-12)
    assert result.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-12)


def validated_fit(root, every: int, ckpt_path=None):
    """GraB with a validation loop every ``every`` batches, ``ModelCheckpoint`` saving at each
    validation's end (its default with a monitored metric)."""
    module, dataset = Classifier(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0, record_orders=True)
    saver = L.callbacks.ModelCheckpoint(
        dirpath=str(root), filename="{step}", save_top_k=-1, monitor="val_loss"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=ACCUMULATE,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(root), val_check_interval=every,
        callbacks=[GraBCallback(sampler), saver],
    )  # fmt: skip
    validation = DataLoader(data(), batch_size=3)
    loader = DataLoader(dataset, sampler=sampler, batch_size=B)
    trainer.fit(module, loader, validation, ckpt_path=ckpt_path)
    return module, sampler


def test_validation_inside_the_epoch_changes_nothing_and_resumes_exactly(tmp_path):
    """Validation runs forwards (no gradient) between training batches: the orders and the
    parameters are those of the run without it, and a resume from a checkpoint saved at a
    validation's end (at an optimizer step) equals the uninterrupted run."""
    plain, plain_sampler = fit(tmp_path / "plain")
    full, full_sampler = validated_fit(tmp_path / "full", 4)
    assert full_sampler.orders_history == plain_sampler.orders_history[:2]
    assert full.rows == plain.rows[: 2 * N]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="GraBCallback")
        resumed, sampler = validated_fit(tmp_path / "resumed", 4, tmp_path / "full" / "step=2.ckpt")
    assert resumed.rows == full.rows[8:]
    assert sampler.orders_history[-1] == full_sampler.orders_history[-1]
    for name, value in full.net.named_parameters():
        assert torch.equal(dict(resumed.net.named_parameters())[name], value), name


def test_a_resume_from_inside_an_accumulation_window_warns(tmp_path):
    """``val_check_interval=3`` with windows of 2: ``ModelCheckpoint`` saves inside a window,
    whose accumulated gradient Lightning's checkpoint does not hold; the resumed run cannot
    equal the uninterrupted one, and says so (the GraB order itself resumes exactly)."""
    full, _ = validated_fit(tmp_path / "full", 3)
    with pytest.warns(UserWarning, match=r"GraBCallback.*inside an accumulation window"):
        resumed, _ = validated_fit(tmp_path / "resumed", 3, tmp_path / "full" / "step=7.ckpt")
    assert resumed.rows == full.rows[15 * B :]  # the data resumes exactly


def test_several_train_loaders_are_refused_naming_them(tmp_path):
    """A CombinedLoader's batch holds rows of every loader, one backward over all of them."""
    module, dataset = Classifier(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        callbacks=[GraBCallback(sampler)],
    )  # fmt: skip
    loaders = {"grab": DataLoader(dataset, sampler=sampler, batch_size=B)}
    loaders["other"] = DataLoader(dataset, batch_size=B)
    with pytest.raises(ValueError, match=r"2 loaders at once \(a CombinedLoader\)"):
        trainer.fit(module, loaders)


def test_overfit_batches_is_refused_naming_it(tmp_path):
    """Lightning's ``overfit_batches`` swaps the GraBSampler for a ``SequentialSampler``: the
    refusal named only the sampler it found, not the Trainer option that put it there."""
    module, dataset = Classifier(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        callbacks=[GraBCallback(sampler)], overfit_batches=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"overfit_batches=2"):
        trainer.fit(module, DataLoader(dataset, sampler=sampler, batch_size=B))


class LoggedNorms(L.Callback):
    """The per-example norms callback's summary at every optimizer step (it runs first)."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = next(c for c in trainer.callbacks if isinstance(c, ExampleGradientNormsCallback))
        self.values.append(dict(norms.last))


def norms_fit(root, **options) -> list[dict[str, float]]:
    module, logged = Classifier(), LoggedNorms()
    callbacks = [ExampleGradientNormsCallback(module.net), logged, *options.pop("callbacks", [])]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
        callbacks=callbacks, **options,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=B))
    return logged.values


def test_per_example_norms_follow_a_scheduled_accumulation(tmp_path):
    """``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at every epoch's
    start (1 at fit start): each logged norm is still the gradient of the example's own loss,
    the same as under a fixed ``accumulate_grad_batches`` (it was 1 / 2 of it)."""
    fixed = norms_fit(tmp_path / "fixed", accumulate_grad_batches=ACCUMULATE)
    scheduler = L.callbacks.GradientAccumulationScheduler({0: ACCUMULATE})
    scheduled = norms_fit(tmp_path / "scheduled", callbacks=[scheduler])
    assert len(scheduled) == len(fixed) == 2 * N // (B * ACCUMULATE)
    for got, expected in zip(scheduled, fixed, strict=True):
        assert got == pytest.approx(expected, rel=1e-12)


def scheduled_noise(root, scheduling: dict[int, int]):
    module, noise = Classifier(), NoiseScaleCallback(update_rate=RATE)
    scheduler = L.callbacks.GradientAccumulationScheduler(scheduling)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
        callbacks=[scheduler, noise],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=B))
    return module, noise.result


def scheduled_reference(windows: list[int]):
    """The plain loop: epoch e in windows of ``windows[e]`` batches, each loss divided by it;
    windows of one batch are not measured (no microbatch to compare with the mean)."""
    net, dataset = network(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    estimator = AccumulationNoiseScale(net, update_rate=RATE)
    for window in windows:
        for index in range(N // B):
            x, y, _ = dataset[index * B : (index + 1) * B]
            (F.cross_entropy(net(x), y) / window).backward()
            estimator.end_microbatch(B)
            if (index + 1) % window == 0:
                if window > 1:
                    estimator.end_step()
                else:
                    estimator.discard_step()
                optimizer.step()
                optimizer.zero_grad()
    return net, estimator.estimate


@pytest.mark.parametrize("scheduling", [{0: 2, 1: 3}, {0: 1, 1: 2}])
def test_the_noise_scale_follows_a_scheduled_accumulation(tmp_path, scheduling):
    """``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at each epoch's start
    (1 at setup): measured in the windows it makes, an epoch of windows of 1 left out."""
    module, result = scheduled_noise(tmp_path, scheduling)
    net, expected = scheduled_reference([scheduling[0], scheduling[1]])
    for name, value in net.named_parameters():
        assert torch.equal(dict(module.net.named_parameters())[name], value), name
    assert result.observations == expected.observations
    assert result.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-12)
    assert result.trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-12)


class Adaptive(Classifier):
    def configure_optimizers(self):
        return OptimizerWrapperGNTS(torch.optim.SGD(self.parameters(), lr=LR), norm_threshold=0.5)


def test_adaptive_accumulation_refuses_a_scheduled_accumulation(tmp_path):
    """A ``GradientAccumulationScheduler`` makes Lightning accumulate after fit start (where
    ``accumulate_grad_batches`` still reads 1): Lightning would divide every loss and step the
    wrapper once per window, hiding microbatches from it."""
    scheduler = L.callbacks.GradientAccumulationScheduler({0: 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        callbacks=[scheduler, AdaptiveAccumulationCallback()],
    )  # fmt: skip
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        trainer.fit(Adaptive(), DataLoader(data(), batch_size=B))


class Evaluated(Classifier):
    """The classifier with test and predict steps."""

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def evaluation_trainer(root, callback, **options):
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
        callbacks=[callback], **options,
    )  # fmt: skip


@pytest.mark.parametrize("stage", ["sanity", "validation", "validate", "test", "predict"])
@pytest.mark.parametrize("held", [False, True])  # GraBCallback(sampler), or the module's
def test_an_evaluation_loader_drawing_from_the_grab_sampler_is_refused(tmp_path, stage, held):
    """An evaluation loop over the train loader's GraBSampler calls its ``iter()``: inside a
    training epoch (``val_check_interval``) that new pass ends the training epoch's pass, whose
    untrained rest was silently left out (3 epochs of 12 batches trained 12 batches); between
    fits it begins an epoch of the sampler that trains nothing. Refused, naming the loop."""
    module, dataset = Evaluated(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0)
    if held:
        module.sampler = sampler
    callback = GraBCallback() if held else GraBCallback(sampler)
    loader = DataLoader(dataset, sampler=sampler, batch_size=B)
    options = {"num_sanity_val_steps": 2 if stage == "sanity" else 0}
    if stage == "validation":
        options["val_check_interval"] = 4
    trainer = evaluation_trainer(tmp_path, callback, **options)
    with pytest.raises(ValueError, match=r"GraBCallback: the \w+ DataLoader .*GraBSampler"):
        if stage in ("sanity", "validation"):
            trainer.fit(module, loader, DataLoader(dataset, sampler=sampler, batch_size=B))
        else:
            getattr(trainer, stage)(module, loader)


def steps_fit(root, max_steps: int, ckpt_path=None, every: int | None = None, **limits):
    """GraB for ``max_steps`` updates (6 an epoch); ``ModelCheckpoint`` every ``every`` steps, or
    (None) at the end of each epoch, which includes the end of the fit that ``max_steps`` ends;
    ``trainer.save_checkpoint`` to ``root / "after_fit.ckpt"`` once the fit has ended.
    ``limits``: other Trainer limits (``max_epochs`` with ``max_steps=-1``)."""
    module, dataset = Classifier(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0, record_orders=True)
    cadence = {"every_n_train_steps": every} if every else {}
    saver = L.callbacks.ModelCheckpoint(
        dirpath=str(root), filename="{step}", save_top_k=-1, **cadence
    )
    trainer = grab_trainer(root, sampler, saver, max_steps=max_steps, **limits)
    trainer.fit(module, DataLoader(dataset, sampler=sampler, batch_size=B), ckpt_path=ckpt_path)
    trainer.save_checkpoint(root / "after_fit.ckpt")
    return module, sampler


def test_a_max_steps_fit_continued_from_a_step_checkpoint_is_the_uninterrupted_run(tmp_path):
    """``max_steps=4`` ends the fit inside epoch 0; its checkpoint at step 4, saved after the
    batch (``every_n_train_steps``), continued with ``max_steps=18``: the 18-step run."""
    full, full_sampler = steps_fit(tmp_path / "full", 18)
    first, _ = steps_fit(tmp_path / "first", 4, every=2)
    resumed, sampler = steps_fit(tmp_path / "resumed", 18, tmp_path / "first" / "step=4.ckpt")
    assert first.rows + resumed.rows == full.rows
    assert sampler.orders_history[-1] == full_sampler.orders_history[-1]
    for name, value in full.net.named_parameters():
        assert torch.equal(dict(resumed.net.named_parameters())[name], value), name


@pytest.mark.parametrize("saved", ["step=4.ckpt", "after_fit.ckpt"])
def test_a_max_steps_fit_continued_from_its_end_inside_an_epoch_is_refused(tmp_path, saved):
    """The checkpoint saved at the end of a fit that ``max_steps`` ended inside an epoch (by
    ``ModelCheckpoint`` at the epoch's end, or ``trainer.save_checkpoint`` after the fit) counts
    that epoch as processed: continued with a larger ``max_steps``, Lightning trains the epoch's
    rest but numbers it (``set_epoch``) one above, and the sampler abandoned the rest and
    balanced those batches as a new epoch (rows 16 on differed from the uninterrupted run's;
    from the checkpoint after the fit, without a word). Refused, naming the checkpoint's epoch
    and the fix."""
    steps_fit(tmp_path / "first", 4)
    with pytest.raises(ValueError, match=r"ended inside epoch 0 \(max_steps reached"):
        steps_fit(tmp_path / "resumed", 18, tmp_path / "first" / saved)


@pytest.mark.parametrize("saved", ["step=6.ckpt", "after_fit.ckpt"])
def test_a_max_steps_fit_ended_at_an_epochs_end_continues_by_epochs_or_is_refused(tmp_path, saved):
    """``max_steps=6`` ends the fit at epoch 0's last batch. Continued from its end with a
    larger ``max_steps``, Lightning trains one batch past that epoch (batch 12 of 12, from a
    restarted loader, a plain one too), which the uninterrupted run never trains, and the GraB
    run differed from it without a word: refused at that batch, before it trains. Continued
    with ``max_epochs`` instead, or from the checkpoint saved after the batch
    (``every_n_train_steps``), the run is the 18-step run."""
    full, full_sampler = steps_fit(tmp_path / "full", 18)
    steps_fit(tmp_path / "first", 6)
    with pytest.raises(ValueError, match=r"batch 12 of an epoch of 12 batches"):
        steps_fit(tmp_path / "refused", 18, tmp_path / "first" / saved)
    steps_fit(tmp_path / "stepped", 6, every=3)
    for root, checkpoint, max_steps, limits in (
        ("epochs", tmp_path / "first" / saved, -1, {"max_epochs": 3}),
        ("after_batch", tmp_path / "stepped" / "step=6.ckpt", 18, {}),
    ):
        resumed, sampler = steps_fit(tmp_path / root, max_steps, checkpoint, **limits)
        assert resumed.rows == full.rows[6 * ACCUMULATE * B :], root
        assert sampler.orders_history[-1] == full_sampler.orders_history[-1], root
        for name, value in full.net.named_parameters():
            assert torch.equal(dict(resumed.net.named_parameters())[name], value), (root, name)


def test_a_second_fit_after_max_steps_on_its_trainer_trains_as_lightning_does(tmp_path):
    """The Trainer's second ``fit`` with a larger ``max_steps`` counts the epoch that
    ``max_steps=4`` ended as over (its rest never trained) and trains whole epochs after it:
    the loop of the cut epoch, then whole epochs."""
    module, dataset = Classifier(), data()
    sampler = GraBSampler(dataset, model=module.net, seed=0, record_orders=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=ACCUMULATE,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path),
        callbacks=[GraBCallback(sampler)],
    )  # fmt: skip
    loader = DataLoader(dataset, sampler=sampler, batch_size=B)
    trainer.fit(module, loader)
    trainer.fit_loop.epoch_loop.max_steps = 16  # 4 + 6 + 6: epochs 1 and 2 whole
    trainer.fit(module, loader)
    net, expected, rows = reference(8, 3)
    assert module.rows == rows
    assert sampler.orders_history == expected.orders_history
    for name, value in net.named_parameters():
        assert torch.equal(dict(module.net.named_parameters())[name], value), name


class AdaptiveClassifier(Classifier):
    """Windows of five microbatches (``max_batch_draws=5``, a threshold never met): two epochs
    of 12 batches end with a window of four still open, which the fit's end applies."""

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=LR)
        return OptimizerWrapperGNTS(sgd, max_batch_draws=5, norm_threshold=0.0)


def adaptive_fit(root, max_epochs: int, ckpt_path=None, save_after: str | None = None):
    """``AdaptiveAccumulationCallback`` with ``ModelCheckpoint`` at every epoch's end; with
    ``save_after``, ``trainer.save_checkpoint(save_after)`` once the fit has ended."""
    module = AdaptiveClassifier()
    saver = L.callbacks.ModelCheckpoint(dirpath=str(root), filename="{epoch}", save_top_k=-1)
    callback = AdaptiveAccumulationCallback()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(root), callbacks=[callback, saver],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=B), ckpt_path=ckpt_path)
    if save_after is not None:
        trainer.save_checkpoint(save_after)
    return module, callback.wrapper


def test_adaptive_accumulation_continued_after_the_fit_ended(tmp_path):
    """A 2-epoch fit continued to 3 epochs. ``ModelCheckpoint``'s last checkpoint is saved at
    the epoch's end, before the fit's end applies the open window: continued from it, the run
    is the 3-epoch run. The checkpoint saved after the fit holds that early update (the window's
    four microbatches applied alone): continued from it, the run is not the uninterrupted one
    (other windows, other parameters), and warns."""
    full, full_wrapper = adaptive_fit(tmp_path / "full", 3)
    adaptive_fit(tmp_path / "short", 2, save_after=str(tmp_path / "after_fit.ckpt"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="AdaptiveAccumulationCallback")
        last_epoch = tmp_path / "short" / "epoch=1.ckpt"
        resumed, wrapper = adaptive_fit(tmp_path / "resumed", 3, last_epoch)
    assert wrapper.num_steps == full_wrapper.num_steps == 8
    for name, value in full.net.named_parameters():
        assert torch.equal(dict(resumed.net.named_parameters())[name], value), name
    with pytest.warns(
        UserWarning, match=r"AdaptiveAccumulationCallback: .*after_fit\.ckpt"
    ) as said:
        continued, _ = adaptive_fit(tmp_path / "continued", 3, tmp_path / "after_fit.ckpt")
    assert not [w for w in said if "after flush()" in str(w.message)]  # said once, here
    parameters = dict(continued.net.named_parameters())
    assert not all(torch.equal(parameters[n], v) for n, v in full.net.named_parameters())
