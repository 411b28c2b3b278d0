"""Timing helpers shared by the benchmarks: interleaved rounds, medians, ratios.

The machines are shared and noisy, so every comparison times its contenders in the same run,
interleaved round by round, and reports medians and ratios rather than absolute numbers alone.
"""

from __future__ import annotations

import gzip
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

#: the real datasets (formats in that folder's README): ``../shared/data`` beside the checkout,
#: or the folder ``GRABKIT_DATA`` names (a machine where the checkout has no such neighbour)
DATA = Path(os.environ.get("GRABKIT_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (a no-op on the CPU), so a timer measures finished work."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_side_by_side(
    contenders: dict[str, Callable[[], object]],
    rounds: int = 20,
    warmup: int = 3,
    inner: int = 1,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Median seconds per call of each contender, timed in interleaved rounds.

    Each round runs every contender ``inner`` times in turn (order rotated round by round), so
    drifting load on a shared machine hits all of them alike.
    """
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def machine_description() -> str:
    """One line naming the machine, for RESULTS.md."""
    threads = torch.get_num_threads()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.processor() or platform.machine()}, {threads} torch threads, {gpu}, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip) as a numpy array: big-endian header of dims, then uint8 data."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()
