"""Timing a module into a :class:`CostModel`, the prices that ``plan_groups`` minimises.

One call on ``n`` items of padded length ``L`` is modelled as ``alpha + n * cost(L)`` seconds
with ``cost(L) = c0 + c1 * L + c2 * L**2``, fitted by non-negative least squares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "calibrate_cost"]


@dataclass
class CostModel:
    """Fitted timing model: one group of ``n`` items at length ``L`` takes ``alpha + n * cost(L)``.

    ``cost(L) = c0 + c1 * L + c2 * L**2`` seconds per item; ``alpha`` seconds per module call.
    Pass it as ``plan_groups(lengths, cost=model, alpha=model.alpha)``.
    """

    alpha: float
    coefficients: tuple[float, float, float]

    def __call__(self, length: int) -> float:
        c0, c1, c2 = self.coefficients
        return c0 + c1 * length + c2 * length * length


def calibrate_cost(
    run: Callable[[int, int], object],
    lengths: Sequence[int],
    sizes: Sequence[int] = (1, 8, 32),
    repeats: int = 3,
    synchronize: Callable[[], None] | None = None,
) -> CostModel:
    """Time ``run(n, L)`` (one module call on ``n`` items of length ``L``) and fit a CostModel.

    Each grid point is run once to warm up, then ``repeats`` times; the median is fitted by
    non-negative least squares on ``[1, n, n*L, n*L**2]``. ``synchronize`` (e.g.
    ``torch.cuda.synchronize``) is called before reading the clock.
    """
    if not lengths or not sizes:
        raise ValueError("calibrate_cost needs at least one length and one size")
    rows, times = [], []
    for n in sizes:
        for length in lengths:
            run(n, length)
            samples = []
            for _ in range(max(1, repeats)):
                if synchronize:
                    synchronize()
                start = time.perf_counter()
                run(n, length)
                if synchronize:
                    synchronize()
                samples.append(time.perf_counter() - start)
            rows.append([1.0, n, n * length, n * length * length])
            times.append(float(np.median(samples)))
    design, target = np.asarray(rows, np.float64), np.asarray(times, np.float64)
    active = list(range(design.shape[1]))
    coef = np.zeros(design.shape[1])
    while active:  # non-negative least squares by dropping the most negative coefficient
        sol, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return CostModel(float(coef[0]), (float(coef[1]), float(coef[2]), float(coef[3])))
