"""LR schedules that follow an adaptive accumulation wrapper's real updates."""

from __future__ import annotations

from typing import Any

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.validation import check_positive_int

__all__ = ["RealUpdateSchedule"]


class RealUpdateSchedule:
    """An LR scheduler that advances only when the adaptive wrapper really stepped.

    Frameworks call ``lr_scheduler.step()`` after every ``optimizer.step()``, i.e. after every
    microbatch the wrapper folds; this forwards the call once for every ``frequency`` real
    updates (``wrapper.num_steps``) made since the last one, so warm-up and decay are counted in
    real updates. The framework must then call it after every microbatch: Lightning's own
    ``frequency`` (every k batches, counted from each epoch's start) would count microbatches,
    and one call that saw a window of updates would advance the schedule once. Everything else
    (``get_last_lr``, ``last_epoch``, ...) is the inner scheduler's; the checkpoint state is the
    inner state plus the update count seen.

    Args:
        scheduler: the LR scheduler over the wrapper (or its inner optimizer).
        wrapper: the ``AdaptiveAccumulationWrapper`` whose real updates are counted.
        frequency: real updates per scheduler step (Lightning's ``frequency``, moved here).
    """

    def __init__(
        self, scheduler: Any, wrapper: AdaptiveAccumulationWrapper, frequency: int = 1
    ) -> None:
        self.scheduler, self.wrapper = scheduler, wrapper
        self.frequency = check_positive_int("frequency", frequency)
        self.updates_seen = wrapper.num_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        updates, seen = self.wrapper.num_steps, self.updates_seen
        self.updates_seen = updates
        for _ in range(updates // self.frequency - seen // self.frequency):
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "updates_seen": self.updates_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates_seen = int(state["updates_seen"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "scheduler" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.scheduler, name)
