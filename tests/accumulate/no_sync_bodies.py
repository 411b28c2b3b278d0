"""Bodies run on every rank by tests/accumulate/test_no_sync.py (module level, picklable):
adaptive wrappers stepped after every microbatch of a DDP model whose backwards run under
``no_sync()`` (by hand, or through accelerate's ``accumulate()``)."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from tests.accumulate.distributed_bodies import KINDS, build
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss
from torch import nn

SYNC_EVERY = 3  # the microbatches of one "round": the first two under no_sync()


def _step(wrapper, kind: str, loss: torch.Tensor, count: int) -> bool:
    if kind == "mht":
        return wrapper.step(loss.detach(), count=count)
    return wrapper.step(count=count)


def _params(model: nn.Module) -> list[list[float]]:
    # plain lists: tensors would travel through shared memory that dies with the rank
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def ddp_no_sync_run(rank: int, world_size: int, payload: dict) -> dict:
    """Every wrapper kind on a DDP model, each rank holding its half of every microbatch and
    running two of every three backwards under ``no_sync()``."""
    out: dict = {}
    for kind in KINDS:
        model = make_model(0)
        ddp = nn.parallel.DistributedDataParallel(model)
        wrapper = build(kind, ddp.parameters())
        decisions = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(make_microbatches(payload["sizes"], seed=11)):
                xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
                local = i % SYNC_EVERY < SYNC_EVERY - 1
                with ddp.no_sync() if local else contextlib.nullcontext():
                    loss = mean_loss(ddp, xs, ys)
                    loss.backward()
                decisions.append(_step(wrapper, kind, loss, len(xs)))
            wrapper.flush()
        messages = [str(w.message) for w in caught if "not all-reduced" in str(w.message)]
        out[kind] = {"decisions": decisions, "params": _params(model), "warned": len(messages)}
    return out


def scaled_unsynced_run(rank: int, world_size: int, payload: dict) -> dict:
    """GNTS on a DDP model whose every backward runs under ``no_sync()``, through a GradScaler
    whose scale differs by rank (and changes): each rank's gradient is unscaled by its own scale
    before the wrapper averages the ranks."""
    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = build("gnts", ddp.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (4 + 3 * rank), growth_interval=1)
    decisions = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for x, y in make_microbatches(payload["sizes"], seed=11):
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            with ddp.no_sync():
                scaler.scale(mean_loss(ddp, xs, ys)).backward()
            decisions.append(bool(scaler.step(wrapper, count=len(xs))))
            scaler.update()
        wrapper.flush()
    return {"decisions": decisions, "params": _params(model)}


def observed_run(rank: int, world_size: int, payload: dict, local: bool) -> list[float]:
    """GNS followed by ``AccumulationNoiseScale(optimizer=wrapper)``, with two of every three
    backwards under ``no_sync()`` (``local``) or none: the estimate must not tell them apart."""
    from grabkit.noise import AccumulationNoiseScale

    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper = build("gns", ddp.parameters(), noise_multiplier=0.3)
    gns = AccumulationNoiseScale(ddp, update_rate=0.5, optimizer=wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, (x, y) in enumerate(make_microbatches(payload["sizes"], seed=11)):
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            unsynced = local and i % SYNC_EVERY < SYNC_EVERY - 1
            with ddp.no_sync() if unsynced else contextlib.nullcontext():
                mean_loss(ddp, xs, ys).backward()
            wrapper.step(count=len(xs))
        wrapper.flush()
    estimate = gns.estimate
    gns.remove()
    return [estimate.grad_norm_sq, estimate.trace_sigma, estimate.observations]


def fully_shard_no_sync_run(rank: int, world_size: int, payload: dict) -> str:
    """GNTS on a ``fully_shard`` model whose first backward runs with gradient sync off: FSDP2
    keeps that gradient unsharded and .grad empty; the wrapper must refuse, on every rank."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)
    wrapper = build("gnts", model.parameters())
    x, y = make_microbatches(payload["sizes"], seed=11)[0]
    model.set_requires_gradient_sync(False)
    mean_loss(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
    try:
        wrapper.step(count=len(x) // world_size)
    except ValueError as error:
        return str(error)
    return f"stepped: {wrapper.last_reason}"


def accelerate_run(rank: int, world_size: int, payload: dict) -> dict:
    """GNS on a model prepared by accelerate (DDP on CPU), microbatches in its
    ``accumulate()`` (no_sync on all but every third), the wrapper stepped after each."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=SYNC_EVERY)
    model = make_model(0)
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, nn.parallel.DistributedDataParallel)
    wrapper = build("gns", prepared.parameters(), noise_multiplier=0.3)
    decisions = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for x, y in make_microbatches(payload["sizes"], seed=11):
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            with accelerator.accumulate(prepared):
                accelerator.backward(mean_loss(prepared, xs, ys))  # divides by SYNC_EVERY
                decisions.append(wrapper.step(count=len(xs)))
        wrapper.flush()
    return {"decisions": decisions, "params": _params(model)}


def body(rank: int, world_size: int, payload: dict) -> dict:
    torch.manual_seed(0)
    result = {"ddp": ddp_no_sync_run(rank, world_size, payload)}
    result["scaled"] = scaled_unsynced_run(rank, world_size, payload)
    result["fully_shard"] = fully_shard_no_sync_run(rank, world_size, payload)
    result["observed"] = [observed_run(rank, world_size, payload, local) for local in (False, True)]
    if payload.get("accelerate"):
        result["accelerate"] = accelerate_run(rank, world_size, payload)
    return result
