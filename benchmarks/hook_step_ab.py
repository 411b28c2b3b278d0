"""Hook-mode GraB step / plain step on the MNIST-shaped MLP, through the public API only, so the
same script times any revision of grabkit (its ``src`` on ``PYTHONPATH``).

The MLP 784-784-64-10 on random inputs (B = 64), SGD; a plain loop and a hook-mode
``GraBSampler(balance_type="pair")`` loop (exact, or sketched with k = 1024), alternated in
blocks of 8 steps, thread CPU time; prints the median and mean of the per-block ratios.

    PYTHONPATH=<checkout>/src python benchmarks/hook_step_ab.py exact 40
    PYTHONPATH=<checkout>/src python benchmarks/hook_step_ab.py sketch 40

Run it alternately on the two checkouts being compared (the machine's load moves both alike), or
time both in one process, blocks of the plain loop and of each checkout's hook-mode loop
interleaved (the same caches, the same moments of load: a far smaller spread between runs):

    PYTHONPATH=<checkout>/src python benchmarks/hook_step_ab.py sketch 60 --against=<other>/src

The other checkout's grabkit is imported first, its loop built and warmed up, and its modules
taken out of ``sys.modules`` (its objects keep working through their own references), before
this one's is imported.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

STEPS_PER_BLOCK, EXAMPLES, BATCH = 8, 64 * 40, 64


def training_step(hooked: bool, mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One SGD step of the MLP per call, drawing batches from rr or from a hook-mode sampler."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 784), nn.ReLU(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = None
    if hooked:
        from grabkit.order import GraBSampler  # the checkout being timed (see ``--against``)

        extra = {"statistics": "sketch", "sketch_dim": 1024} if mode == "sketch" else {}
        sampler = GraBSampler(
            range(EXAMPLES), model=model, balance_type="pair", batch_size=BATCH, **extra
        )
    order: list[int] = []

    def step() -> None:
        if not order:
            order.extend(iter(sampler) if sampler else torch.randperm(EXAMPLES).tolist())
        idx = order[:BATCH]
        del order[:BATCH]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if sampler is not None:
            sampler.step()
        opt.step()

    return step


def parse(argv: list[str], blocks: int) -> tuple[str, int, torch.Tensor, torch.Tensor]:
    """(mode, blocks, x, y) from ``[exact|sketch] [blocks]``: random MNIST-shaped inputs, one
    torch thread."""
    argv = [a for a in argv if not a.startswith("--against=")]
    mode = argv[0] if argv else "exact"
    blocks = int(argv[1]) if len(argv) > 1 else blocks
    if mode not in ("exact", "sketch"):
        raise ValueError(f"mode should be 'exact' or 'sketch', but got {mode!r}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 784, generator=gen)
    return mode, blocks, x, torch.randint(0, 10, (EXAMPLES,), generator=gen)


def other_checkout_step(
    src: str, mode: str, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    """The hook-mode step of the grabkit in ``src``, built and warmed up, its modules then taken
    out of ``sys.modules`` so that a later ``import grabkit`` finds this checkout's."""
    if any(name == "grabkit" or name.startswith("grabkit.") for name in sys.modules):
        raise ValueError("--against must load its grabkit before any other is imported")
    sys.path.insert(0, src)
    try:
        step = training_step(True, mode, x, y)
        for _ in range(20):
            step()  # every import the step makes happens now
    finally:
        sys.path.remove(src)
    for name in [n for n in sys.modules if n == "grabkit" or n.startswith("grabkit.")]:
        del sys.modules[name]
    return step


def in_one_process(argv: list[str], src: str) -> None:
    """Blocks of the plain step, the other checkout's and this one's, in a rotating order."""
    mode, blocks, x, y = parse(argv, 60)
    other = other_checkout_step(src, mode, x, y)
    plain, hook = training_step(False, mode, x, y), training_step(True, mode, x, y)
    for _ in range(20):
        plain()
        hook()
    contenders = [plain, other, hook]
    seconds: list[list[float]] = [[], [], []]
    for block in range(blocks):
        for k in range(3):
            which = (block + k) % 3
            start = time.thread_time()
            for _ in range(STEPS_PER_BLOCK):
                contenders[which]()
            seconds[which].append(time.thread_time() - start)
    this_over, other_over, between = (
        [h / p for h, p in zip(seconds[2], seconds[0], strict=True)],
        [o / p for o, p in zip(seconds[1], seconds[0], strict=True)],
        [h / o for h, o in zip(seconds[2], seconds[1], strict=True)],
    )
    print(
        f"{mode}: hook / plain median {statistics.median(this_over):.3f} (this checkout), "
        f"{statistics.median(other_over):.3f} ({src}); this / other median "
        f"{statistics.median(between):.3f}, mean {statistics.fmean(between):.3f} "
        f"({blocks} blocks of {STEPS_PER_BLOCK} steps each)"
    )


def main(argv: list[str]) -> None:
    against = [a.split("=", 1)[1] for a in argv if a.startswith("--against=")]
    if against:
        in_one_process(argv, against[0])
        return
    mode, blocks, x, y = parse(argv, 40)
    plain, hook = training_step(False, mode, x, y), training_step(True, mode, x, y)
    for _ in range(20):
        plain()
        hook()
    ratios = []
    for _ in range(blocks):
        start = time.thread_time()
        for _ in range(STEPS_PER_BLOCK):
            plain()
        plain_seconds = time.thread_time() - start
        start = time.thread_time()
        for _ in range(STEPS_PER_BLOCK):
            hook()
        ratios.append((time.thread_time() - start) / plain_seconds)
    print(
        f"{mode}: hook / plain median {statistics.median(ratios):.3f}, "
        f"mean {statistics.fmean(ratios):.3f} ({blocks} blocks of {STEPS_PER_BLOCK} steps)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
