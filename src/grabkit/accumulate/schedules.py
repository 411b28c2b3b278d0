"""Schedules for the wrappers' knobs: norm threshold, noise multiplier, tolerance, batch size.

A GQC wrapper's threshold is not a learning rate, so grabkit schedules it with
:class:`ValueSchedule`, which sets ``wrapper.scheduled_value = fn(t)`` (an absolute value) at
construction (t = 0) and after every ``step()``; the learning rate stays with stock LR schedulers
on the same wrapper or on the inner optimizer. ``t`` counts ``step()`` calls, i.e. microbatches
in GQC's loop. Any :class:`~grabkit.accumulate.wrapper.AdaptiveAccumulationWrapper` can be the
target, with whatever controller.

Given a plain ``torch.optim.Optimizer`` instead, every schedule here is a learning-rate schedule,
as in torch-gqc: ``fn(t)`` is written into each param group's ``"lr"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from grabkit.validation import check_non_negative_int, check_positive, check_positive_int

__all__ = [
    "NormWarmupScheduler",
    "ValueSchedule",
    "get_curved_batch_schedule",
    "get_direct_cosine_annealing_with_warmup",
    "get_norm_threshold_cosine_annealing_with_warmup",
    "get_quadratic_batch_schedule",
]


def _count(name: str, value: Any, minimum: int = 0) -> int:
    if minimum > 0:
        return check_positive_int(name, value, minimum)
    return check_non_negative_int(name, value)


def _check_target(optimizer: Any) -> None:
    if not (hasattr(type(optimizer), "scheduled_value") or isinstance(optimizer, Optimizer)):
        raise TypeError(
            "a schedule drives a grabkit accumulation wrapper's knob or a torch.optim.Optimizer's "
            f"learning rate, but got {type(optimizer).__name__}"
        )


class ValueSchedule:
    """Set the target's value to ``value_fn(t)`` for t = 0, 1, 2, ... (one per ``step()``).

    The target's value is ``scheduled_value`` for a grabkit accumulation wrapper and every
    param group's ``"lr"`` for a plain ``torch.optim.Optimizer``.
    """

    def __init__(self, optimizer: Any, value_fn: Callable[[int], float]) -> None:
        _check_target(optimizer)
        self.optimizer = optimizer
        self.value_fn = value_fn
        self.last_epoch = 0
        self._apply()

    @property
    def drives_learning_rate(self) -> bool:
        """True when the target is a plain optimizer whose learning rate is scheduled."""
        return not hasattr(type(self.optimizer), "scheduled_value")

    def _set_value(self, value: float) -> None:
        if not self.drives_learning_rate:
            self.optimizer.scheduled_value = float(value)  # the controller checks its knob
            return
        value = float(value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"the schedule set the learning rate to {value!r} at step {self.last_epoch}; it "
                "must be a finite number >= 0. Check the schedule's function and warm-up values."
            )
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def _apply(self) -> None:
        self._set_value(self.value_fn(self.last_epoch))

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_value(self) -> float:
        if self.drives_learning_rate:
            return self.optimizer.param_groups[0]["lr"]
        return self.optimizer.scheduled_value

    def get_last_lr(self) -> list[float]:
        """The value as a list (one entry per param group for a plain optimizer)."""
        if self.drives_learning_rate:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [self.get_last_value()]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"last_epoch"}:
            raise ValueError(f"expected a ValueSchedule state with 'last_epoch', got {state_dict}")
        self.last_epoch = int(state_dict["last_epoch"])
        self._apply()


def _progress(step: int, start: int, end: int) -> float:
    """Fraction of [start, end] covered at ``step``, clamped to [0, 1] (held after the end)."""
    if end <= start:
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def _half_cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _warmup_then_cosine(
    first: float, peak: float, last: float, num_warmup_steps: int, num_training_steps: int
) -> Callable[[int], float]:
    """step -> value: linear ``first`` -> ``peak`` over the warm-up, then a half-cosine to
    ``last`` at ``num_training_steps``, held there afterwards."""

    def value(step: int) -> float:
        if step < num_warmup_steps:
            return first + (step / num_warmup_steps) * (peak - first)
        progress = _progress(step, num_warmup_steps, num_training_steps)
        return last + (peak - last) * _half_cosine(progress)

    return value


def get_norm_threshold_cosine_annealing_with_warmup(
    optimizer: Any,
    num_warmup_steps: int,
    num_training_steps: int,
    start_norm: float = 1.0,
    end_norm: float = 0.0,
    warmup_multiplier: float = 10.0,
) -> ValueSchedule:
    """Inverse warm-up from ``start_norm * warmup_multiplier`` down to ``start_norm`` (linear,
    ``num_warmup_steps``), then a half-cosine to ``end_norm`` at ``num_training_steps``, held at
    ``end_norm`` afterwards. A norm threshold starts *high* (lenient) and tightens."""
    _count("num_warmup_steps", num_warmup_steps)
    _count("num_training_steps", num_training_steps)
    if num_training_steps < num_warmup_steps:
        raise ValueError(
            f"`num_training_steps` should be >= num_warmup_steps, but got "
            f"num_training_steps={num_training_steps}, num_warmup_steps={num_warmup_steps}"
        )
    warmup_start = start_norm * warmup_multiplier

    value = _warmup_then_cosine(
        warmup_start, start_norm, end_norm, num_warmup_steps, num_training_steps
    )
    return ValueSchedule(optimizer, value)


def get_direct_cosine_annealing_with_warmup(
    optimizer: Any,
    peak_value: float,
    num_warmup_steps: int,
    num_training_steps: int,
    min_value: float = 0.0,
) -> ValueSchedule:
    """Linear 0 -> ``peak_value`` over the warm-up, then half-cosine to ``min_value``, held."""
    _count("num_warmup_steps", num_warmup_steps)
    _count("num_training_steps", num_training_steps)

    value = _warmup_then_cosine(0.0, peak_value, min_value, num_warmup_steps, num_training_steps)
    return ValueSchedule(optimizer, value)


def get_curved_batch_schedule(
    optimizer: Any,
    initial_batch_size: float,
    final_batch_size: float,
    num_training_steps: int,
    polynomial_exponent: float = 2.0,
) -> ValueSchedule:
    """Logical batch size ``initial + (final - initial) * progress ** polynomial_exponent``."""
    _count("num_training_steps", num_training_steps, minimum=1)
    check_positive("polynomial_exponent", polynomial_exponent)

    def value(step: int) -> float:
        progress = _progress(step, 0, num_training_steps)
        return initial_batch_size + (final_batch_size - initial_batch_size) * (
            progress**polynomial_exponent
        )

    return ValueSchedule(optimizer, value)


def get_quadratic_batch_schedule(
    optimizer: Any, initial_batch_size: float, final_batch_size: float, num_training_steps: int
) -> ValueSchedule:
    """Logical batch size growing quadratically from ``initial`` to ``final``, then held."""
    return get_curved_batch_schedule(
        optimizer, initial_batch_size, final_batch_size, num_training_steps, 2.0
    )


class NormWarmupScheduler:
    """Put an inverse linear warm-up in front of another schedule.

    For t < ``num_warmup_steps`` the value is ``warmup_start + t / num_warmup_steps *
    (warmup_end - warmup_start)``; from then on it is the wrapped schedule's. The wrapped
    schedule advances on every ``step()`` either way (its clock is the run's clock).
    """

    def __init__(
        self,
        scheduler: ValueSchedule,
        num_warmup_steps: int,
        warmup_start: float = 10.0,
        warmup_end: float = 1.0,
    ) -> None:
        if not isinstance(scheduler, ValueSchedule):
            raise TypeError(
                "`scheduler` should be a grabkit ValueSchedule (for example from "
                "get_norm_threshold_cosine_annealing_with_warmup), but got "
                f"{type(scheduler).__name__}"
            )
        self.scheduler = scheduler
        self.optimizer = scheduler.optimizer
        self.num_warmup_steps = _count("num_warmup_steps", num_warmup_steps)
        self.warmup_start = float(warmup_start)
        self.warmup_end = float(warmup_end)
        self._apply()

    @property
    def last_epoch(self) -> int:
        return self.scheduler.last_epoch

    def _apply(self) -> None:
        t = self.last_epoch
        if t < self.num_warmup_steps:
            fraction = t / self.num_warmup_steps
            value = self.warmup_start + fraction * (self.warmup_end - self.warmup_start)
            self.scheduler._set_value(value)

    def step(self) -> None:
        self.scheduler.step()
        self._apply()

    def get_last_value(self) -> float:
        return self.scheduler.get_last_value()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"scheduler"}:
            raise ValueError(
                f"expected a NormWarmupScheduler state with 'scheduler', got keys "
                f"{sorted(state_dict)}"
            )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self._apply()
