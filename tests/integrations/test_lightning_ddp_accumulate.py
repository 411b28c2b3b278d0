"""``AdaptiveAccumulationCallback`` under Lightning's DDP: ``ddp_spawn``, two gloo processes.

Each rank trains its ``DistributedSampler`` share (rank r: rows r, r + W, ...; no shuffling) in
local microbatches of B rows, so global microbatch k is rows ``k W B .. (k + 1) W B - 1``. Both
ranks must take the same decisions and end with bitwise-equal parameters, equal to one process
over the global microbatches: a hand loop for the norm threshold (with and without Lightning's
``gradient_clip_val``), the one-process wrapper for the noise-scale, scheduled-batch, metric and
cosine-scheduled threshold rules; the window open at train end is applied on every rank; a
checkpoint inside a window (``StatefulDataLoader``) or with a window open across an epoch's end
(plain ``DataLoader``) resumes to the uninterrupted run. Ranks that count different weights for a
microbatch (DDP averages their gradients with equal weights) are refused before anything of it is
applied, by the wrapper, in the all-reduce it makes anyway: no collective of the callback's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from tests.integrations.lightning_hooks import (  # noqa: E402
    SaveAfterBatch,
    SpawnedDDP,
    classified_rows,
    rank_loader,
    small_classifier,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit.accumulate import (  # noqa: E402
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
    ValueSchedule,
    get_norm_threshold_cosine_annealing_with_warmup,
)
from grabkit.integrations.lightning import (  # noqa: E402
    AdaptiveAccumulationCallback,
    batch_count,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

W, N, B, EPOCHS, LR = 2, 40, 4, 2, 0.3  # 5 local microbatches of B per rank and epoch
THRESHOLD, CLIP = 0.6, 0.2


def data() -> TensorDataset:
    """Rows x (N, 6), class y (N,), and whether the row is trained (N,): the token mask of the
    test whose ranks count different weights."""
    x, y, gen = classified_rows(N)
    return TensorDataset(x, y, torch.rand(N, generator=gen) < 0.6)


def trained_rows(batch) -> float:
    """The batch's weight when only its trained rows count (as tokens would)."""
    return float(batch[2].sum())


def network() -> torch.nn.Module:
    return small_classifier(16)


def wrap(kind: str, optimizer: torch.optim.Optimizer):
    """The wrappers probed, by name (``ddp_spawn`` pickles the module, so no lambdas)."""
    if kind in ("gnts", "gnts_cosine"):
        return OptimizerWrapperGNTS(optimizer, max_batch_draws=3, norm_threshold=THRESHOLD)
    if kind == "masked":
        return OptimizerWrapperGNTS(optimizer, max_batch_draws=3, norm_threshold=0.0)
    if kind == "mht":  # decides on the loss Lightning's closure returns
        return OptimizerWrapperMHT(optimizer, 0.8, 0.1, max_batch_draws=4)
    if kind == "gns":
        return OptimizerWrapperGNS(optimizer, noise_multiplier=2.0, max_batch_draws=4)
    return OptimizerWrapperSBC(
        optimizer, physical_batch_size=W * B, initial_logical_batch_size=3 * W * B
    )


def threshold_schedule(kind: str, wrapper) -> ValueSchedule | None:
    """``gnts_cosine``: the norm threshold from 0.4 to 0.65 over 4 real updates (its decisions
    mix full windows, the threshold and an open window at the end)."""
    if kind != "gnts_cosine":
        return None
    return get_norm_threshold_cosine_annealing_with_warmup(wrapper, 1, 4, 0.4, 0.65, 1.0)


class Classifier(L.LightningModule):
    """Writes its parameters, its wrapper's counters and decisions to ``out/rank<r>.pt``."""

    def __init__(self, out: str, kind: str, stateful: bool = False) -> None:
        super().__init__()
        self.net, self.out, self.kind, self.stateful = network(), out, kind, stateful
        self.reasons: list[str] = []

    def train_dataloader(self) -> DataLoader:
        return rank_loader(data(), W, self.global_rank, B, self.stateful)

    def training_step(self, batch, batch_idx):
        x, y, trained = batch
        if self.kind == "masked":  # the mean over this rank's trained rows
            return F.cross_entropy(self.net(x[trained]), y[trained])
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        wrapper = wrap(self.kind, torch.optim.SGD(self.parameters(), lr=LR))
        schedule = threshold_schedule(self.kind, wrapper)
        if schedule is None:
            return wrapper
        return {"optimizer": wrapper, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:  # a knob schedule, not an LR one
        scheduler.step()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.reasons.append(self.trainer.optimizers[0].last_reason)

    def on_train_end(self) -> None:  # after the callback's: the open window is applied
        wrapper = self.trainer.optimizers[0]
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in self.net.named_parameters()},
                "num_steps": wrapper.num_steps,
                "num_batches": wrapper.counters.num_batches,
                "open_draws": wrapper.counters.num_draws,
                "last_reason": wrapper.last_reason,
                "clip": wrapper.clip_grad_norm,
                "reasons": self.reasons,
            },
            Path(self.out) / f"rank{self.global_rank}.pt",
        )


class Collectives(L.Callback):
    """Records, for every batch, the files that called ``torch.distributed.all_reduce`` from
    its start to its end (each rank writes ``out/collectives<r>.pt``). DDP's own gradient
    all-reduce runs in its C++ reducer and is not seen."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.batches: list[list[str]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        original = torch.distributed.all_reduce

        def counting(*args, **kwargs):
            if self.batches:
                self.batches[-1].append(sys._getframe(1).f_code.co_filename)
            return original(*args, **kwargs)

        torch.distributed.all_reduce = counting
        self._original = original

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append([])  # runs first: listed before AdaptiveAccumulationCallback

    def on_train_end(self, trainer, pl_module) -> None:
        torch.distributed.all_reduce = self._original
        torch.save(self.batches, Path(self.out) / f"collectives{trainer.global_rank}.pt")


def fit(
    out: Path, kind: str, ckpt_path: Path | None = None, stateful: bool = False,
    save_after: int | str | None = None, collectives: bool = False, **options,
) -> list[dict]:  # fmt: skip
    """One ``ddp_spawn`` fit of two CPU processes; what each rank ended with, by rank
    (``collectives``: with ``Collectives``' record under ``"collectives"``)."""
    out.mkdir(parents=True, exist_ok=True)
    counting = trained_rows if kind == "masked" else batch_count
    callbacks = [AdaptiveAccumulationCallback(count_fn=counting)]
    if collectives:
        callbacks.insert(0, Collectives(str(out)))
    if save_after == "epoch":  # Lightning's recipe for a plain DataLoader
        callbacks.append(
            L.callbacks.ModelCheckpoint(
                dirpath=str(out), filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True
            )
        )
    elif save_after is not None:  # after that batch of the run: inside a window
        callbacks.append(SaveAfterBatch(save_after, out / "mid_window.ckpt"))
    settings = dict(
        accelerator="cpu", devices=W, strategy=SpawnedDDP(), max_epochs=EPOCHS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=save_after == "epoch", default_root_dir=str(out), callbacks=callbacks,
        use_distributed_sampler=False,
    )  # fmt: skip
    settings.update(options)
    L.Trainer(**settings).fit(Classifier(str(out), kind, stateful), ckpt_path=ckpt_path)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(W)]
    for r, rank in enumerate(ranks):
        if collectives:
            rank["collectives"] = torch.load(out / f"collectives{r}.pt", weights_only=True)
    return ranks


def global_microbatches():
    """The global microbatches of the run, in order: rank r's k-th batch of B rows, all r."""
    x, y, _ = data().tensors
    shares = [list(range(r, N, W)) for r in range(W)]
    for _ in range(EPOCHS):
        for start in range(0, N // W, B):
            rows = sorted(i for share in shares for i in share[start : start + B])
            yield x[rows], y[rows]


def hand_gnts(clip: float | None) -> tuple[dict, int]:
    """One process, by hand: fold count-weighted gradients, step when |mean| <= THRESHOLD or
    after 3 microbatches, clip the mean to ``clip``, SGD; the open window applied at the end."""
    net = network()
    params = list(net.parameters())
    sums, count, draws, steps = [torch.zeros_like(p) for p in params], 0.0, 0, 0

    def apply() -> None:
        mean = [s / count for s in sums]
        norm = torch.sqrt(sum(m.square().sum() for m in mean))
        scale = 1.0 if clip is None else min(1.0, clip / (float(norm) + 1e-6))
        with torch.no_grad():
            for p, m in zip(params, mean, strict=True):
                p -= LR * scale * m

    for x, y in global_microbatches():
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), params)
        sums = [s + len(x) * g for s, g in zip(sums, grads, strict=True)]
        count, draws = count + len(x), draws + 1
        norm = torch.sqrt(sum((s / count).square().sum() for s in sums))
        if draws >= 3 or float(norm) <= THRESHOLD:
            apply()
            sums, count, draws, steps = [torch.zeros_like(p) for p in params], 0.0, 0, steps + 1
    if draws:
        apply()
        steps += 1
    return {k: v.detach() for k, v in net.named_parameters()}, steps


def one_process(kind: str) -> tuple[dict, int, str]:
    """One process stepping the same wrapper on every global microbatch, its schedule after
    every real update, then ``flush``."""
    net = network()
    wrapper = wrap(kind, torch.optim.SGD(net.parameters(), lr=LR))
    schedule = threshold_schedule(kind, wrapper)
    for x, y in global_microbatches():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        metric = loss.detach() if kind == "mht" else None
        if wrapper.step(count=len(x), metric=metric) and schedule is not None:
            schedule.step()
    wrapper.flush()
    return (
        {k: v.detach() for k, v in net.named_parameters()},
        wrapper.num_steps,
        wrapper.last_reason,
    )


@pytest.fixture
def spawnable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


def assert_ranks_equal(ranks: list[dict]) -> None:
    first = ranks[0]
    for other in ranks[1:]:
        assert other["reasons"] == first["reasons"]
        assert other["num_steps"] == first["num_steps"]
        for name, value in first["params"].items():
            assert torch.equal(other["params"][name], value), name  # bitwise


def assert_resumed_equal(full: list[dict], resumed: list[dict], done: int) -> None:
    """Each rank of the resumed run ends as the uninterrupted one, bitwise, having made the
    decisions that followed the first ``done`` microbatches."""
    assert_ranks_equal(resumed)
    for rank, again in zip(full, resumed, strict=True):
        assert again["num_steps"] == rank["num_steps"]
        assert again["reasons"] == rank["reasons"][done:]
        for name, value in rank["params"].items():
            assert torch.equal(again["params"][name], value), name


def assert_params_close(got: dict, want: dict) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("clip", [None, CLIP])
def test_norm_threshold_under_ddp_is_the_hand_loop_over_global_microbatches(
    tmp_path, spawnable, clip
):
    ranks = fit(tmp_path, "gnts", gradient_clip_val=clip)
    assert_ranks_equal(ranks)
    params, steps = hand_gnts(clip)
    reasons = ranks[0]["reasons"]
    assert "accumulating" in reasons and "norm_threshold" in reasons  # windows of several sizes
    assert ranks[0]["num_steps"] == steps
    assert_params_close(ranks[0]["params"], params)
    for rank in ranks:
        assert rank["clip"] == clip and rank["open_draws"] == 0
        assert rank["num_batches"] == EPOCHS * N // (W * B)


@pytest.mark.parametrize("kind", ["gns", "sbc", "gnts_cosine", "mht"])
def test_noise_scale_and_scheduled_wrappers_under_ddp_equal_one_process(tmp_path, spawnable, kind):
    ranks = fit(tmp_path, kind)
    assert_ranks_equal(ranks)
    params, steps, last_reason = one_process(kind)
    assert ranks[0]["num_steps"] == steps
    assert_params_close(ranks[0]["params"], params)
    assert ranks[0]["last_reason"] == last_reason  # "flushed": the last window was open
    assert all(rank["open_draws"] == 0 for rank in ranks)


def test_a_checkpoint_inside_a_window_resumes_to_the_uninterrupted_run(tmp_path, spawnable):
    """Saved after the 2nd global microbatch, inside the first window: every rank loads rank
    0's window (the same on every rank: it holds all-reduced gradients) and schedule."""
    pytest.importorskip("torchdata")
    kind = "gnts_cosine"
    full = fit(tmp_path / "full", kind, stateful=True, save_after=1)
    assert full[0]["reasons"][:2] == ["accumulating"] * 2
    resumed = fit(tmp_path / "resumed", kind, tmp_path / "full" / "mid_window.ckpt", True)
    assert_resumed_equal(full, resumed, done=2)


def test_ranks_counting_different_weights_are_refused_before_anything_is_folded(
    tmp_path, spawnable
):
    """Each rank's loss is the mean over its trained rows, weighed by their number, which
    differs between the ranks: DDP averages the ranks' gradients with equal weights, so the
    count-weighted window would not be the global microbatch's. Refused on every rank by the
    wrapper, after the first microbatch's backward and before it is folded or applied."""
    trained = data().tensors[2]
    shares = [trained[r::W][:B].sum() for r in range(W)]
    assert shares[0] != shares[1]  # the first microbatch already differs
    refusal = r"ValueError: AdaptiveAccumulationCallback.*counted different weights.*Distributed"
    with pytest.raises(Exception, match=refusal):  # ddp_spawn re-raises the ranks' error
        fit(tmp_path, "masked")


def test_each_microbatch_makes_only_the_wrappers_own_all_reduces(tmp_path, spawnable):
    """The equal-count check rides in the wrapper's statistics all-reduce: per microbatch the
    statistics vector and the window's norms, both from the wrapper, none from the callback."""
    ranks = fit(tmp_path, "gnts", collectives=True, max_epochs=1)
    assert_ranks_equal(ranks)
    for rank in ranks:
        batches = rank["collectives"]
        assert len(batches) == N // (W * B)
        for callers in batches:
            assert len(callers) == 2, callers
            assert all(c.endswith(("accumulate/distributed.py", "accumulate/wrapper.py"))
                       for c in callers), callers  # fmt: skip


def test_a_window_open_across_an_epoch_end_checkpoint_resumes_to_the_uninterrupted_run(
    tmp_path, spawnable
):
    """A plain DataLoader, saved at epoch 0's end (5 microbatches, SBC windows of 3): the open
    window of 2 global microbatches continues into epoch 1 on every rank."""
    full = fit(tmp_path / "full", "sbc", save_after="epoch")
    assert full[0]["reasons"][4] == "accumulating"
    resumed = fit(tmp_path / "resumed", "sbc", tmp_path / "full" / "epoch=0.ckpt")
    assert_resumed_equal(full, resumed, done=5)
