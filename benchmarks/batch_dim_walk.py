"""What the engine's batch-dim walk costs: hook-mode GraB steps with the walk on and patched out,
alternated in one process, and the walk's own time per layer call.

Before a tracked layer records a call, the engine follows dim 0 of its input back through the
autograd graph to an earlier layer's output (``grabkit.stats.batch_dim.moved_batch_dim``), to
refuse a sequence-first copy or reordered rows. This times that check where it runs on every
step: the MNIST-shaped MLP 784-784-64-10 (B = 64, random inputs, SGD), hook-mode
``GraBSampler(balance_type="pair")``, exact or sketched (k = 1024), blocks of 8 steps alternating
the walk on and off, thread CPU time, 1 torch thread.

    python -m benchmarks.batch_dim_walk [exact|sketch] [blocks]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from grabkit.order import GraBSampler
from grabkit.stats import engine

STEPS_PER_BLOCK, EXAMPLES, BATCH = 8, 64 * 40, 64


def training_step(mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One SGD step of the MLP per call, its batches drawn from a hook-mode sampler."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 784), nn.ReLU(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    extra = {"statistics": "sketch", "sketch_dim": 1024} if mode == "sketch" else {}
    sampler = GraBSampler(
        range(EXAMPLES), model=model, balance_type="pair", batch_size=BATCH, **extra
    )
    order: list[int] = []

    def step() -> None:
        if not order:
            order.extend(iter(sampler))
        idx = order[:BATCH]
        del order[:BATCH]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        sampler.step()
        opt.step()

    return step


class CountedWalk:
    """``moved_batch_dim`` as the engine calls it, timed (``on``: wall time, finer-grained than
    the thread's CPU clock for calls of microseconds) or skipped (``off``)."""

    def __init__(self) -> None:
        self.walk = engine.moved_batch_dim
        self.on, self.calls, self.seconds = True, 0, 0.0

    def __call__(self, x: torch.Tensor, anchors: dict) -> object:
        if not self.on:
            return None
        start = time.perf_counter()
        moved = self.walk(x, anchors)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return moved


def main(argv: list[str]) -> None:
    mode = argv[0] if argv else "sketch"
    blocks = int(argv[1]) if len(argv) > 1 else 30
    if mode not in ("exact", "sketch"):
        raise ValueError(f"mode should be 'exact' or 'sketch', but got {mode!r}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 784, generator=gen)
    y = torch.randint(0, 10, (EXAMPLES,), generator=gen)
    walk = CountedWalk()
    engine.moved_batch_dim = walk
    step = training_step(mode, x, y)
    for _ in range(20):
        step()
    walk.calls, walk.seconds = 0, 0.0
    ratios = []
    for _ in range(blocks):
        seconds = {}
        for on in (True, False):
            walk.on = on
            start = time.thread_time()
            for _ in range(STEPS_PER_BLOCK):
                step()
            seconds[on] = time.thread_time() - start
        ratios.append(seconds[True] / seconds[False])
    per_step = walk.calls / (blocks * STEPS_PER_BLOCK)
    print(
        f"{mode}: step with the walk / without, median {statistics.median(ratios):.3f}, mean "
        f"{statistics.mean(ratios):.3f} ({blocks} blocks of {STEPS_PER_BLOCK} steps); the walk "
        f"{walk.seconds / walk.calls * 1e6:.1f} us per layer call, {per_step:.0f} calls a step"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
