"""Bias-corrected exponential moving averages, the one averaging rule of every noise estimator.

Numerator and denominator of a ratio (tr Sigma and |G|^2) are averaged separately with this and
the ratio is taken last: the mean of a ratio is not the ratio of means.
"""

from __future__ import annotations

import math

import torch

from grabkit.state import Stateful
from grabkit.stats.transfer import to_device
from grabkit.validation import check_probability

__all__ = ["BiasCorrectedEMA"]


class BiasCorrectedEMA(Stateful):
    """EMA  m_t = (1 - r) m_{t-1} + r x_t,  reported as m_t / (1 - (1 - r)^t)  (Adam's correction).

    The update rate r means the same as ALF's ``ScalarEMAverager(update_rate)``: the weight of the
    newest observation. ``update(x, weight=w)`` counts an observation as w steps (w examples when
    the window is measured in examples): its effective rate is 1 - (1 - r)^w.

    Values may be Python floats or tensors of any fixed shape (per-parameter-block statistics);
    they are kept as float64 tensors on the device of the first observation, and nothing here
    synchronises with the device.
    """

    _mean: torch.Tensor | None
    _decay_product: float  # (1 - r)^t, the weight still held by the zero initial value

    def __init__(self, update_rate: float) -> None:
        rate = check_probability("update_rate", update_rate, allow_one=True)
        self.add_state("update_rate", rate, load=float)
        self.add_state("mean", None, attribute="_mean", save=_copy, load=_copy)
        self.add_state("decay_product", 1.0, attribute="_decay_product", load=float)

    @property
    def count_weight(self) -> float:
        """1 - (1 - r)^t: the total weight of the observations seen so far."""
        return 1.0 - self._decay_product

    def update(self, value: torch.Tensor | float, weight: float = 1.0) -> torch.Tensor:
        """Fold in one observation (counted ``weight`` times) and return the corrected average."""
        if weight <= 0:
            raise ValueError(f"weight should be positive, but got weight={weight}")
        x = torch.as_tensor(value, dtype=torch.float64)
        decay = math.pow(1.0 - self.update_rate, weight)
        if self._mean is None:
            self._mean = torch.zeros_like(x)
        self._mean = decay * self._mean + (1.0 - decay) * to_device(x, self._mean.device)
        self._decay_product *= decay
        return self.value

    @property
    def value(self) -> torch.Tensor:
        """The bias-corrected average; raises before the first observation."""
        if self._mean is None:
            raise RuntimeError("BiasCorrectedEMA has no observation yet; call update() first")
        return self._mean / (1.0 - self._decay_product)

    @property
    def initialized(self) -> bool:
        return self._mean is not None


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
