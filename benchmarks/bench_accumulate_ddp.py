"""Adaptive accumulation under DDP: the cost of checking that every microbatch was reduced.

Two gloo processes on the CPU, each a DDP replica of an MLP (``overhead_model``), AdamW, windows
of 4 microbatches (the wrappers' thresholds never fire early, so every contender steps at the
4th). Contenders, timed interleaved in one run on both ranks (the same order on both, as their
collectives require):

* plain DDP accumulation (every backward synchronised, a step every 4th);
* GNTS with the replica check (the default: a fingerprint of each microbatch's gradient travels in
  the all-reduce the wrapper does anyway, one pass over the gradient for the norms);
* GNTS with the check switched off (what the wrapper did before it);
* GNTS with the microbatches under ``no_sync()``: the check finds them unreduced and the wrapper
  averages them itself (one unbucketed all-reduce per microbatch instead of DDP's).

Command: ``python -m benchmarks.bench_accumulate_ddp [--quick]``; rank 0 prints the table.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.bench_accumulate import WINDOW, overhead_model
from benchmarks.common import machine_description, time_side_by_side
from grabkit.accumulate import OptimizerWrapperGNTS

WORLD = 2


class _Unchecked(OptimizerWrapperGNTS):
    """GNTS without the replica check (the wrapper before it)."""

    def _compares_replicas(self) -> bool:
        return False


def _contender(width: int, pool, wrapper_class, local: bool):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(overhead_model(width))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = (
        None
        if wrapper_class is None
        else wrapper_class(inner, max_batch_draws=WINDOW, norm_threshold=1e-30)
    )

    def window() -> None:
        for i, (x, y) in enumerate(pool):
            synced = not local or i == WINDOW - 1
            with contextlib.nullcontext() if synced else model.no_sync():
                (model(x) - y).square().mean().backward()
            if opt is not None:
                opt.step(count=len(x))
            elif i == WINDOW - 1:
                inner.step()
                inner.zero_grad()

    return window


def _rank(rank: int, port: int, quick: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    warnings.simplefilter("ignore", RuntimeWarning)  # the no_sync contender's one warning
    width, batch = (512, 32) if quick else (1024, 64)
    gen = torch.Generator().manual_seed(rank)
    pool = [(torch.randn(batch, 512, generator=gen), torch.randn(batch, 512, generator=gen))
            for _ in range(WINDOW)]  # fmt: skip
    contenders = {
        "plain DDP accumulation": _contender(width, pool, None, False),
        "GNTS, replica check": _contender(width, pool, OptimizerWrapperGNTS, False),
        "GNTS, no check": _contender(width, pool, _Unchecked, False),
        "GNTS, no_sync (wrapper averages)": _contender(width, pool, OptimizerWrapperGNTS, True),
    }
    rounds = 5 if quick else 21
    medians = time_side_by_side(contenders, rounds=rounds, warmup=2)
    if rank == 0:
        params = sum(p.numel() for p in overhead_model(width).parameters())
        base = medians["GNTS, no check"]
        print(
            f"DDP, {WORLD} gloo processes (1 thread each), {params / 1e6:.1f}M-parameter MLP, "
            f"microbatch {batch} per rank, AdamW, windows of {WINDOW}; median of {rounds} "
            "interleaved rounds"
        )
        print(f"Machine: {machine_description()}; load average {os.getloadavg()}\n")
        print("| contender | ms / microbatch | ratio to GNTS without the check |")
        print("|---|---|---|")
        for name, seconds in medians.items():
            print(f"| {name} | {1e3 * seconds / WINDOW:.2f} | {seconds / base:.3f}x |")
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, "--quick" in argv), nprocs=WORLD)


if __name__ == "__main__":
    main(sys.argv[1:])
