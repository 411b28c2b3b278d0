"""Sketched hook statistics: step cost, herding quality, training loss, bytes communicated.

* speed: hook-mode GraB with ``statistics="sketch"`` against a plain step, timed side by side
  (interleaved rounds, medians, wall and process CPU time) on bench_stats' workloads: the MLP
  784-784-64-10 on MNIST, B = 64, and its 2-block transformer LM on PTB, B = 32, T = 64. Exact
  hook-mode pair runs beside them for reference, and sketched pair (k = 1024) once more without
  the run-time identity check (``stats_options={"check_identity": False}``).
* quality: the herding bound of sketched pair and mean against exact ones on 2000 real MNIST
  softmax-regression per-example gradients (bench_order's), batches of 16, 8 epochs; every
  seed draws its own maps and first order (mean and spread over seeds). The sketches are
  ``GradientSketch.apply_dense`` of the gradients, which equals what hook mode computes (tested
  in ``tests/stats/test_sketch.py``).
* training: softmax regression on 4000 MNIST images in hook mode, SGD, B = 16, 5 epochs: the
  final training loss under rr, exact pair and sketched pair (mean and spread over seeds).
* communication: bytes per step that distributed GraB's collectives move, counted on real gloo
  ranks (2 and 4) by wrapping ``torch.distributed.all_gather``: sketched hook mode under DDP
  against the dense path (``step(per-example gradients)``) on the MLP (d = 666,330), B = 64.

* breakdown (``--parts=breakdown``, not in the default run): CPU medians of the parts of the
  sketched MLP pair step (engine factors, sketch read, balancing, publishing) inside the loop.

Usage: ``python benchmarks/run.py sketch [--quick] [--parts=speed,quality,train,comm]
[--workloads=mlp,lm] [--rounds=N] [--print-only]`` (1 torch thread; ``--quick``: few rounds, no
LM, small data, results not written; ``--print-only``: real data, results not written, e.g. for
an A/B of two checkouts run alternately).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_order import mnist_logistic_gradients
from benchmarks.bench_stats import Loop, build, make_mlp, per_example_loss, timed_side_by_side
from benchmarks.common import DATA, machine_description
from benchmarks.experiments import data as datasets
from grabkit.order import GraBSampler, herding_bound
from grabkit.stats.sketch import GradientSketch

HERE = Path(__file__).resolve().parent
MNIST = DATA / "mnist"
RESULTS = HERE / "results" / "sketch.md"
WARMUP_STEPS = 20
COMMAND = "python benchmarks/run.py sketch"


# -- speed ---------------------------------------------------------------------------------------
def speed(workload: str, rounds: int, quick: bool) -> list[str]:
    inner = 1 if workload == "lm" else 3
    fresh, (batches, n, source) = build(workload, synthetic=quick, rounds=(rounds + 2) * inner)
    contenders = {"plain": None, "exact pair": ("pair", None)}
    for k in (256, 1024):
        contenders[f"sketch pair, k={k}"] = ("pair", k)
    contenders["sketch mean, k=1024"] = ("mean", 1024)
    contenders["sketch pair, k=1024, check off"] = ("pair", 1024)
    loops = {}
    for label, spec in contenders.items():
        loop = Loop("plain", fresh(), n, batches)
        if spec is not None:
            balance, k = spec
            extra = {} if k is None else {"statistics": "sketch", "sketch_dim": k}
            if label.endswith("check off"):  # without the run-time identity check
                extra["stats_options"] = {"check_identity": False}
            loop.sampler = GraBSampler(range(n), model=loop.model, balance_type=balance, **extra)
            iter(loop.sampler)
        loops[label] = loop
    wall, cpu = timed_side_by_side({k: v.step for k, v in loops.items()}, rounds, inner)
    for loop in loops.values():
        if loop.sampler is not None:
            loop.sampler.close()
    params = sum(p.numel() for p in fresh().parameters())
    lines = [
        f"### {workload}: {params:,} parameters, data: {source}, {rounds} rounds x {inner} steps",
        "",
        "| contender | wall ms / step | x plain | CPU ms / step | x plain |",
        "|---|---:|---:|---:|---:|",
    ]
    for label in loops:
        lines.append(
            f"| {label} | {wall[label] * 1e3:.2f} | {wall[label] / wall['plain']:.2f} | "
            f"{cpu[label] * 1e3:.2f} | {cpu[label] / cpu['plain']:.2f} |"
        )
    return lines


def breakdown(steps: int, quick: bool) -> list[str]:
    """Where the sketched MLP step's time goes: CPU medians of its parts inside the training
    loop, each sketched step right after a plain model's step (caches as in ``speed``)."""
    fresh, (batches, n, source) = build("mlp", synthetic=quick, rounds=steps)
    plain, loop = Loop("plain", fresh(), n, batches), Loop("plain", fresh(), n, batches)
    loop.sampler = GraBSampler(range(n), model=loop.model, balance_type="pair", statistics="sketch")
    iter(loop.sampler)
    times: dict[str, list[float]] = {}

    def timed(label: str, fn):
        def run(*args, **kwargs):
            start = time.process_time()
            result = fn(*args, **kwargs)
            times.setdefault(label, []).append(time.process_time() - start)
            return result

        return run

    stats, sampler = loop.sampler.stats, loop.sampler
    parts = {
        "`sampler.step()` in all": (sampler, "step"),
        "- engine `step_factors()` (per-layer factors)": (stats.engine, "step_factors"),
        "- sketch of the factors (`GradientSketch.apply`)": (stats.sketch, "apply"),
        "- pair balancing of the (64, k) rows (`observe`)": (
            sampler.ordering,
            "observe",
        ),
        "- publishing the live state (`_publish`)": (sampler, "_publish"),
    }
    for label, (owner, name) in parts.items():
        setattr(owner, name, timed(label, getattr(owner, name)))
    plain_step, sketch_step = timed("plain step", plain.step), timed("sketched step", loop.step)
    for _ in range(steps):
        plain_step()
        sketch_step()
    lines = [
        f"MLP, {source}, k = 1024, pair: CPU ms, medians of {steps - WARMUP_STEPS} steps.",
        "",
        "| part | ms per step |",
        "|---|---:|",
    ]
    for label in ["plain step", "sketched step", *parts]:
        lines.append(f"| {label} | {statistics.median(times[label][WARMUP_STEPS:]) * 1e3:.3f} |")
    loop.sampler.close()
    return lines


# -- quality -------------------------------------------------------------------------------------
def sketched(G: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """The sketches hook mode computes for softmax regression (weight (10, 784), bias (10,))."""
    n = G.shape[0]
    full = G.reshape(n, 10, 785)
    flat = torch.cat([full[:, :, :784].reshape(n, -1), full[:, :, 784]], dim=1)
    shapes = {"weight": torch.Size([10, 784]), "bias": torch.Size([10])}
    return GradientSketch(shapes, k, seed).apply_dense(flat)


def bounds_for(G: torch.Tensor, vectors: torch.Tensor, balance: str, seed: int, epochs: int):
    sampler = GraBSampler(range(G.shape[0]), balance_type=balance, seed=seed)
    out = []
    for _ in range(epochs):
        order = torch.tensor(list(sampler))
        for start in range(0, order.numel(), 16):
            sampler.step(vectors[order[start : start + 16]])
        out.append(herding_bound(G, order))
    return out


def spread(values: list[float], digits: int = 2) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def quality(n: int, epochs: int, seeds: int) -> list[str]:
    G = mnist_logistic_gradients(MNIST, n=n, gd_steps=20)
    lines = [
        f"Herding bound (lower is better) on {n} MNIST softmax-regression per-example gradients "
        f"(d = {G.shape[1]}), batches of 16, epochs 2..{epochs} averaged per seed, then mean ± "
        f"standard deviation over {seeds} seeds (each seed: its own first order and maps). "
        "Ratio: the sketched bound over the exact one of the same ordering.",
        "",
        "| ordering | statistics | herding bound | / exact |",
        "|---|---|---:|---:|",
    ]
    for balance in ("rr", "pair", "mean"):
        variants: list[tuple[str, int | None]] = [("exact", None)]
        if balance != "rr":
            variants += [(f"sketch k={k}", k) for k in (256, 1024, 4096)]
        exact = None
        for label, k in variants:
            per_seed = []
            for seed in range(seeds):
                vectors = G.float() if k is None else sketched(G, k, seed).float()
                per_seed.append(statistics.mean(bounds_for(G, vectors, balance, seed, epochs)[1:]))
            mean = statistics.mean(per_seed)
            exact = mean if k is None else exact
            lines.append(f"| {balance} | {label} | {spread(per_seed)} | {mean / exact:.3f} |")
            print(lines[-1], flush=True)
    return lines


# -- training loss -------------------------------------------------------------------------------
def train_loss(x, y, config: dict, seed: int, epochs: int) -> float:
    torch.manual_seed(seed)
    model = torch.nn.Linear(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with GraBSampler(range(len(x)), model=model, seed=seed, batch_size=16, **config) as sampler:
        for _ in range(epochs):
            order = list(sampler)
            for start in range(0, len(order), 16):
                idx = torch.tensor(order[start : start + 16])
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                sampler.step()
                opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def training(n: int, epochs: int, seeds: int) -> list[str]:
    x, y, _, _ = datasets.mnist(n, 0)
    configs = {
        "rr": {"balance_type": "rr"},
        "pair, exact": {"balance_type": "pair"},
        "pair, sketch k=1024": {"balance_type": "pair", "statistics": "sketch"},
        "pair, sketch k=256": {"balance_type": "pair", "statistics": "sketch", "sketch_dim": 256},
    }
    lines = [
        f"Softmax regression on the first {n} MNIST training images, hook mode, SGD lr 0.05, "
        f"B = 16, {epochs} epochs: training loss after the last epoch, mean ± standard "
        f"deviation over {seeds} seeds (initialisation, first order and maps).",
        "",
        "| order | final training loss |",
        "|---|---:|",
    ]
    for label, config in configs.items():
        losses = [train_loss(x, y, config, seed, epochs) for seed in range(seeds)]
        lines.append(f"| {label} | {spread(losses, 4)} |")
        print(lines[-1], flush=True)
    return lines


# -- communication -------------------------------------------------------------------------------
def count_rank(rank: int, world_size: int, payload: dict) -> dict:
    """Bytes grabkit's all_gathers move per step on this rank (what it receives, its own part
    included), sketched hook mode under DDP vs the dense path."""
    import grabkit.order.distributed as collective

    counted = {"bytes": 0}
    original = collective.dist.all_gather

    def counting(outputs, tensor, *args, **kwargs):
        counted["bytes"] += sum(t.numel() * t.element_size() for t in outputs)
        return original(outputs, tensor, *args, **kwargs)

    collective.dist.all_gather = counting
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    batch, steps, n = payload["batch"], payload["steps"], payload["n"]
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    out = {}
    for mode in ("sketch", "dense"):
        if mode == "sketch":
            sampler = GraBSampler(range(n), model=model, statistics="sketch", balance_type="pair")
        else:
            params = dict(model.module.named_parameters())
            sampler = GraBSampler(range(n), params, balance_type="pair")
        order = list(sampler)  # the set-up agreement check runs here, before counting
        counted["bytes"] = 0
        for s in range(steps):
            idx = torch.tensor(order[s * batch : (s + 1) * batch])
            model.zero_grad()
            per_example_loss(model(x[idx]), y[idx]).mean().backward()
            if mode == "sketch":
                sampler.step()
            else:  # the dense path's message size does not depend on the values
                sampler.step(torch.randn(batch, sum(p.numel() for p in params.values())))
        out[mode] = counted["bytes"] / steps
        sampler.close()
    return out


def communication(world_sizes: list[int], batch: int) -> list[str]:
    sys.path.insert(0, str(HERE.parent))
    from tests.support.distributed import run_distributed

    d = sum(p.numel() for p in make_mlp().parameters())
    lines = [
        f"Bytes that grabkit's collectives move per step on one rank (received, its own part "
        f"included; the agreement check before the first epoch excluded), counted around "
        f"`torch.distributed.all_gather` on gloo ranks: MLP 784-784-64-10 (d = {d:,}) under "
        f"DDP, B = {batch} per rank, pair, float32. DDP's own gradient all-reduce is the same "
        "with or without GraB and not counted. Formula: W B k 4 + 24 W bytes (sketch), "
        "W B d 4 + 24 W (dense).",
        "",
        "| ranks W | sketch k=1024 (bytes / step) | dense (B, d) (bytes / step) | dense / sketch |",
        "|---:|---:|---:|---:|",
    ]
    for w in world_sizes:
        payload = {"batch": batch, "steps": 1, "n": w * batch}
        per_rank = run_distributed(count_rank, world_size=w, payload=payload, timeout=600)
        s, dn = per_rank[0]["sketch"], per_rank[0]["dense"]
        lines.append(f"| {w} | {s:,.0f} | {dn:,.0f} | {dn / s:,.0f}x |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_sketch", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="speed,quality,train,comm")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--workloads", default="mlp,lm")
    parser.add_argument("--print-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    flags = " ".join(a for a in argv if a.startswith("--"))
    out = [
        "# Sketched hook statistics",
        "",
        f"Machine: {machine_description()}; load average at start (1, 5, 15 min): {load}",
        "",
        f"Command: `{COMMAND}{' ' + flags if flags else ''}`",
    ]
    print("\n".join(out), flush=True)
    if "speed" in parts:
        out += ["", "## Step cost against a plain step", ""]
        for workload in ("mlp",) if args.quick else args.workloads.split(","):
            rounds = args.rounds or (3 if args.quick else (20 if workload == "mlp" else 6))
            out += [*speed(workload, rounds, args.quick), ""]
            print("\n".join(out[-8:]), flush=True)
    if "breakdown" in parts:
        out += ["", "## Where the sketched MLP step's time goes", ""]
        out += breakdown(
            args.rounds * 10 if args.rounds else (60 if args.quick else 600), args.quick
        )
        print("\n".join(out[-12:]), flush=True)
    has_mnist = MNIST.is_dir()
    if "quality" in parts:
        out += ["", "## Herding quality: sketched against exact", ""]
        if has_mnist:
            out += quality(*((300, 3, 2) if args.quick else (2000, 8, 5)))
        else:
            out.append(f"skipped: MNIST not found at {MNIST}")
    if "train" in parts:
        out += ["", "## Training loss", ""]
        if has_mnist:
            out += training(*((800, 2, 2) if args.quick else (4000, 5, 3)))
        else:
            out.append(f"skipped: MNIST not found at {MNIST}")
    if "comm" in parts:
        out += ["", "## Communication per step", ""]
        out += communication([2] if args.quick else [2, 4], batch=64)
    text = "\n".join(out) + "\n"
    if args.quick or args.print_only:
        print(text)
    else:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
        print(f"\nwritten to {RESULTS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main(sys.argv[1:])
