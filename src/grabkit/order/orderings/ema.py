"""``ema``: centre each batch by an exponential moving average of batch-mean gradients."""

from __future__ import annotations

from typing import Any

import torch

from grabkit.order.orderings.base import register_ordering
from grabkit.order.orderings.centred import CentredBalance
from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.validation import check_probability

__all__ = ["EMABalance", "VectorEMA", "check_rate"]


class VectorEMA(Stateful):
    """Bias-corrected EMA of vectors: m_t = (1 - r) m_{t-1} + r x_t, reported m_t / (1 - (1-r)^t).

    Args:
        rate: r, the weight of the newest observation.
    """

    raw: torch.Tensor | None
    decay_product: float

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.add_state("raw", None)
        self.add_state("decay_product", 1.0, load=float)

    def peek(self, x: torch.Tensor) -> torch.Tensor:
        """The corrected average if ``x`` were added now (no state changes)."""
        raw = self.rate * x if self.raw is None else (1 - self.rate) * self.raw + self.rate * x
        return raw / (1.0 - self.decay_product * (1 - self.rate))

    def add(self, x: torch.Tensor) -> None:
        self.raw = self.rate * x if self.raw is None else (1 - self.rate) * self.raw + self.rate * x
        self.decay_product *= 1 - self.rate


def check_rate(name: str, value: float) -> float:
    """An EMA's weight of the newest observation, in (0, 1]."""
    return check_probability(name, value, allow_one=True)


@register_ordering
class EMABalance(CentredBalance):
    """Balance g_i - m_t, m_t the EMA of batch means including the current batch.

    Unlike the stale mean it follows the gradient within the epoch, which helps when the model
    moves a lot per epoch. ``ema_decay`` is the weight of the newest batch mean (grab-sampler's
    name and default, 0.1). Works on hook statistics (the batch mean is ``total() / B``).
    """

    name = "ema"

    def __init__(self, n: int, *, ema_decay: float = 0.1, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.add_state("ema", VectorEMA(check_rate("ema_decay", ema_decay)))

    def centre(self, batch: GradientBatch) -> torch.Tensor | None:
        return self.ema.peek(batch.total() / batch.size)

    def record(self, total: torch.Tensor, count: int) -> None:
        self.ema.add(total / count)
