"""The five torch-gqc wrappers, same names and arguments, on grabkit's exact accumulation.

Each is an :class:`~grabkit.accumulate.wrapper.AdaptiveAccumulationWrapper` with one controller;
every one accepts the wrapper's keyword options (``default_count``, ``clip_grad_norm``,
``process_group``, ``gradient_layout``). The value a GQC schedule drives (norm threshold, noise
multiplier, error tolerance, target norm, logical batch size) is ``wrapper.scheduled_value``;
the schedules in :mod:`grabkit.accumulate.schedules` set it, and stock LR schedulers attached to
the wrapper act on the inner optimizer's learning rate, as they would without the wrapper.

The loop is GQC's: one ``step()`` per microbatch, no ``zero_grad()``, and a ``flush()`` at the
end for the window still accumulating::

    optimizer = OptimizerWrapperGNTS(torch.optim.AdamW(model.parameters(), lr=1e-3))
    norm_schedule = get_norm_threshold_cosine_annealing_with_warmup(optimizer, 100, len(loader))
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, t / 100))
    for inputs, labels in loader:
        loss_fn(model(inputs), labels).backward()
        stepped = optimizer.step(count=len(labels))  # True when AdamW stepped
        norm_schedule.step()  # one tick per microbatch, as in GQC
        lr_schedule.step()
    optimizer.flush()  # apply the microbatches folded since the last step

Deliberate differences from torch-gqc 0.8.1:

* ``param_groups`` are the inner optimizer's (GQC exposed a fake ``[{"lr": threshold}]``), so
  a ``LambdaLR`` on the wrapper schedules the learning rate; thresholds are scheduled with
  grabkit's schedules, whose values are absolute (GQC's batch schedules were multiplied by the
  initial batch size).
* ``zero_grad()`` is safe; GNTS steps at ``|m| <= threshold`` (GQC: strictly below).
* GNS decides on the gradient noise scale B_simple (GQC's statistic, var/mean of squared norms,
  can never exceed 1, so it always stepped after two microbatches).
* MHT compares with ``|mean|``, so negative metrics work, and takes a closure's loss as the
  metric when none is given.
* The inner step's return value is ``last_optimizer_result``; statistics are Python numbers.
* A microbatch without gradient (``zero_grad()`` before ``step()``) is discarded with its count;
  a NaN/inf gradient or metric discards the window with a warning instead of stalling until
  ``max_batch_draws`` and then writing NaN into the parameters.
* ``flush()`` applies a partial window (GQC leaves it unapplied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from grabkit.accumulate.controllers import (
    MetricHypothesisTest,
    NoiseScaleController,
    NormRescale,
    NormThreshold,
    ScheduledBatch,
)
from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper

__all__ = [
    "OptimizerWrapperGNR",
    "OptimizerWrapperGNS",
    "OptimizerWrapperGNTS",
    "OptimizerWrapperMHT",
    "OptimizerWrapperSBC",
]


class OptimizerWrapperGNTS(AdaptiveAccumulationWrapper):
    """Gradient Norm Threshold Scheduler: step when |mean gradient| <= ``norm_threshold``.

    ``norm_threshold`` (default 1.0) is usually driven by
    :func:`~grabkit.accumulate.schedules.get_norm_threshold_cosine_annealing_with_warmup`::

        optimizer = OptimizerWrapperGNTS(torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step(count=len(y))  # steps once |mean gradient| <= norm_threshold
        optimizer.flush()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_batch_draws: int = 64,
        *,
        norm_threshold: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(
            optimizer, NormThreshold(norm_threshold), max_batch_draws=max_batch_draws, **options
        )

    @property
    def norm_threshold(self) -> float:
        return self.controller.norm_threshold

    @norm_threshold.setter
    def norm_threshold(self, value: float) -> None:
        self.controller.scheduled_value = value


class OptimizerWrapperGNS(AdaptiveAccumulationWrapper):
    """Noise-scale controlled: step when the window's count reaches ``noise_multiplier * B_simple``.

    B_simple is measured from the microbatch gradient norms and the window mean (see
    :class:`~grabkit.accumulate.controllers.NoiseScaleController`); pass ``step(count=...)`` so
    it is in examples or tokens.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        noise_multiplier: float = 1.0,
        max_batch_draws: int = 64,
        *,
        update_rate: float = 0.2,
        min_draws: int = 2,
        **options: Any,
    ) -> None:
        controller = NoiseScaleController(noise_multiplier, update_rate, min_draws)
        super().__init__(optimizer, controller, max_batch_draws=max_batch_draws, **options)

    @property
    def noise_multiplier(self) -> float:
        return self.controller.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.controller.scheduled_value = value


class OptimizerWrapperMHT(AdaptiveAccumulationWrapper):
    """Metric hypothesis test: step when the loss is pinned down within ``error_tolerance``.

    Call ``step(loss)`` (GQC's ``step(metric, closure=None)``); see
    :class:`~grabkit.accumulate.controllers.MetricHypothesisTest` for the rule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        confidence: float = 0.98,
        error_tolerance: float = 0.03,
        ema_alpha: float = 0.01,
        max_batch_draws: int = 64,
        **options: Any,
    ) -> None:
        controller = MetricHypothesisTest(confidence, error_tolerance, ema_alpha)
        super().__init__(optimizer, controller, max_batch_draws=max_batch_draws, **options)

    def step(  # type: ignore[override]
        self,
        metric: float | torch.Tensor | None = None,
        closure: Callable[[], Any] | None = None,
        *,
        count: float | torch.Tensor | None = None,
    ) -> bool:
        return self._accumulate_step(closure, count, metric)

    @property
    def error_tolerance(self) -> float:
        return self.controller.error_tolerance

    @error_tolerance.setter
    def error_tolerance(self, value: float) -> None:
        self.controller.scheduled_value = value

    @property
    def running_avg_metric(self) -> float | None:
        avg = self.controller.running_average()
        return None if avg is None else float(avg)


class OptimizerWrapperGNR(AdaptiveAccumulationWrapper):
    """Gradient Norm Rescaler: step every microbatch with the gradient rescaled to ``target_norm``.

    ``mode="global"`` scales the whole gradient to total norm ``target_norm``;
    ``"independent"`` scales each parameter's gradient to that norm separately (replicated
    gradients only: a shard does not know its parameter's full norm). The rule is the
    :class:`~grabkit.accumulate.controllers.NormRescale` controller.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: Literal["global", "independent"] = "global",
        *,
        target_norm: float = 1.0,
        **options: Any,
    ) -> None:
        controller = NormRescale(target_norm, mode)
        if options.get("gradient_layout") == "sharded" and mode == "independent":
            raise ValueError("mode='independent' needs whole parameters; use mode='global'")
        super().__init__(optimizer, controller, **options)

    @property
    def mode(self) -> str:
        return self.controller.mode

    @property
    def target_norm(self) -> float:
        return self.controller.target_norm

    @target_norm.setter
    def target_norm(self, value: float) -> None:
        self.controller.scheduled_value = value


class OptimizerWrapperSBC(AdaptiveAccumulationWrapper):
    """Scheduled Batch Controller: accumulate up to a (scheduled) logical batch size.

    Each microbatch counts ``physical_batch_size`` unless ``step(count=...)`` says otherwise.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        physical_batch_size: int,
        initial_logical_batch_size: float | None = None,
        max_batch_draws: int = 64,
        **options: Any,
    ) -> None:
        if initial_logical_batch_size is None:
            initial_logical_batch_size = physical_batch_size
        controller = ScheduledBatch(physical_batch_size, initial_logical_batch_size)
        options.setdefault("default_count", float(physical_batch_size))
        super().__init__(optimizer, controller, max_batch_draws=max_batch_draws, **options)

    @property
    def physical_batch_size(self) -> float:
        return self.controller.physical_batch_size

    @property
    def target_logical_batch_size(self) -> float:
        return self.controller.target_logical_batch_size

    @target_logical_batch_size.setter
    def target_logical_batch_size(self, value: float) -> None:
        self.controller.scheduled_value = value

    @property
    def target_draws(self) -> int:
        return self.controller.target_draws
