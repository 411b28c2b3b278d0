"""Run a test body in N gloo processes on loopback, and collect what each rank returns.

Usage::

    def body(rank: int, world_size: int, payload) -> dict:  # must be a module-level function
        ...  # torch.distributed is initialised (gloo); return plain picklable values
        # (lists, numbers): tensors sent back through the queue die with their rank
    results = run_distributed(body, world_size=2, payload=...)  # list indexed by rank

Any exception on a rank is re-raised in the test process with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, payload: Any, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, payload)
        queue.put((rank, True, result))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[[int, int, Any], Any], world_size: int, payload: Any = None, timeout: float = 120.0
) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, payload)``; results by rank."""
    # spawned children rebuild sys.path from the parent's: make test modules importable there
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, payload, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
