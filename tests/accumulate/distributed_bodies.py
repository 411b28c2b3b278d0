"""Bodies run on every rank by tests/accumulate/test_distributed.py (module level, picklable)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss
from torch import nn

from grabkit.accumulate import (
    AdaptiveAccumulationWrapper,
    NormTest,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
)

KINDS = ("gnts", "gns", "mht", "norm_test", "sbc")


def build(kind: str, params, **options):
    inner = torch.optim.SGD(params, lr=0.05)
    if kind == "gnts":
        return OptimizerWrapperGNTS(inner, max_batch_draws=6, norm_threshold=1.0, **options)
    if kind == "gns":
        return OptimizerWrapperGNS(inner, max_batch_draws=6, **options)
    if kind == "mht":
        return OptimizerWrapperMHT(inner, 0.8, 0.1, max_batch_draws=6, **options)
    if kind == "norm_test":
        return AdaptiveAccumulationWrapper(inner, NormTest(0.8), max_batch_draws=6, **options)
    return OptimizerWrapperSBC(inner, 4, 12, max_batch_draws=6, **options)


def adversarial_decisions(rank: int) -> dict[str, list[bool]]:
    """No DDP: every rank sees its own, differently scaled data and counts; decisions must agree."""
    out = {}
    for kind in KINDS:
        model = make_model(0)
        wrapper = build(kind, model.parameters())
        scale = 1.0 + 10.0 * rank
        decisions = []
        sizes = [2 + (i + rank) % 3 for i in range(14)]
        for x, y in make_microbatches(sizes, seed=7 + rank):
            loss = mean_loss(model, x * scale, y * scale)
            loss.backward()
            count = len(x) * (rank + 1)
            if kind == "mht":
                decisions.append(wrapper.step(loss, count=count))
            else:
                decisions.append(wrapper.step(count=count))
        out[kind] = decisions
    return out


def ddp_run(rank: int, world_size: int, sizes: list[int]) -> dict:
    """GNS under DDP, each rank holding its slice of every microbatch."""
    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = build("gns", ddp.parameters(), noise_multiplier=0.3)
    decisions = []
    for x, y in make_microbatches(sizes, seed=11):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        mean_loss(ddp, xs, ys).backward()
        decisions.append(wrapper.step(count=len(xs)))
    # plain lists: tensors would travel through shared memory that dies with the rank
    return {"decisions": decisions, "params": [p.detach().tolist() for p in model.parameters()]}


def sharded_run(rank: int, world_size: int, full_grads: list[torch.Tensor]) -> dict:
    """Each rank owns a disjoint shard of one flat parameter; GNTS steps at max_batch_draws and
    reports the norm of the mean, which must be the norm of the whole (unsharded) gradient."""
    shard = full_grads[0].chunk(world_size)[rank]
    weight = nn.Parameter(torch.zeros_like(shard))
    inner = torch.optim.SGD([weight], lr=0.05)
    wrapper = OptimizerWrapperGNTS(
        inner, max_batch_draws=len(full_grads), norm_threshold=0.0, gradient_layout="sharded"
    )
    for g in full_grads:
        weight.grad = g.chunk(world_size)[rank].clone()
        wrapper.step()
    return {"norm": wrapper.statistics()["last_mean_grad_norm"]}


def disagreement_run(rank: int) -> list[str]:
    """Rank 1 alone has a NaN loss, then no backward, then a zero tensor count: every rank must
    drop, raise or fold alike (never hang in a collective, never diverge)."""
    import warnings

    model = make_model(0)
    wrapper = build("gnts", model.parameters())
    events = []
    for i, (x, y) in enumerate(make_microbatches([3] * 8, seed=3)):
        loss = mean_loss(model, x, y)
        if rank == 1 and i == 2:
            loss = loss * float("nan")
        if not (rank == 1 and i == 4):
            loss.backward()
        count = torch.tensor(0.0 if (rank == 1 and i == 6) else 3.0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                wrapper.step(count=count)
            events.append(wrapper.last_reason)
        except (RuntimeError, ValueError) as error:
            events.append(type(error).__name__)
            wrapper.zero_grad()
    events.append(str(all(bool(torch.isfinite(p).all()) for p in model.parameters())))
    return events


def unequal_counts_warnings(rank: int, world_size: int) -> list[bool]:
    """Under DDP: equal counts, then a microbatch whose counts differ by rank, then equal again.
    Whether each step warned that DDP's equal-weight average may misweight the window."""
    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = build("gns", ddp.parameters(), noise_multiplier=0.3)
    warned = []
    for i, (x, y) in enumerate(make_microbatches([4, 4, 4, 4], seed=5)):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        mean_loss(ddp, xs, ys).backward()
        count = len(xs) + (rank if i == 1 else 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapper.step(count=count)
        warned.append(any("counted different weights" in str(w.message) for w in caught))
    return warned


def unequal_counts_refusal(rank: int, world_size: int, payload: list[int]) -> dict:
    """Under DDP with ``unequal_counts="raise"``, a wrapper that steps every 2 microbatches;
    microbatch 1's counts differ by rank (it would close the first window). What each step did,
    the refusal's message, and whether the refused step changed the parameters or counters."""
    from grabkit.accumulate import NormThreshold

    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05)
    wrapper = AdaptiveAccumulationWrapper(
        inner, NormThreshold(0.0), max_batch_draws=2, unequal_counts="raise"
    )
    out: dict = {"stepped": [], "message": None}
    for i, (x, y) in enumerate(make_microbatches(payload, seed=5)):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        mean_loss(ddp, xs, ys).backward()
        if i != 1:
            out["stepped"].append(wrapper.step(count=len(xs)))
            continue
        before = [p.detach().clone() for p in model.parameters()]
        counters = wrapper.counters.state_dict()
        try:
            wrapper.step(count=len(xs) + rank)
        except ValueError as error:
            out["message"] = str(error)
        out["unchanged"] = (
            all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
            and wrapper.counters.state_dict() == counters
        )
        wrapper.zero_grad()  # the refused microbatch's gradient: discarded
    out["params"] = [p.detach().tolist() for p in model.parameters()]
    return out


def body(rank: int, world_size: int, payload: dict) -> dict:
    torch.manual_seed(0)
    result = {"adversarial": adversarial_decisions(rank), "disagreement": disagreement_run(rank)}
    result["sharded"] = sharded_run(rank, world_size, payload["sharded_grads"])
    if payload.get("ddp_sizes"):
        result["ddp"] = ddp_run(rank, world_size, payload["ddp_sizes"])
        result["unequal_counts"] = unequal_counts_warnings(rank, world_size)
    dist.barrier()
    return result


def device_send_sites(rank: int, world_size: int, payload: None) -> list[str]:
    """Under DDP through a GradScaler, every other backward under ``no_sync()`` (the wrapper
    averages those over the ranks), tensor counts: where the wrapper sent host values to the
    device outside ``grabkit.stats.transfer`` (tests/support/device_sends.py)."""
    import contextlib

    import pytest
    from tests.support.device_sends import DeviceSends

    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = build("gnts", ddp.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (4 + rank))
    sites: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no_sync() saves nothing: said once
        for i, (x, y) in enumerate(make_microbatches([4, 6, 2, 8, 4, 6], seed=11)):
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            with ddp.no_sync() if i % 2 else contextlib.nullcontext():
                scaler.scale(mean_loss(ddp, xs, ys)).backward()
            with pytest.MonkeyPatch.context() as patch:
                sends = DeviceSends(patch)
                scaler.step(wrapper, count=torch.tensor(len(xs)))
            sites += sends.sites
            scaler.update()
    return sites
