"""Count the work of one training step: tensor operations and Python function calls.

Wall and CPU times on a shared machine move by tens of percent between runs; the number of
tensor operations a step dispatches (every ATen call, views and casts included) and the number
of Python function calls it makes do not. They are what the fixed, per-layer cost of a hook-mode
step is made of, so they are counted here, deterministically, around one warmed-up step:

* ``ops``: ATen operations seen by a ``TorchDispatchMode`` (after autograd: the forward, the
  backward and the optimizer's kernels count too), for the whole step and for the part inside
  ``sampler.step()``;
* ``calls``: Python function calls (``sys.setprofile``'s call events, built-ins included),
  likewise (a step of its own: the dispatch mode's own Python is not counted).

Used by ``python benchmarks/run.py stats --count-ops [--workloads=mlp] [--contenders=...]``.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StepCount", "count_step"]


class _OpCounter(TorchDispatchMode):
    """Tallies the ATen operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class StepCount:
    """Tensor operations and Python calls of one step, and of the part inside ``sampler.step``.

    ``ops`` / ``sampler_ops`` tally the operations by name (``aten.mm``: 12, ...).
    """

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.sampler_ops: Counter[str] = Counter()
        self.calls = 0
        self.sampler_calls = 0


def _count_once(step: Callable[[], None], sampler: Any) -> StepCount:
    """One step with its operations counted, then another with its calls (the dispatch mode's
    own Python would count as calls)."""
    count = StepCount()
    inner = None if sampler is None else sampler.step
    calls = [0]

    def on_event(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    def ops_inside(*args: Any, **kwargs: Any) -> Any:
        with _OpCounter() as counter:
            result = inner(*args, **kwargs)
        count.sampler_ops = counter.ops
        return result

    def calls_inside(*args: Any, **kwargs: Any) -> Any:
        before = calls[0]
        result = inner(*args, **kwargs)
        count.sampler_calls = calls[0] - before
        return result

    with _wrapped(sampler, ops_inside), _OpCounter() as counter:
        step()
    count.ops = counter.ops
    with _wrapped(sampler, calls_inside):
        sys.setprofile(on_event)
        try:
            step()
        finally:
            sys.setprofile(None)
    count.calls = calls[0]
    return count


@contextmanager
def _wrapped(sampler: Any, replacement: Callable[..., Any]) -> Iterator[None]:
    """``sampler.step`` replaced by ``replacement`` meanwhile (nothing without a sampler)."""
    if sampler is None:
        yield
        return
    sampler.step = replacement
    try:
        yield
    finally:
        del sampler.step  # the class's method again


def count_step(
    step: Callable[[], None], sampler: Any, warmup: int = 10, repeats: int = 3
) -> tuple[StepCount, dict[str, float]]:
    """Count ``repeats`` steps after ``warmup`` uncounted ones: (the last count, the median of
    each total over the repeats: ``ops``, ``sampler_ops``, ``calls``, ``sampler_calls``).

    ``sampler``: the step's ``GraBSampler`` (None for a plain step); its ``step`` is wrapped
    for the counted steps only. A step whose work varies (an identity check on a schedule)
    shows in the spread of the repeats; the medians are what a table reports.
    """
    for _ in range(warmup):
        step()
    counts = [_count_once(step, sampler) for _ in range(repeats)]
    totals = {
        "ops": statistics.median(sum(c.ops.values()) for c in counts),
        "sampler_ops": statistics.median(sum(c.sampler_ops.values()) for c in counts),
        "calls": statistics.median(c.calls for c in counts),
        "sampler_calls": statistics.median(c.sampler_calls for c in counts),
    }
    return counts[-1], totals
