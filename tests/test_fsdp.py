"""Every capability under ``fully_shard`` (FSDP2) on 2 gloo CPU ranks, each result against a
one-process reference; ``FullyShardedDataParallel`` (FSDP1) refused at construction.

One spawn runs every capability (a module-scoped fixture): the noise scale under accumulation
(gradient sync off for all but the last microbatch), following the wrapper's windows, and per
example, adaptive accumulation (GNTS), per-example statistics and sketch-mode GraB.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tests.noise.helpers import digits, make_model, per_example_loss
from tests.noise.test_accumulation_distributed import one_process_reference
from tests.order import test_sketch_distributed as sketch
from tests.support.distributed import run_distributed
from torch import nn

from grabkit import OptimizerWrapperGNTS
from grabkit.noise import (
    AccumulationNoiseScale,
    DDPNoiseScale,
    GradientNoiseScaleEstimator,
    MicrobatchNoiseScale,
    PerExampleNoiseScale,
)
from grabkit.stats import PerSampleStats

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard

WORLD, STEPS, LOCAL, MICRO = 2, 3, 12, 3
GNTS = {"norm_threshold": 0.35, "max_batch_draws": 4}


def shard(model: nn.Module) -> nn.Module:
    """FSDP2: each Linear its own group, then the root."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)
    return model


def payload() -> dict:
    x, y = digits()
    index = torch.randint(
        x.shape[0], (STEPS, WORLD, LOCAL), generator=torch.Generator().manual_seed(9)
    )
    return {
        "x": x[index],
        "y": y[index],
        "seed": 4,
        "lr": 0.5,
        "update_rate": 0.5,
        "microbatches": MICRO,
    }


def _estimate(result) -> dict:
    return {
        "grad_norm_sq": result.block_grad_norm_sq.tolist(),
        "trace_sigma": result.block_trace_sigma.tolist(),
    }


def accumulation_noise(rank: int, data: dict) -> list[dict]:
    x, y = data["x"], data["y"]
    model = shard(make_model(data["seed"]))
    gns = AccumulationNoiseScale(model, update_rate=data["update_rate"])
    optimizer = torch.optim.SGD(model.parameters(), lr=data["lr"])
    out = []
    for step in range(STEPS):
        xs, ys = x[step, rank].chunk(MICRO), y[step, rank].chunk(MICRO)
        for i in range(MICRO):
            model.set_requires_gradient_sync(i == MICRO - 1)  # FSDP2's no_sync
            (per_example_loss(model, xs[i], ys[i]).mean() / MICRO).backward()
            gns.end_microbatch(len(xs[i]))
        out.append(_estimate(gns.end_step()))
        optimizer.step()
        optimizer.zero_grad()
    gns.remove()
    return out


def adaptive_accumulation(rank: int, data: dict) -> dict:
    """GNTS over microbatches of LOCAL / MICRO examples per rank."""
    x, y = data["x"].flatten(0, 1), data["y"].flatten(0, 1)  # (steps * world, local, ...)
    model = shard(make_model(data["seed"]))
    optimizer = OptimizerWrapperGNTS(torch.optim.SGD(model.parameters(), lr=data["lr"]), **GNTS)
    following = AccumulationNoiseScale(model, update_rate=1.0, optimizer=optimizer)
    per_example = PerExampleNoiseScale(update_rate=1.0)
    decisions = []
    for batch in range(0, x.shape[0], WORLD):
        xs, ys = x[batch + rank].chunk(MICRO), y[batch + rank].chunk(MICRO)
        for xm, ym in zip(xs, ys, strict=True):
            per_example_loss(model, xm, ym).mean().backward()
            decisions.append(optimizer.step(count=len(ym)))
    optimizer.flush()
    following.remove()
    params = [p.full_tensor().tolist() for p in model.parameters()]
    with PerSampleStats(model, loss_reduction="mean") as stats:
        per_example_loss(model, x[rank], y[rank]).mean().backward()
        norms = stats.norms_squared().tolist()
        per_example.observe_stats(stats)
    return {
        "decisions": decisions,
        "params": params,
        "norms": norms,
        "per_example": _estimate(per_example.estimate),
        "following": _estimate(following.estimate),
    }


def grab_orders(rank: int) -> list:
    model = shard(sketch.make_model())
    sampler = sketch.sampler_for(model, sketch.CONFIGS[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    orders = sketch.train(model, sampler, optimizer, sketch.LOCAL, False)[0]
    sampler.close()
    return orders


def refusals(rank: int) -> dict:
    """What is refused, with which message: FSDP1 everywhere, DDPNoiseScale and the ALF
    estimator on an FSDP2 model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from grabkit.order import GraBSampler

    messages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation warning
        fsdp1 = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
    attempts = {
        "fsdp1_accumulation": lambda: AccumulationNoiseScale(fsdp1),
        "fsdp1_wrapper": lambda: OptimizerWrapperGNTS(torch.optim.SGD(fsdp1.parameters(), lr=0.1)),
        "fsdp1_stats": lambda: PerSampleStats(fsdp1),
        "fsdp1_grab": lambda: GraBSampler(range(8), model=fsdp1, statistics="sketch"),
    }
    fsdp2 = shard(make_model())
    x, y = digits()
    attempts["fsdp2_ddp_noise"] = lambda: DDPNoiseScale(fsdp2)
    attempts["fsdp2_alf"] = lambda: GradientNoiseScaleEstimator()(
        per_example_loss(fsdp2, x[:8], y[:8]), list(fsdp2.parameters())
    )
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = ""
        except (NotImplementedError, TypeError, ValueError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def rank_body(rank: int, world_size: int, data: dict) -> dict:
    return {
        "accumulation_noise": accumulation_noise(rank, data),
        "adaptive": adaptive_accumulation(rank, data),
        "grab": grab_orders(rank),
        "refusals": refusals(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> tuple[dict, list[dict]]:
    root = str(Path(__file__).resolve().parents[1])  # spawned ranks import this module by name
    import sys

    if root not in sys.path:
        sys.path.insert(0, root)
    data = payload()
    return data, run_distributed(rank_body, WORLD, data, timeout=300)


def _assert_estimates(got: dict, want) -> None:
    assert got["grad_norm_sq"] == pytest.approx(want.block_grad_norm_sq.tolist(), rel=1e-9)
    assert got["trace_sigma"] == pytest.approx(want.block_trace_sigma.tolist(), rel=1e-9)


@pytest.mark.distributed
def test_accumulation_noise_scale_under_fully_shard_equals_one_process(ranks):
    data, per_rank = ranks
    reference = one_process_reference(data)
    for rank in per_rank:
        for got, want in zip(rank["accumulation_noise"], reference, strict=True):
            _assert_estimates(got, want)


def _one_process_adaptive(data: dict) -> dict:
    """The same GNTS run in one process on global microbatches (both ranks' parts), and the
    noise scale of its last window from the ranks' own microbatches (the two-batch identity
    with every rank's part a small batch and the window's mean the big one)."""
    x, y = data["x"].flatten(0, 1), data["y"].flatten(0, 1)
    model = make_model(data["seed"])
    params = list(model.parameters())
    optimizer = OptimizerWrapperGNTS(torch.optim.SGD(params, lr=data["lr"]), **GNTS)
    decisions, window, last = [], [], None

    def close_window() -> None:
        nonlocal window, last
        names = tuple(n for n, _ in model.named_parameters())
        reference = MicrobatchNoiseScale(update_rate=1.0, block_names=names)
        for grads, count in window:
            reference.observe_microbatch(torch.stack([(g * g).sum() for g in grads]), count)
        mean = [sum(g[i] for g, _ in window) / len(window) for i in range(len(params))]
        last, window = reference.observe_step(torch.stack([(m * m).sum() for m in mean])), []

    for batch in range(0, x.shape[0], WORLD):
        parts = [(x[batch + r].chunk(MICRO), y[batch + r].chunk(MICRO)) for r in range(WORLD)]
        for m in range(MICRO):
            for xs, ys in parts:  # each rank's own microbatch gradient
                loss = per_example_loss(model, xs[m], ys[m]).mean()
                window.append((torch.autograd.grad(loss, params), len(ys[m])))
            xm = torch.cat([xs[m] for xs, _ in parts])
            ym = torch.cat([ys[m] for _, ys in parts])
            per_example_loss(model, xm, ym).mean().backward()
            decisions.append(optimizer.step(count=len(ym)))
            if decisions[-1]:
                close_window()
    if optimizer.flush():
        close_window()
    return {"decisions": decisions, "model": model, "x": x, "y": y, "last_window": last}


@pytest.mark.distributed
def test_adaptive_accumulation_under_fully_shard_decides_and_updates_like_one_process(ranks):
    data, per_rank = ranks
    want = _one_process_adaptive(data)
    assert 0 < sum(want["decisions"]) < len(want["decisions"])  # some windows, not every step
    for rank in per_rank:
        assert rank["adaptive"]["decisions"] == want["decisions"]
        _assert_estimates(rank["adaptive"]["following"], want["last_window"])
        for got, p in zip(rank["adaptive"]["params"], want["model"].parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), p.detach())


@pytest.mark.distributed
def test_statistics_and_per_example_noise_under_fully_shard_equal_one_process(ranks):
    data, per_rank = ranks
    want = _one_process_adaptive(data)
    model, x, y = want["model"], want["x"], want["y"]
    estimates = []
    for r, rank in enumerate(per_rank):
        with PerSampleStats(model, loss_reduction="mean") as stats:
            per_example_loss(model, x[r], y[r]).mean().backward()
            norms = stats.norms_squared()
            step = stats.statistics()
            totals = step.total_norms_squared_by_parameter()
            mean_sq = sum(totals[n] for n in step.param_shapes) / len(x[r]) ** 2
            estimates.append(PerExampleNoiseScale.step_estimates(norms, mean_sq))
        model.zero_grad()
        torch.testing.assert_close(
            torch.tensor(rank["adaptive"]["norms"], dtype=torch.float64), norms
        )
    grad_norm = sum(e[0] for e in estimates) / WORLD
    trace = sum(e[1] for e in estimates) / WORLD
    for rank in per_rank:
        got = rank["adaptive"]["per_example"]
        assert got["grad_norm_sq"] == pytest.approx(grad_norm.tolist(), rel=1e-9)
        assert got["trace_sigma"] == pytest.approx(trace.tolist(), rel=1e-9)


@pytest.mark.distributed
def test_sketch_grab_under_fully_shard_orders_like_one_process(ranks):
    _, per_rank = ranks
    expected = sketch.single_process(sketch.CONFIGS[0], WORLD)
    for rank in per_rank:
        assert rank["grab"] == expected


@pytest.mark.distributed
def test_fsdp1_and_the_estimators_without_a_sharded_form_are_refused_with_the_fix(ranks):
    _, per_rank = ranks
    for rank in per_rank:
        messages = rank["refusals"]
        for name in ("fsdp1_accumulation", "fsdp1_wrapper", "fsdp1_stats", "fsdp1_grab"):
            assert messages[name].startswith("NotImplementedError"), name
            assert "fully_shard" in messages[name], name
        assert "AccumulationNoiseScale" in messages["fsdp2_ddp_noise"]
        assert "AccumulationNoiseScale" in messages["fsdp2_alf"]
