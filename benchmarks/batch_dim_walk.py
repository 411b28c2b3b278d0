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

import torch

from benchmarks.hook_step_ab import STEPS_PER_BLOCK, parse, training_step
from grabkit.stats import engine


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
    mode, blocks, x, y = parse(argv if argv else ["sketch"], 30)
    walk = CountedWalk()
    engine.moved_batch_dim = walk
    step = training_step(True, mode, x, y)
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
