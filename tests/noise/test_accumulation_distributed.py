"""AccumulationNoiseScale under DDP ``no_sync`` accumulation: every rank's microbatches enter one
estimate, equal on all ranks to the one-process computation over the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.noise.accumulation_bodies import ddp_no_sync_steps
from tests.noise.helpers import digits, make_model, per_example_loss
from tests.support.distributed import run_distributed

from grabkit.noise import MicrobatchNoiseScale

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def one_process_reference(payload: dict) -> list:
    """The same SGD steps in one process, from autograd gradients: every microbatch of every
    rank observed with its own mean gradient, the step with the mean over all of them."""
    x, y = payload["x"], payload["y"]
    model = make_model(payload["seed"])
    params = list(model.parameters())
    names = tuple(n for n, _ in model.named_parameters())
    est = MicrobatchNoiseScale(update_rate=payload["update_rate"], block_names=names)
    k, out = payload["microbatches"], []
    for step in range(x.shape[0]):
        grads = []
        for rank in range(x.shape[1]):
            for xs, ys in zip(x[step, rank].chunk(k), y[step, rank].chunk(k), strict=True):
                g = torch.autograd.grad(per_example_loss(model, xs, ys).mean(), params)
                grads.append(g)
                est.observe_microbatch(torch.stack([(t * t).sum() for t in g]), len(xs))
        mean = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
        out.append(est.observe_step(torch.stack([(t * t).sum() for t in mean])))
        with torch.no_grad():
            for p, g in zip(params, mean, strict=True):
                p -= payload["lr"] * g
    return out


@pytest.mark.distributed
def test_no_sync_accumulation_gives_the_one_process_estimate_on_every_rank(monkeypatch):
    monkeypatch.syspath_prepend(REPO_ROOT)  # spawned ranks import the body by module name
    x, y = digits()
    steps, world, local = 3, 2, 12
    index = torch.randint(
        x.shape[0], (steps, world, local), generator=torch.Generator().manual_seed(5)
    )
    payload = {
        "x": x[index],
        "y": y[index],
        "seed": 2,
        "lr": 0.5,
        "update_rate": 0.5,
        "microbatches": 3,
    }
    per_rank = run_distributed(ddp_no_sync_steps, world, payload)
    reference = one_process_reference(payload)
    for rank in per_rank:
        for got, want in zip(rank["steps"], reference, strict=True):
            assert got["grad_norm_sq"] == pytest.approx(want.block_grad_norm_sq.tolist(), rel=1e-9)
            assert got["trace_sigma"] == pytest.approx(want.block_trace_sigma.tolist(), rel=1e-9)
            assert got["b_simple"] == pytest.approx(want.b_simple, rel=1e-9)
        assert "not averaged over the ranks" in rank["unsynchronised"]
