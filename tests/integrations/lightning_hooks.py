"""What the Lightning tests share: their rows and network, a checkpoint at any batch, the estimates
per step, each rank's loader of a DDP run, and a ``ddp_spawn`` strategy whose processes end
cleanly."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from grabkit.integrations.lightning import NoiseScaleCallback


def classified_rows(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """The rows the Lightning tests train on: features (n, 6) in float64 and classes (n,) of 3,
    seeded, and the generator that drew them (for a further column drawn after them)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen), gen


def small_classifier(hidden: int = 16) -> torch.nn.Module:
    """Linear(6, hidden), Tanh, Linear(hidden, 3) in float64, seeded: every rank builds it alike
    (float64, so that DDP's averaged update is the one-process update)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    ).double()


class SpawnedDDP(DDPStrategy):
    """``strategy="ddp_spawn"`` that destroys its process group when the fit ends.

    Lightning destroys only an NCCL group (at exit). A gloo group left to interpreter shutdown can
    abort a rank with SIGABRT ("terminate called without an active exception") after a run that
    passed: its worker threads outlive the interpreter.
    """

    def __init__(self) -> None:
        super().__init__(start_method="spawn")

    def teardown(self) -> None:
        super().teardown()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


class SaveAfterBatch(L.Callback):
    """``trainer.save_checkpoint`` after the ``at``-th batch of the run (0-based): mid-window."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx == self.at:
            trainer.save_checkpoint(self.path)


class Estimates(L.Callback):
    """The noise callback's estimate after every optimizer step (it runs first)."""

    def __init__(self) -> None:
        self.values: list[tuple | None] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        noise = next(c for c in trainer.callbacks if isinstance(c, NoiseScaleCallback))
        self.values.append(triple(noise.result))


def triple(result) -> tuple | None:
    if result is None:
        return None
    return result.grad_norm_sq, result.trace_sigma, result.observations


def rank_loader(dataset: Dataset, world: int, rank: int, batch: int, stateful: bool) -> DataLoader:
    """This rank's share of ``dataset`` in order; ``stateful``: a ``StatefulDataLoader``, whose
    position is in Lightning's checkpoint (an exact mid-epoch resume)."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=batch, sampler=sampler)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)
