"""``NoiseScaleCallback`` under Lightning's DDP: ``ddp_spawn``, two gloo processes on the CPU.

Each rank trains its ``DistributedSampler`` share (rank r: rows r, r + W, ...; no shuffling)
with ``accumulate_grad_batches`` windows. The estimate on both ranks must equal
``MicrobatchNoiseScale`` fed, by hand, each rank's local window gradient (the mean over its
window's examples) against their average, and the measured run must train bitwise as the same
run without the callback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from tests.integrations.lightning_hooks import (  # noqa: E402
    Estimates,
    SaveAfterBatch,
    SpawnedDDP,
    classified_rows,
    rank_loader,
    small_classifier,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit.integrations.lightning import NoiseScaleCallback  # noqa: E402
from grabkit.noise import MicrobatchNoiseScale  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

W, N, B, EPOCHS, RATE = 2, 48, 4, 2, 0.5  # 6 microbatches of B per rank and epoch


def data() -> TensorDataset:
    x, y, _ = classified_rows(N)
    return TensorDataset(x, y)


def network() -> torch.nn.Module:
    return small_classifier(16)


class Classifier(L.LightningModule):
    """Writes its parameters and its callback's estimate to ``out/rank<r>.pt`` at train end."""

    def __init__(self, out: str, stateful: bool = False) -> None:
        super().__init__()
        self.net, self.out, self.stateful = network(), out, stateful

    def train_dataloader(self) -> DataLoader:
        return rank_loader(data(), W, self.global_rank, B, self.stateful)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def on_train_end(self) -> None:
        noise = [c for c in self.trainer.callbacks if isinstance(c, NoiseScaleCallback)]
        result = noise[0].result if noise else None
        steps = [c.values for c in self.trainer.callbacks if isinstance(c, Estimates)]
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in self.net.named_parameters()},
                "noise": None
                if result is None
                else [result.grad_norm_sq, result.trace_sigma, result.observations],
                "steps": [list(v) for v in steps[0]] if steps else [],
            },
            Path(self.out) / f"rank{self.global_rank}.pt",
        )


def fit(
    out: Path, accumulate: int, measure: bool, ckpt_path: Path | None = None,
    stateful: bool = False, save_after: int | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> list[dict]:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [NoiseScaleCallback(update_rate=RATE), Estimates()] if measure else []
    if save_after is not None:
        callbacks.append(SaveAfterBatch(save_after, out / "mid_window.ckpt"))
    callbacks.append(
        L.callbacks.ModelCheckpoint(
            dirpath=str(out), filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=W, strategy=SpawnedDDP(), max_epochs=EPOCHS,
        accumulate_grad_batches=accumulate, use_distributed_sampler=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=True, default_root_dir=str(out), callbacks=callbacks,
        plugins=[] if scaler is None else [MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(Classifier(str(out), stateful), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(W)]


def hand_computed(accumulate: int):
    """One process: each rank's rows as DistributedSampler deals them (rank r: r, r + W, ...),
    its window gradient the mean over the window's rows, SGD on the ranks' average."""
    net, (x, y) = network(), data().tensors
    names = tuple(name for name, _ in net.named_parameters())
    noise = MicrobatchNoiseScale(update_rate=RATE, block_names=names)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    shares = [list(range(r, N, W)) for r in range(W)]
    window = accumulate * B
    for _ in range(EPOCHS):
        for start in range(0, N // W, window):
            local = []
            for share in shares:
                rows = share[start : start + window]
                # Lightning divides each microbatch's loss by accumulate: a window cut short by
                # the epoch's end holds its rows' mean times len(rows) / window
                loss = F.cross_entropy(net(x[rows]), y[rows]) * (len(rows) / window)
                local.append(torch.autograd.grad(loss, list(net.parameters())))
            squares = torch.tensor([[g.square().sum() for g in grads] for grads in local])
            average = [sum(parts) / W for parts in zip(*local, strict=True)]
            if len(rows) == window:  # a short window is not its examples' mean: left out
                noise.observe_microbatches(squares, [window] * W)
                noise.observe_step(torch.stack([g.square().sum() for g in average]))
            for p, g in zip(net.parameters(), average, strict=True):
                p.grad = g
            opt.step()
    return noise.estimate


@pytest.fixture
def spawnable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


@pytest.mark.parametrize("accumulate", [1, 3, 4])  # 4: each epoch ends with a window of 2
def test_ddp_noise_scale_is_the_hand_computed_estimate_and_changes_nothing(
    tmp_path, spawnable, accumulate
):
    measured = fit(tmp_path / "measured", accumulate, measure=True)
    plain = fit(tmp_path / "plain", accumulate, measure=False)
    expected = hand_computed(accumulate)
    assert expected.observations == EPOCHS * (N // (W * B) // accumulate)
    for rank, unmeasured in zip(measured, plain, strict=True):
        grad_norm_sq, trace_sigma, observations = rank["noise"]
        assert observations == expected.observations
        assert grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-9)
        assert trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-9)
        for name, value in unmeasured["params"].items():
            assert torch.equal(rank["params"][name], value), name  # bitwise: training unchanged


def test_ddp_noise_scale_divides_out_the_16_mixed_loss_scale(tmp_path, spawnable):
    """Under "16-mixed" (a real CPU GradScaler) every rank's gradients arrive multiplied by the
    loss scale (a power of 2, exact in this float64 network): the estimate is the unscaled
    run's (it came out multiplied by the squared scale)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)  # it changes
    measured = fit(tmp_path / "measured", 3, measure=True, scaler=scaler)
    expected = hand_computed(3)
    for rank in measured:
        grad_norm_sq, trace_sigma, observations = rank["noise"]
        assert observations == expected.observations
        assert grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-9)
        assert trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-9)


def test_ddp_noise_scale_resumes_from_the_lightning_checkpoint(tmp_path, spawnable):
    """Resumed after epoch 0's last step (a plain DataLoader resumes exactly only at an epoch's
    end): every rank loads rank 0's callback state and ends with the uninterrupted estimate."""
    full = fit(tmp_path / "full", 3, measure=True)
    step = N // (W * B * 3)
    resumed = fit(tmp_path / "resumed", 3, True, tmp_path / "full" / f"step={step}.ckpt")
    for rank, again in zip(full, resumed, strict=True):
        for name, value in rank["params"].items():
            assert torch.equal(again["params"][name], value), name
        assert again["noise"] == pytest.approx(rank["noise"], rel=1e-12)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_ddp_noise_scale_resumes_mid_epoch_with_a_stateful_dataloader(
    tmp_path, spawnable, accumulate
):
    """Resumed after the first step (mid-epoch 0): every rank loads rank 0's loader and callback
    state (the ranks' positions agree) and ends with the uninterrupted estimate and parameters."""
    pytest.importorskip("torchdata")
    full = fit(tmp_path / "full", accumulate, True, stateful=True)
    resumed = fit(tmp_path / "resumed", accumulate, True, tmp_path / "full" / "step=1.ckpt", True)
    for rank, again in zip(full, resumed, strict=True):
        for name, value in rank["params"].items():
            assert torch.equal(again["params"][name], value), name
        assert again["noise"] == pytest.approx(rank["noise"], rel=1e-12)


def test_ddp_window_cut_by_a_checkpoint_is_left_out_on_every_rank(tmp_path, spawnable):
    """Saved after 1 microbatch of the run's last window of 3: no rank holds that window's
    accumulated gradient, so every rank leaves it out; the estimate is the one before it."""
    pytest.importorskip("torchdata")
    batches = EPOCHS * N // (W * B)
    full = fit(tmp_path / "full", 3, True, stateful=True, save_after=batches - 3)
    checkpoint = tmp_path / "full" / "mid_window.ckpt"
    torch.load(checkpoint, weights_only=True)
    resumed = fit(tmp_path / "resumed", 3, True, checkpoint, stateful=True)
    unmeasured = fit(tmp_path / "unmeasured", 3, False, checkpoint, stateful=True)
    for rank, again, plain in zip(full, resumed, unmeasured, strict=True):
        for name, value in plain["params"].items():
            assert torch.equal(again["params"][name], value), name
        assert again["noise"] == pytest.approx(rank["steps"][-2], rel=1e-12)
        assert again["noise"][2] == rank["noise"][2] - 1
