"""Gradient noise scale estimators: time per training step relative to plain training, and accuracy.

Contenders, each against the plain step it rides on (timed side by side, interleaved):

* ALF-style ``GradientNoiseScaleEstimator`` (two extra backward passes) vs a plain step;
* ``AccumulationNoiseScale`` (gradient hooks) vs plain accumulation of K microbatches, with
  microbatches of 32 and of 128 examples (the overhead is per gradient pass, so its share
  falls as each microbatch costs more);
* ``PerExampleNoiseScale`` fed by ``grabkit.stats.PerSampleStats`` vs a plain step;
* ``DDPNoiseScale`` (communication hook) vs plain DDP, 2 gloo processes on this machine.

Accuracy: each estimator runs a fixed number of steps at fixed parameters on batches drawn with
replacement from the digits data; its B_simple is compared with the exact value from torch.func
per-example gradients over the whole data set (float64).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import machine_description, time_side_by_side
from grabkit.noise import (
    AccumulationNoiseScale,
    DDPNoiseScale,
    GradientNoiseScaleEstimator,
    PerExampleNoiseScale,
)

BATCH, MICROBATCHES, HIDDEN, UPDATE_RATE = 128, 4, 1024, 0.02
LARGE_MICROBATCH = 128  # a second accumulation row: same model, 4x the work per microbatch


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 10),
    )


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.as_tensor(x / 16.0, dtype=torch.float32), torch.as_tensor(y)


def losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def exact_b_simple(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 64) -> float:
    """tr(Sigma) / |G|^2 over the whole data set, from float64 per-example gradients.

    tr(Sigma) = mean_i |g_i|^2 - |G|^2; gradients are made ``chunk`` examples at a time.
    """
    model64 = make_model().double()
    model64.load_state_dict(model.state_dict())
    params = {k: v.detach() for k, v in model64.named_parameters()}

    def loss_one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model64, p, (xi[None],)), yi[None])

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    total, sum_sq = None, 0.0
    for start in range(0, x.shape[0], chunk):
        g = per_example(params, x[start : start + chunk].double(), y[start : start + chunk])
        flat = torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], dim=1)
        sum_sq += float(flat.pow(2).sum())
        total = flat.sum(0) if total is None else total + flat.sum(0)
    mean_sq = float((total / x.shape[0]).pow(2).sum())
    return (sum_sq / x.shape[0] - mean_sq) / mean_sq


class Batches:
    """Batches of ``size`` examples drawn with replacement, from a fixed seed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int, size: int = BATCH) -> None:
        self.x, self.y, self.size = x, y, size
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(self.x.shape[0], (self.size,), generator=self.gen)
        return self.x[i], self.y[i]


def single_process_steps(x, y):
    """{name: (train_step, measure_step, estimate)}: a step that trains, one at fixed params."""
    from grabkit.stats import PerSampleStats

    contenders = {}

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = Batches(x, y, 1)

    def plain():
        xb, yb = batches()
        opt.zero_grad()
        losses(model, xb, yb).mean().backward()
        opt.step()

    contenders["plain step"] = plain

    twin = make_model()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    twin_batches = Batches(x, y, 1)

    def plain_again():  # an identical second plain step: the timing noise floor (A/A)
        xb, yb = twin_batches()
        twin_opt.zero_grad()
        losses(twin, xb, yb).mean().backward()
        twin_opt.step()

    contenders["plain step (A/A copy)"] = plain_again

    alf_model = make_model()
    alf_opt = torch.optim.SGD(alf_model.parameters(), lr=0.01)
    alf = GradientNoiseScaleEstimator(update_rate=UPDATE_RATE)
    alf_batches = Batches(x, y, 1)

    def alf_step():
        xb, yb = alf_batches()
        alf_opt.zero_grad()
        loss = losses(alf_model, xb, yb)
        alf(loss, alf_model.parameters())
        loss.mean().backward()
        alf_opt.step()

    contenders["ALF-style estimator"] = alf_step

    def accumulation_step(m, o, b, gns):
        xb, yb = b()
        o.zero_grad()
        for xs, ys in zip(xb.chunk(MICROBATCHES), yb.chunk(MICROBATCHES), strict=True):
            (losses(m, xs, ys).mean() / MICROBATCHES).backward()
            if gns is not None:
                gns.end_microbatch(len(xs))
        if gns is not None:
            gns.end_step()
        o.step()

    def accumulation_pair(label: str, step_size: int) -> None:
        """Plain accumulation and the same loop with the estimator, ``step_size`` per step."""
        for measured in (False, True):
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            batches = Batches(x, y, 1, step_size)
            gns = AccumulationNoiseScale(model, update_rate=UPDATE_RATE) if measured else None
            name = "AccumulationNoiseScale" if measured else "plain accumulation"
            contenders[f"{name} ({label})"] = lambda m=model, o=opt, b=batches, g=gns: (
                accumulation_step(m, o, b, g)
            )

    accumulation_pair(f"K={MICROBATCHES}", BATCH)
    accumulation_pair(f"K={MICROBATCHES} x {LARGE_MICROBATCH}", MICROBATCHES * LARGE_MICROBATCH)

    pe_model = make_model()
    pe_opt = torch.optim.SGD(pe_model.parameters(), lr=0.01)
    pe_batches = Batches(x, y, 1)
    stats = PerSampleStats(pe_model)
    per_example = PerExampleNoiseScale.for_stats(stats, update_rate=UPDATE_RATE)

    def per_example_step():
        xb, yb = pe_batches()
        pe_opt.zero_grad()
        losses(pe_model, xb, yb).mean().backward()
        per_example.observe_stats(stats)
        pe_opt.step()

    contenders["PerExampleNoiseScale (PerSampleStats)"] = per_example_step
    return contenders


def accuracy_single_process(x, y, steps: int) -> dict[str, float]:
    """B_simple of each estimator after ``steps`` steps at the initial parameters.

    Each estimator gets its own model: the hook-based ones would also see the ALF estimator's
    extra backward passes through shared parameters.
    """
    from grabkit.stats import PerSampleStats

    out = {}
    model = make_model()
    alf = GradientNoiseScaleEstimator(update_rate=UPDATE_RATE)
    batches = Batches(x, y, 2)
    for _ in range(steps):
        xb, yb = batches()
        alf(losses(model, xb, yb), model.parameters())
    out["ALF-style estimator"] = alf.result().b_simple

    model = make_model()
    batches = Batches(x, y, 2)
    with AccumulationNoiseScale(model, update_rate=UPDATE_RATE) as gns:
        for _ in range(steps):
            xb, yb = batches()
            model.zero_grad()
            for xs, ys in zip(xb.chunk(MICROBATCHES), yb.chunk(MICROBATCHES), strict=True):
                (losses(model, xs, ys).mean() / MICROBATCHES).backward()
                gns.end_microbatch(len(xs))
            gns.end_step()
    out[f"AccumulationNoiseScale (K={MICROBATCHES})"] = gns.estimate.b_simple

    model = make_model()
    batches = Batches(x, y, 2)
    with PerSampleStats(model) as stats:
        per_example = PerExampleNoiseScale(update_rate=UPDATE_RATE)
        for _ in range(steps):
            xb, yb = batches()
            model.zero_grad()
            losses(model, xb, yb).mean().backward()
            per_example.observe_stats(stats)
    out["PerExampleNoiseScale (PerSampleStats)"] = per_example.estimate.b_simple
    return out


def _ddp_rank(rank: int, world: int, port: int, args: dict, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, y = digits()
        local = BATCH // world
        plain = DistributedDataParallel(make_model())
        hooked = DistributedDataParallel(make_model())
        gns = DDPNoiseScale(hooked, update_rate=UPDATE_RATE)
        opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, hooked)}
        gen = torch.Generator().manual_seed(10 + rank)

        def step(m, measure):
            i = torch.randint(x.shape[0], (local,), generator=gen)
            opts[m].zero_grad()
            losses(m, x[i], y[i]).mean().backward()
            if measure:
                gns.observe_step(local)
            opts[m].step()

        times = time_side_by_side(
            {"plain DDP": lambda: step(plain, False), "DDPNoiseScale": lambda: step(hooked, True)},
            rounds=args["rounds"],
            warmup=3,
            inner=args["inner"],
        )
        # accuracy at fixed parameters: a fresh model and estimator, no optimizer step
        fixed = DistributedDataParallel(make_model())
        measure = DDPNoiseScale(fixed, update_rate=UPDATE_RATE)
        for _ in range(args["steps"]):
            i = torch.randint(x.shape[0], (local,), generator=gen)
            fixed.zero_grad()
            losses(fixed, x[i], y[i]).mean().backward()
            measure.observe_step(local)
        queue.put((rank, times, measure.estimate.b_simple))
    finally:
        dist.destroy_process_group()


def ddp_measurements(rounds: int, inner: int, steps: int) -> tuple[dict[str, float], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {"rounds": rounds, "inner": inner, "steps": steps}
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (t, b)) for r, t, b in (queue.get(timeout=600) for _ in procs))
    for p in procs:
        p.join()
    return results[0]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_noise")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    args = parser.parse_args(argv)
    rounds, inner, steps = (4, 2, 30) if args.quick else (30, 5, 300)
    torch.set_num_threads(1)  # one thread per process: stable timings on a shared machine
    x, y = digits()
    truth = exact_b_simple(make_model(), x, y)

    times = time_side_by_side(single_process_steps(x, y), rounds=rounds, warmup=3, inner=inner)
    ddp_times, ddp_b = ddp_measurements(rounds, inner, steps)
    estimates = accuracy_single_process(x, y, steps)
    estimates["DDPNoiseScale (2 gloo ranks)"] = ddp_b

    acc = f"plain accumulation (K={MICROBATCHES})"
    large = f"K={MICROBATCHES} x {LARGE_MICROBATCH}"
    rows = [
        ("plain step (A/A copy)", "plain step", times),
        ("ALF-style estimator", "plain step", times),
        (f"AccumulationNoiseScale (K={MICROBATCHES})", acc, times),
        (f"AccumulationNoiseScale ({large})", f"plain accumulation ({large})", times),
        ("PerExampleNoiseScale (PerSampleStats)", "plain step", times),
        (
            "DDPNoiseScale (2 gloo ranks)",
            "plain DDP",
            {**ddp_times, "DDPNoiseScale (2 gloo ranks)": ddp_times["DDPNoiseScale"]},
        ),
    ]
    print(f"Machine: {machine_description()}")
    print(
        f"MLP 64-{HIDDEN}-{HIDDEN}-10 on digits, batch {BATCH}, update_rate {UPDATE_RATE}; "
        f"accuracy after {steps} steps at fixed parameters, exact B_simple = {truth:.2f}\n"
    )
    print("| estimator | baseline | ms/step | baseline ms/step | ratio | B_simple | rel. error |")
    print("|---|---|---|---|---|---|---|")
    for name, base, table in rows:
        ratio = table[name] / table[base]
        b = estimates.get(name)
        accuracy = "-" if b is None else f"{b:.2f} | {abs(b - truth) / truth:.1%}"
        print(
            f"| {name} | {base} | {1e3 * table[name]:.2f} | {1e3 * table[base]:.2f} | "
            f"{ratio:.3f}x | {accuracy if b is not None else '- | -'} |"
        )
