"""LR schedules that follow an adaptive accumulation wrapper's real updates."""

from __future__ import annotations

from typing import Any

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper

__all__ = ["RealUpdateSchedule"]


class RealUpdateSchedule:
    """An LR scheduler that advances only when the adaptive wrapper really stepped.

    Frameworks call ``lr_scheduler.step()`` after every ``optimizer.step()``, i.e. after every
    microbatch the wrapper folds; this forwards the call only when ``wrapper.num_steps`` moved
    since the last one, so warm-up and decay are counted in real updates. Everything else
    (``get_last_lr``, ``last_epoch``, ...) is the inner scheduler's; the checkpoint state is the
    inner state plus the update count seen.
    """

    def __init__(self, scheduler: Any, wrapper: AdaptiveAccumulationWrapper) -> None:
        self.scheduler, self.wrapper = scheduler, wrapper
        self.updates_seen = wrapper.num_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.wrapper.num_steps != self.updates_seen:
            self.updates_seen = self.wrapper.num_steps
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
