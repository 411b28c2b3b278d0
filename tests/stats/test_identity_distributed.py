"""The identity check under ``DistributedDataParallel`` (2 gloo ranks): each rank checks its
local gradient before the all-reduce, in exact and in sketch mode, and a mismatch on one rank is
caught there while the other rank's statistics stay right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.support.distributed import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from grabkit.stats import IdentityCheckError, PerSampleStats
from grabkit.stats.sketch import GradientSketch, SketchedStats

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

B, STEPS = 4, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(B, 5, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (B,), generator=gen)


def local_rows(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, d): each local example's own loss gradient, one autograd.grad each."""
    rows = []
    for i in range(len(x)):
        loss = F.cross_entropy(net(x[i : i + 1]), y[i : i + 1], reduction="sum")
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, net.parameters())]))
    return torch.stack(rows)


def rank_body(rank: int, world_size: int, mode: str) -> dict:
    net = make_model()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "exact":
        stats = PerSampleStats(net, "sum")
    else:
        stats = SketchedStats(model, dim=16, seed=1, loss_reduction="sum")
    errors, mismatches = [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        expected = local_rows(net, x, y)  # before the step's forward: not part of it
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        if rank == 1 and step == STEPS - 1:
            loss = loss + 1e-2 * sum(p.square().sum() for p in net.parameters())
        loss.backward()  # the all-reduce: .grad holds the mean of both ranks
        try:
            if mode == "exact":
                got, want = stats.norms_squared(), expected.square().sum(1)
            else:
                shapes = {n: p.shape for n, p in net.named_parameters()}
                got = stats.sketches()
                want = GradientSketch(shapes, 16, 1).apply_dense(expected)
            mismatches.append(float((got - want).abs().max() / want.abs().max()))
        except IdentityCheckError as error:
            errors.append(str(error))
        opt.step()
    stats.close()
    return {"errors": errors, "mismatches": mismatches}


@pytest.mark.parametrize("mode", ["exact", "sketch"])
def test_each_rank_checks_its_local_gradient_before_the_all_reduce(monkeypatch, mode):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    rank0, rank1 = run_distributed(rank_body, world_size=2, payload=mode)
    assert rank0["errors"] == [] and len(rank0["mismatches"]) == STEPS
    assert len(rank1["errors"]) == 1 and "'0.weight'" in rank1["errors"][0]
    assert len(rank1["mismatches"]) == STEPS - 1
    assert max(rank0["mismatches"] + rank1["mismatches"]) < 1e-10
