"""Module-level bodies for the multi-process DDPNoiseScale tests (spawned processes import them)."""

from __future__ import annotations

import contextlib

import torch
from tests.noise.helpers import make_model, per_example_loss
from torch.nn.parallel import DistributedDataParallel

from grabkit.noise import DDPNoiseScale


def train_and_measure(rank: int, world_size: int, payload: dict) -> list[dict]:
    """DDP SGD steps, ``microbatches`` no_sync accumulations per rank; plain-list results
    (tensors would travel by shared memory that dies with the process)."""
    x, y = payload["x"], payload["y"]  # (steps, world, local examples, ...)
    model = make_model(payload["seed"])
    ddp = DistributedDataParallel(model)
    gns = DDPNoiseScale(ddp, update_rate=payload["update_rate"])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=payload["lr"])
    k = payload["microbatches"]
    out = []
    for step in range(x.shape[0]):
        xs, ys = x[step, rank].chunk(k), y[step, rank].chunk(k)
        for i in range(k):
            # no_sync must cover the forward too: DDP decides at forward time
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                (per_example_loss(ddp, xs[i], ys[i]).mean() / k).backward()
        gns.observe_step(x.shape[2])
        result = gns.estimate  # waits for this step's small all-reduce
        out.append(
            {
                "grad_norm_sq": result.block_grad_norm_sq.tolist(),
                "trace_sigma": result.block_trace_sigma.tolist(),
                "b_simple": result.b_simple,
                "interval": result.interval,
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    # two synchronised backwards without observe_step in between are refused clearly
    for _ in range(2):
        per_example_loss(ddp, x[0, rank], y[0, rank]).mean().backward()
    try:
        gns.observe_step(x.shape[2])
    except RuntimeError as error:
        out.append({"double_sync_error": str(error)})
    return out
