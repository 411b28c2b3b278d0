"""The one surface every noise-scale estimator offers: ``observe``, ``estimate``, ``close``.

* ``observe(...)`` takes one step's observation, in the estimator's own terms (a microbatch
  estimator's step norm, a batch's per-example norms, ALF's loss and tensors, nothing for the
  estimators that watch gradients through hooks), and returns ``estimate``;
* ``estimate`` is the current ``NoiseScaleResult``, or None before the first informative step;
* ``close()`` detaches whatever the estimator attached (hooks, a wrapper it follows); also on
  leaving a ``with`` block.

The finer-grained calls stay (``observe_microbatch``, ``end_microbatch``, ...), and so do the
names the seeds use (ALF's ``GradientNoiseScaleEstimator(loss, tensors)`` and ``result()``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from grabkit.noise.result import NoiseScaleResult

__all__ = ["NoiseEstimator"]


class NoiseEstimator(ABC):
    """A gradient noise scale estimator (see the module docstring)."""

    @abstractmethod
    def observe(self, *args: Any, **kwargs: Any) -> NoiseScaleResult | None:
        """Take one step's observation; return the estimate after it."""

    @property
    @abstractmethod
    def estimate(self) -> NoiseScaleResult | None:
        """The current ``NoiseScaleResult``, or None before the first informative step."""

    def close(self) -> None:  # noqa: B027 (nothing attached by default)
        """Detach what this estimator attached."""

    def __enter__(self) -> NoiseEstimator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
