"""Grouped runs under DistributedDataParallel and fully_shard on 2 gloo ranks whose batches split
into different numbers of groups: the ranks' parameters stay equal and equal a one-process padded
run of the global batch (through the DDP wrapper, through ``ddp.module``, and group by group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.support.distributed import run_distributed
from torch import nn

from grabkit.group import backward_by_group, group_batch, run_grouped

WORLD, ITEMS, LENGTH, STEPS, LR = 2, 8, 12, 2, 0.3
MODES = ("ddp", "ddp.module", "ddp by group", "fully_shard", "fully_shard by group")


class Pool(nn.Module):
    """Sum-pooled embeddings, with a buffer (which DDP broadcasts in every forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(20, 6), nn.Linear(6, 1)
        self.register_buffer("gain", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).masked_fill(~mask[..., None], 0.0).sum(1) * self.gain
        return self.out(h)[:, 0]


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, lengths, targets) per step; rank 1's lengths are much more alike."""
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(STEPS):
        low = 1 if rank == 0 else LENGTH - 2
        lengths = torch.randint(low, LENGTH + 1, (ITEMS,), generator=gen)
        tokens = torch.randint(0, 20, (ITEMS, LENGTH), generator=gen)
        out.append((tokens, lengths, torch.randn(ITEMS, generator=gen)))
    return out


def _wrap(mode: str) -> tuple[nn.Module, nn.Module]:
    """(what the grouped run is given, what holds the parameters)."""
    model = Pool()
    if mode.startswith("fully_shard"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.emb)
        fully_shard(model.out)
        fully_shard(model)
        return model, model
    ddp = nn.parallel.DistributedDataParallel(model)
    return (ddp.module if mode == "ddp.module" else ddp), ddp


def train(rank: int, mode: str) -> tuple[list[int], list[list[float]]]:
    runner, holder = _wrap(mode)
    optimizer = torch.optim.SGD(holder.parameters(), lr=LR)
    groups = []
    for tokens, lengths, targets in batches(rank):
        batch = group_batch(tokens, lengths)
        groups.append(len(batch.plan))
        if mode.endswith("by group"):
            backward_by_group(
                runner, batch, lambda out, items, y=targets: (out - y[items]) ** 2, pass_mask=True
            )
        else:
            out = run_grouped(runner, tokens, lengths, plan=batch.plan, pass_mask=True)
            ((out - targets) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = holder.parameters()
    if mode.startswith("fully_shard"):
        params = [p.full_tensor() for p in params]
    return groups, [p.detach().reshape(-1).tolist() for p in params]


def rank_body(rank: int, world_size: int, payload: None) -> dict:
    return {mode: train(rank, mode) for mode in MODES}


def padded_reference() -> list[torch.Tensor]:
    model = Pool()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in zip(*(batches(rank) for rank in range(WORLD)), strict=True):
        tokens = torch.cat([t for t, _, _ in step])
        lengths = torch.cat([n for _, n, _ in step])
        targets = torch.cat([y for _, _, y in step])
        mask = torch.arange(LENGTH)[None] < lengths[:, None]
        ((model(tokens, mask) - targets) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().reshape(-1) for p in model.parameters()]


@pytest.mark.distributed
def test_grouped_runs_keep_the_ranks_equal_to_one_padded_process(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    per_rank = run_distributed(rank_body, WORLD, timeout=300)
    reference = padded_reference()
    for mode in MODES:
        counts = [rank[mode][0] for rank in per_rank]
        assert counts[0] != counts[1], mode  # the ranks really ran different numbers of groups
        for rank in per_rank:
            for got, want in zip(rank[mode][1], reference, strict=True):
                torch.testing.assert_close(torch.tensor(got), want, msg=mode)
