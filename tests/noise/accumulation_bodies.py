"""Module-level bodies for the multi-process AccumulationNoiseScale tests (spawned processes
import them by name)."""

from __future__ import annotations

import contextlib

import torch
from tests.noise.helpers import make_model, per_example_loss
from torch.nn.parallel import DistributedDataParallel

from grabkit.noise import AccumulationNoiseScale


def _result(result) -> dict:
    return {
        "grad_norm_sq": result.block_grad_norm_sq.tolist(),
        "trace_sigma": result.block_trace_sigma.tolist(),
        "b_simple": result.b_simple,
    }


def ddp_no_sync_steps(rank: int, world_size: int, payload: dict) -> dict:
    """DDP SGD steps of K microbatches per rank, the first K - 1 under ``no_sync()``, measured
    by an ``AccumulationNoiseScale`` on the DDP model; then one step left unsynchronised."""
    x, y = payload["x"], payload["y"]  # (steps, world, local examples, ...)
    ddp = DistributedDataParallel(make_model(payload["seed"]))
    gns = AccumulationNoiseScale(ddp, update_rate=payload["update_rate"])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=payload["lr"])
    k = payload["microbatches"]
    out: dict = {"steps": []}
    for step in range(x.shape[0]):
        xs, ys = x[step, rank].chunk(k), y[step, rank].chunk(k)
        for i in range(k):
            # no_sync must cover the forward too: DDP decides at forward time
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                (per_example_loss(ddp, xs[i], ys[i]).mean() / k).backward()
            gns.end_microbatch(len(xs[i]))
        out["steps"].append(_result(gns.end_step()))
        optimizer.step()
        optimizer.zero_grad()
    # a step whose every backward ran under no_sync never synchronised: refused on every rank
    with ddp.no_sync():
        for i in range(2):
            per_example_loss(ddp, x[0, rank, i::2], y[0, rank, i::2]).mean().backward()
            gns.end_microbatch(x.shape[2] // 2)
    try:
        gns.end_step()
    except RuntimeError as error:
        out["unsynchronised"] = str(error)
    return out
