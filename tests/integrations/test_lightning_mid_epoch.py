"""``NoiseScaleCallback`` resumed from mid-epoch Lightning checkpoints, one process on the CPU.

Lightning restores the loop's counters, not a plain ``DataLoader``'s position: resumed mid-epoch,
it restarts the epoch's batches from the first one and trains as many as were left, so the run
differs from the uninterrupted one with or without grabkit. The callback must then measure the
stream Lightning trains (the estimate of an uninterrupted run over that same stream). torchdata's
``StatefulDataLoader``, whose state Lightning saves and restores, resumes exactly: the estimate
and the parameters must be the uninterrupted run's. A checkpoint saved inside an accumulation
window holds no accumulated gradient: the window is left out, with a warning.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from tests.integrations.lightning_hooks import Estimates, SaveAfterBatch, classified_rows, triple  # noqa: E402
from torch.utils.data import DataLoader, Sampler, TensorDataset  # noqa: E402

from grabkit.integrations.lightning import NoiseScaleCallback  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

N, B, EPOCHS, RATE = 36, 2, 2, 0.5  # 18 microbatches an epoch


def data() -> TensorDataset:
    x, y, _ = classified_rows(N)
    return TensorDataset(x, y, torch.arange(N))


class Replay(Sampler[int]):
    """Epoch e visits ``orders[e]``: an uninterrupted run over a given stream of rows."""

    def __init__(self, orders: list[list[int]]) -> None:
        self.orders, self.epoch = orders, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.orders[self.epoch])

    def __len__(self) -> int:
        return len(self.orders[0])


class Classifier(L.LightningModule):
    """Records the rows it trains, in order."""

    def __init__(self, loader: str, orders: list[list[int]] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        ).double()
        self.loader, self.orders, self.rows = loader, orders, []

    def train_dataloader(self):
        if self.loader == "replay":
            return DataLoader(data(), batch_size=B, sampler=Replay(self.orders))
        if self.loader == "stateful":  # shuffled: the sampler's state is restored too
            return stateful.StatefulDataLoader(data(), batch_size=B, shuffle=True)
        return DataLoader(data(), batch_size=B)

    def training_step(self, batch, batch_idx):
        x, y, rows = batch
        self.rows += rows.tolist()
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def fit(out: Path, accumulate: int, loader: str, measure: bool = True, ckpt_path=None,
        save_after: int | None = None, orders=None) -> dict:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [NoiseScaleCallback(update_rate=RATE), Estimates()] if measure else []
    callbacks.append(
        L.callbacks.ModelCheckpoint(
            dirpath=str(out), filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
    )
    if save_after is not None:
        callbacks.append(SaveAfterBatch(save_after, out / "mid_window.ckpt"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, accumulate_grad_batches=accumulate,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(out), callbacks=callbacks,
    )  # fmt: skip
    model = Classifier(loader, orders)
    trainer.fit(model, ckpt_path=ckpt_path)
    return {
        "params": {k: v.detach().clone() for k, v in model.net.named_parameters()},
        "noise": triple(callbacks[0].result) if measure else None,
        "steps": callbacks[1].values if measure else None,
        "rows": model.rows,
    }


def assert_same_params(a: dict, b: dict) -> None:
    for name, value in a["params"].items():
        assert torch.equal(b["params"][name], value), name


@pytest.mark.parametrize("accumulate", [2, 3])
def test_stateful_dataloader_resumes_mid_epoch_to_the_uninterrupted_run(tmp_path, accumulate):
    full = fit(tmp_path / "full", accumulate, "stateful")
    checkpoint = tmp_path / "full" / "step=2.ckpt"  # mid-epoch 0
    torch.load(checkpoint, weights_only=True)  # the callback's state is plain
    resumed = fit(tmp_path / "resumed", accumulate, "stateful", ckpt_path=checkpoint)
    unmeasured = fit(tmp_path / "unmeasured", accumulate, "stateful", False, checkpoint)
    assert resumed["rows"] == full["rows"][2 * accumulate * B :]
    assert_same_params(full, resumed)
    assert_same_params(unmeasured, resumed)  # bitwise: measuring changes nothing
    assert resumed["noise"] == pytest.approx(full["noise"], rel=1e-12)


def test_plain_dataloader_resume_measures_the_stream_lightning_trains(tmp_path):
    """Resumed after 2 steps of 3 microbatches: Lightning trains rows 0..23 of epoch 0 again
    (its first 12 batches, as many as were left), not rows 12..35; the estimate is that of an
    uninterrupted run over this stream."""
    accumulate, done = 3, 2 * 3 * B
    full = fit(tmp_path / "full", accumulate, "plain")
    checkpoint = tmp_path / "full" / "step=2.ckpt"
    resumed = fit(tmp_path / "resumed", accumulate, "plain", ckpt_path=checkpoint)
    stream = [list(range(done)) + list(range(N - done)), list(range(N))]
    assert resumed["rows"] == stream[0][done:] + stream[1]
    assert resumed["rows"] != full["rows"][done:]  # Lightning does not resume the position
    replayed = fit(tmp_path / "replayed", accumulate, "replay", orders=stream)
    assert_same_params(replayed, resumed)
    assert resumed["noise"] == pytest.approx(replayed["noise"], rel=1e-12)


@pytest.mark.parametrize("done", [1, 2])  # microbatches of the last window before the save
def test_a_window_cut_by_a_checkpoint_is_left_out(tmp_path, done):
    """Saved inside the run's last window of 3: Lightning's checkpoint holds no accumulated
    gradient, so that window cannot be measured; the estimate is the one before it."""
    accumulate, batches = 3, EPOCHS * N // B
    full = fit(tmp_path / "full", accumulate, "stateful", save_after=batches - 4 + done)
    checkpoint = tmp_path / "full" / "mid_window.ckpt"
    torch.load(checkpoint, weights_only=True)
    with pytest.warns(UserWarning, match="inside an accumulation window"):
        resumed = fit(tmp_path / "resumed", accumulate, "stateful", ckpt_path=checkpoint)
    unmeasured = fit(tmp_path / "unmeasured", accumulate, "stateful", False, checkpoint)
    assert resumed["rows"] == full["rows"][(batches - 3 + done) * B :]  # the data resumes exactly
    assert_same_params(unmeasured, resumed)
    assert resumed["noise"] == pytest.approx(full["steps"][-2], rel=1e-12)
    assert resumed["noise"][2] == full["noise"][2] - 1
