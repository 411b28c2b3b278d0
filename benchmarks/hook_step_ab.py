"""Hook-mode GraB step / plain step on the MNIST-shaped MLP or LeNet-5, through the public API
only, so the same script times any revision of grabkit (its ``src`` on ``PYTHONPATH``).

The MLP 784-784-64-10 on random inputs (B = 64), or with ``--model=lenet`` LeNet-5 on the
CIFAR-10 lossless subset (random images where ``../shared/data`` is absent; B = 16), SGD; a plain
loop and a hook-mode ``GraBSampler(balance_type="pair")`` loop (exact, or sketched with
k = 1024), alternated in blocks of 8 steps, thread CPU time; prints the median and mean of the
per-block ratios.

    PYTHONPATH=<checkout>/src python benchmarks/hook_step_ab.py exact 40
    PYTHONPATH=<checkout>/src python benchmarks/hook_step_ab.py sketch 40 --model=lenet

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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: this ``benchmarks`` package for LeNet and data,
    sys.path.insert(0, str(ROOT))  # ahead of site-packages (opacus installs one of that name)

STEPS_PER_BLOCK = 8
BATCH = {"mlp": 64, "lenet": 16}


def build_model(name: str) -> nn.Module:
    if name == "lenet":
        from benchmarks.experiments.models import LeNet

        return LeNet()
    return nn.Sequential(
        nn.Linear(784, 784), nn.ReLU(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def model_name(x: torch.Tensor) -> str:
    """The model the inputs are for: LeNet takes images, the MLP flat vectors."""
    return "lenet" if x.dim() == 4 else "mlp"


def training_step(hooked: bool, mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One SGD step of the model the inputs are for (MLP: (n, 784), LeNet: (n, 3, 32, 32)) per
    call, drawing batches from rr or from a hook-mode sampler."""
    name = model_name(x)
    examples, batch = x.shape[0], BATCH[name]
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = None
    if hooked:
        from grabkit.order import GraBSampler  # the checkout being timed (see ``--against``)

        extra = {"statistics": "sketch", "sketch_dim": 1024} if mode == "sketch" else {}
        sampler = GraBSampler(
            range(examples), model=model, balance_type="pair", batch_size=batch, **extra
        )
    order: list[int] = []

    def step() -> None:
        if not order:
            order.extend(iter(sampler) if sampler else torch.randperm(examples).tolist())
        idx = order[:batch]
        del order[:batch]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if sampler is not None:
            sampler.step()
        opt.step()

    return step


def parse(argv: list[str], blocks: int) -> tuple[str, int, torch.Tensor, torch.Tensor]:
    """(mode, blocks, x, y) from ``[exact|sketch] [blocks] [--model=mlp|lenet]``: 40 batches of
    random MNIST-shaped inputs, or of the CIFAR-10 subset's first images; one torch thread."""
    models = [a.split("=", 1)[1] for a in argv if a.startswith("--model=")]
    argv = [a for a in argv if not a.startswith(("--against=", "--model="))]
    mode = argv[0] if argv else "exact"
    blocks = int(argv[1]) if len(argv) > 1 else blocks
    model = models[0] if models else "mlp"
    if mode not in ("exact", "sketch"):
        raise ValueError(f"mode should be 'exact' or 'sketch', but got {mode!r}")
    if model not in BATCH:
        raise ValueError(f"--model should be 'mlp' or 'lenet', but got {model!r}")
    torch.set_num_threads(1)
    examples = 40 * BATCH[model]
    gen = torch.Generator().manual_seed(0)
    if model == "lenet":
        return mode, blocks, *cifar_images(examples, gen)
    x = torch.randn(examples, 784, generator=gen)
    return mode, blocks, x, torch.randint(0, 10, (examples,), generator=gen)


def cifar_images(count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` training images of the CIFAR-10 lossless subset and their labels, or
    random images where the data folder is absent."""
    try:
        from benchmarks.experiments.data import cifar10_subset

        x, y, _, _ = cifar10_subset()
        return x[:count].contiguous(), y[:count].contiguous()
    except (FileNotFoundError, ImportError):
        x = torch.randn(count, 3, 32, 32, generator=gen)
        return x, torch.randint(0, 10, (count,), generator=gen)


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
        f"{model_name(x)} {mode}: hook / plain median {statistics.median(this_over):.3f} "
        "(this checkout), "
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
        f"{model_name(x)} {mode}: hook / plain median {statistics.median(ratios):.3f}, "
        f"mean {statistics.fmean(ratios):.3f} ({blocks} blocks of {STEPS_PER_BLOCK} steps)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
