"""Module-level bodies for the multi-process DDPNoiseScale tests (spawned processes import them)."""

from __future__ import annotations

import contextlib
import io

import torch
from tests.noise.helpers import make_model, per_example_loss
from torch.nn.parallel import DistributedDataParallel

from grabkit.noise import DDPNoiseScale, GradientNoiseScaleEstimator


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


def _alf_steps(model, estimator, optimizer, x, y, steps: range, rank: int) -> list[float]:
    """DDP SGD steps, each measured by ALF's estimator on this rank's batch; the GNS per step."""
    out = []
    for step in steps:
        loss = per_example_loss(model, x[step, rank], y[step, rank])
        out.append(float(estimator(loss, list(model.parameters()))))
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return out


def _alf_run(
    payload: dict,
) -> tuple[DistributedDataParallel, GradientNoiseScaleEstimator, torch.optim.SGD]:
    model = DistributedDataParallel(make_model(payload["seed"]))
    estimator = GradientNoiseScaleEstimator(update_rate=payload["update_rate"])
    return model, estimator, torch.optim.SGD(model.parameters(), lr=payload["lr"])


def alf_resume_per_rank(rank: int, world_size: int, payload: dict) -> dict:
    """ALF's estimator on each rank: the uninterrupted run, then a run cut after ``cut`` steps
    and continued by fresh objects from this rank's own saved state (and RNG: the random splits),
    after trying rank 0's estimator state, as a checkpoint only rank 0 writes would hold it."""
    x, y, cut, steps = payload["x"], payload["y"], payload["cut"], payload["x"].shape[0]
    model, estimator, optimizer = _alf_run(payload)
    torch.manual_seed(10 + rank)  # after make_model's seed: each rank its own random splits
    whole = _alf_steps(model, estimator, optimizer, x, y, range(steps), rank)
    whole_result = estimator.result()

    model, estimator, optimizer = _alf_run(payload)
    torch.manual_seed(10 + rank)  # after make_model's seed: each rank its own random splits
    first = _alf_steps(model, estimator, optimizer, x, y, range(cut), rank)
    saved = _through_bytes(
        {
            "model": model.module.state_dict(),
            "gns": estimator.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )
    rank0 = [saved["gns"]]
    torch.distributed.broadcast_object_list(rank0, src=0)
    model, estimator, optimizer = _alf_run(payload)
    model.module.load_state_dict(saved["model"])
    refused = None
    try:
        estimator.load_state_dict(rank0[0])
    except ValueError as error:
        refused = str(error)
    estimator = GradientNoiseScaleEstimator(update_rate=payload["update_rate"])
    estimator.load_state_dict(saved["gns"])
    torch.set_rng_state(saved["rng"])
    rest = _alf_steps(model, estimator, optimizer, x, y, range(cut, steps), rank)
    result = estimator.result()
    return {
        "whole": whole,
        "resumed": first + rest,
        "same_result": whole_result.b_simple == result.b_simple
        and torch.equal(whole_result.block_trace_sigma, result.block_trace_sigma),
        "refused": refused,
    }


def _through_bytes(state: dict) -> dict:
    """``state`` saved and loaded as a checkpoint file would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
