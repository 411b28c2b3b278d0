"""``GraBCallback`` under Lightning's DDP: ``ddp_spawn``, two gloo processes on the CPU.

The sampler is built in ``setup()`` with ``statistics="sketch"`` (rank and replicas from the
process group), Lightning is told not to wrap it, and every rank steps its local microbatch after
each backward. The orders of both ranks must equal a one-process sketch-mode ``GraBSampler``
stepped on the same global microbatches (float64, so DDP's averaged update is the one-process
update), every example must be visited once per epoch across the ranks, and a resume from
Lightning's checkpoint (rank 0's callback state, loaded by every rank), mid-epoch or after an
epoch's last step, must visit the same batches and end with the same orders and parameters as
the uninterrupted run; so must a run whose loader is a ``StatefulDataLoader``, whose snapshot of
the sampler Lightning saves from rank 0 and restores on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from tests.integrations.lightning_hooks import SpawnedDDP, classified_rows, small_classifier  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit.integrations.lightning import GraBCallback  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

W, N, B, K, SEED, EPOCHS = 2, 48, 4, 64, 7, 3  # 6 microbatches of B per rank and epoch
ACCUMULATE = 2  # 3 optimizer steps per epoch


def data() -> TensorDataset:
    x, y, _ = classified_rows(N)
    return TensorDataset(x, y, torch.arange(N))


def network() -> torch.nn.Module:
    return small_classifier(16)


def sampler_for(net: torch.nn.Module, **topology) -> GraBSampler:
    return GraBSampler(
        range(N), model=net, statistics="sketch", sketch_dim=K, seed=SEED, balance_type="pair",
        batch_size=B, record_orders=True, **topology,
    )  # fmt: skip


class Classifier(L.LightningModule):
    """Builds its sampler in ``setup()``; writes what its rank saw to ``out/rank<r>.pt``."""

    def __init__(self, out: str, stateful: bool = False) -> None:
        super().__init__()
        self.net, self.out, self.seen, self.stateful = network(), out, [], stateful

    def setup(self, stage: str) -> None:
        self.sampler = sampler_for(self.net)  # num_replicas and rank from the process group

    def train_dataloader(self) -> DataLoader:
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(data(), sampler=self.sampler, batch_size=B)
        return DataLoader(data(), sampler=self.sampler, batch_size=B)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append([self.current_epoch, idx.tolist()])
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def on_train_end(self) -> None:
        params = {k: v.detach().clone() for k, v in self.net.named_parameters()}
        torch.save(
            {"orders": self.sampler.orders_history, "seen": self.seen, "params": params,
             "replicas": [self.sampler.num_replicas, self.sampler.rank]},
            Path(self.out) / f"rank{self.global_rank}.pt",
        )  # fmt: skip


def fit(out: Path, ckpt_path: Path | None = None, module=None, callback=None, **options):
    """One ``ddp_spawn`` fit of two CPU processes; what each rank saw, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    saver = L.callbacks.ModelCheckpoint(
        dirpath=str(out), filename="{step}", every_n_train_steps=2, save_top_k=-1
    )
    settings = dict(
        accelerator="cpu", devices=W, strategy=SpawnedDDP(), use_distributed_sampler=False,
        max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATE, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(out),
    )  # fmt: skip
    settings.update(options)
    trainer = L.Trainer(callbacks=[callback or GraBCallback(), saver], **settings)
    trainer.fit(module or Classifier(str(out)), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(W)]


def one_process_orders() -> list[list[int]]:
    """The reference: one process, the same network and sketch, global microbatches of W * B
    in the order the ranks visit them together, the same accumulation and SGD."""
    net, (x, y, _) = network(), data().tensors
    sampler = sampler_for(net, num_replicas=1, rank=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, N, ACCUMULATE * W * B):
            for m in range(ACCUMULATE):
                micro = order[start + m * W * B : start + (m + 1) * W * B]
                (F.cross_entropy(net(x[micro]), y[micro]) / ACCUMULATE).backward()
                sampler.step()
            opt.step()
            opt.zero_grad()
    return sampler.orders_history


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = Path(__file__).resolve().parents[2]
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))  # the spawned ranks import this module
        out = tmp_path_factory.mktemp("ddp") / "full"
        return out, fit(out)


def test_ranks_share_the_one_process_grab_order_and_visit_every_example_once(full_run):
    _, ranks = full_run
    assert [rank["replicas"] for rank in ranks] == [[W, r] for r in range(W)]
    expected = one_process_orders()
    assert len({tuple(order) for order in expected}) == EPOCHS  # the gradients moved the orders
    for rank in ranks:
        assert rank["orders"] == expected
    for epoch in range(EPOCHS):
        visited = [i for rank in ranks for e, idx in rank["seen"] if e == epoch for i in idx]
        assert sorted(visited) == list(range(N))
    for name, value in ranks[0]["params"].items():  # DDP kept the replicas in step
        assert torch.equal(value, ranks[1]["params"][name]), name


@pytest.mark.parametrize("step", [4, 6])  # one optimizer step into epoch 1; its last step
def test_resume_from_the_lightning_checkpoint_is_exact(full_run, monkeypatch, step):
    out, full = full_run
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    resumed = fit(out.parent / f"resumed{step}", ckpt_path=out / f"step={step}.ckpt")
    done = step * ACCUMULATE - N // (W * B)  # microbatches of epoch 1 trained before
    for rank, again in zip(full, resumed, strict=True):
        assert again["orders"] == rank["orders"]
        first = [idx for e, idx in rank["seen"] if e == 1]
        assert [idx for e, idx in again["seen"] if e == 1] == first[done:]
        assert [idx for e, idx in again["seen"] if e == 2] == [i for e, i in rank["seen"] if e == 2]
        for name, value in rank["params"].items():
            assert torch.equal(again["params"][name], value), name


def test_resume_of_a_stateful_loader_from_rank_0s_snapshot_is_exact(full_run, monkeypatch):
    """The checkpoint holds rank 0's StatefulDataLoader snapshot, the sampler's state in it
    (rank=0 in its configuration); rank 1 loads it as its own (it refused it as another
    configuration's) and both ranks end as the uninterrupted run."""
    pytest.importorskip("torchdata")
    out, full = full_run
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    root = out.parent / "stateful"
    fit(root, module=Classifier(str(root), stateful=True), max_epochs=2)
    resumed = fit(root / "resumed", ckpt_path=root / "step=4.ckpt",
                  module=Classifier(str(root / "resumed"), stateful=True))  # fmt: skip
    for rank, again in zip(full, resumed, strict=True):
        assert again["orders"] == rank["orders"]
        for name, value in rank["params"].items():
            assert torch.equal(again["params"][name], value), name


class EveryRankZero(Classifier):
    """Builds every rank's sampler as rank 0 (as a script that hard-codes the rank would)."""

    def setup(self, stage: str) -> None:
        self.sampler = sampler_for(self.net, num_replicas=W, rank=0)


def test_a_wrapped_or_misranked_sampler_is_refused(tmp_path, monkeypatch):
    """The silent failures: Lightning's DistributedSamplerWrapper around the GraB sampler
    (the ranks visit other examples than GraB's order says) and ranks built alike, which would
    visit the same examples."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    wrapped = r"wrapped the GraBSampler in DistributedSamplerWrapper.*use_distributed_sampler=False"
    with pytest.raises(Exception, match=wrapped):
        fit(tmp_path / "wrapped", use_distributed_sampler=True)
    misranked = r"rank 1 but its GraBSampler was built with rank=0|another rank's"
    with pytest.raises(Exception, match=misranked):
        fit(tmp_path / "misranked", module=EveryRankZero(str(tmp_path)))
