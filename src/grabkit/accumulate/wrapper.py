"""``AdaptiveAccumulationWrapper``: a real optimizer that decides, per microbatch, when to step.

Call ``step()`` after every microbatch's backward, as with a plain optimizer. The wrapper folds
the microbatch gradient into its accumulator (weighted by ``count``), asks its controller whether
the window is good enough, and when it is, writes the exact weighted mean into ``.grad``, applies
the optional clipping, steps the inner optimizer and returns True.

It *is* a ``torch.optim.Optimizer``: ``Optimizer.__init__`` runs (so step hooks work), and
``param_groups`` / ``state`` / ``defaults`` are the inner optimizer's own objects, so stock LR
schedulers, ``GradScaler`` and checkpoint code act on the real thing. Attributes it does not
define are forwarded to the inner optimizer.

GradScaler: ``scaler.scale(loss).backward(); scaler.step(wrapper); scaler.update()`` after every
microbatch. The wrapper declares ``_step_supports_amp_scaling``, so the scaler hands it the
current scale and the overflow flag instead of unscaling ``.grad`` itself; each microbatch is
unscaled exactly once, by the scale it was computed with, as it is folded (so statistics are in
true units and a scale change in mid-window costs nothing). An overflowed microbatch (inf/NaN) is
dropped: nothing of it reaches the accumulator, it does not count as a draw, and ``step`` returns
False with reason ``"overflow_skipped"``.

Decisions cost one device-to-host transfer per microbatch (the decision flag; under a GradScaler
also the overflow flag, as GradScaler itself does). Under torch.distributed every statistic is
all-reduced first (see :mod:`grabkit.accumulate.distributed`), so all ranks decide alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grabkit.accumulate.accumulator import GradientAccumulator, squared_norm
from grabkit.accumulate.controllers import Controller, Observation
from grabkit.accumulate.distributed import GradientLayout, StatisticsReducer

__all__ = ["AdaptiveAccumulationWrapper"]

_STATE_VERSION = 1


def _check_count(count: Any) -> float | torch.Tensor:
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"`count` should be a number or a one-element tensor, but got a tensor of "
                f"shape {tuple(count.shape)}"
            )
        return count.detach().reshape(())
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ValueError(
            f"`count` should be a positive number (examples or tokens in the microbatch), "
            f"but got count={count!r}"
        )
    return float(count)


class AdaptiveAccumulationWrapper(torch.optim.Optimizer):
    """Wrap ``optimizer``; step it when ``controller`` says the accumulated gradient is ready.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``).
        controller: the stepping rule (see :mod:`grabkit.accumulate.controllers`).
        max_batch_draws: step at the latest after this many microbatches.
        default_count: the weight of a microbatch when ``step`` gets no ``count``.
        clip_grad_norm: if set, clip the averaged gradient to this total norm before stepping
            (the norm is the global one, also under sharding).
        process_group: the ranks that must agree (default: the world, when initialised).
        gradient_layout: ``"replicated"`` (DDP) or ``"sharded"`` (FSDP-style), see
            :mod:`grabkit.accumulate.distributed`.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        controller: Controller,
        *,
        max_batch_draws: int = 64,
        default_count: float = 1.0,
        clip_grad_norm: float | None = None,
        process_group=None,
        gradient_layout: GradientLayout = "replicated",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` should be a torch.optim.Optimizer, but got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, AdaptiveAccumulationWrapper):
            raise TypeError("`optimizer` is already an adaptive accumulation wrapper")
        if not isinstance(controller, Controller):
            raise TypeError(f"`controller` should be a Controller, but got {type(controller)}")
        if isinstance(max_batch_draws, bool) or not isinstance(max_batch_draws, int):
            raise TypeError(f"`max_batch_draws` should be an int, but got {max_batch_draws!r}")
        if max_batch_draws < 1:
            raise ValueError(
                f"`max_batch_draws` should be a positive integer, but got "
                f"max_batch_draws={max_batch_draws}"
            )
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(
                f"`clip_grad_norm` should be positive or None, but got {clip_grad_norm!r}"
            )
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__([{"params": params}], dict(optimizer.defaults))
        # share, do not copy: schedulers, GradScaler and checkpoints see the inner optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

        self.controller = controller
        self.max_draws = max_batch_draws
        self.default_count = _check_count(default_count)
        self.clip_grad_norm = clip_grad_norm
        self._reducer = StatisticsReducer(process_group, gradient_layout)
        self._accumulator = GradientAccumulator()

        self.num_batches = 0  # microbatches folded, over the run
        self.num_steps = 0  # inner optimizer steps
        self.num_draws = 0  # microbatches folded into the current window
        self.num_skipped = 0  # microbatches dropped on overflow
        self._total_count: torch.Tensor | None = None
        self.last_step_num_draws: int | None = None
        self.last_step_count: torch.Tensor | None = None
        self._last_mean_norm_sq: torch.Tensor | None = None  # |mean|^2 at the last step
        self.last_reason = "none"
        self.last_closure_loss: Any = None
        self.last_optimizer_result: Any = None  # what the inner optimizer's step returned

    # ----------------------------------------------------------------- forwarding
    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this object lacks: forward them to the inner optimizer
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(optimizer, name)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad``: safe at any time, since the accumulation lives in its own buffers.

        Between ``backward`` and ``step`` it discards that microbatch, as with a plain optimizer.
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ----------------------------------------------------------------- the step
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        count: float | torch.Tensor | None = None,
        metric: float | torch.Tensor | None = None,
    ) -> bool:
        """Fold this microbatch's gradient; step the inner optimizer when the controller agrees.

        Args:
            closure: optional; called (with grad enabled) to compute this microbatch's loss and
                gradient. Its return value is kept in ``last_closure_loss`` and used as the
                metric when the controller wants one and ``metric`` is None. The inner
                optimizer is stepped without it.
            count: this microbatch's weight in the average (examples, tokens; a number or a
                one-element tensor); ``default_count`` when None. Under torch.distributed pass
                the local count: the microbatch's weight is the sum over ranks.
            metric: this microbatch's metric (loss) for controllers that read one.
        Returns:
            True when the inner optimizer stepped.
        """
        return self._accumulate_step(closure, count, metric)

    def _accumulate_step(
        self,
        closure: Callable[[], Any] | None,
        count: float | torch.Tensor | None,
        metric: float | torch.Tensor | None,
    ) -> bool:
        # Subclasses with another step signature call this, not super().step(): Optimizer wraps
        # every class's own ``step`` with the hook runner, so hooks would fire twice.
        if closure is not None:
            with torch.enable_grad():
                self.last_closure_loss = closure()
            if metric is None:
                metric = self.last_closure_loss
        count = self.default_count if count is None else _check_count(count)
        if self.controller.needs_metric:
            if metric is None:
                raise ValueError(
                    f"{type(self.controller).__name__} decides on a metric: call "
                    "step(metric=loss) (or pass a closure that returns the loss)"
                )
            metric = torch.as_tensor(
                metric.detach() if isinstance(metric, torch.Tensor) else metric,
                dtype=torch.float64,
            ).reshape(())

        params = self._params()
        pending = self._accumulator.pending_gradients(params)
        device = pending[0][1].device if pending else params[0].device
        agreed = self._agree_on_microbatch(count, metric, device)
        if agreed is None:
            return self._skip_overflowed(params)
        weight, global_count, metric = agreed

        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step for this call
        inverse_scale = None
        if grad_scale is not None:
            inverse_scale = grad_scale.double().reciprocal().to(device)
            weight = global_count * inverse_scale

        microbatch_norm_sq = None
        if self.controller.needs_microbatch_norm:
            microbatch_norm_sq = squared_norm([g for _, g in pending]).to(device)
            if inverse_scale is not None:
                microbatch_norm_sq = microbatch_norm_sq * inverse_scale.square()
        self._accumulator.fold(pending, weight)
        self._total_count = (
            global_count if self._total_count is None else self._total_count + global_count
        )
        self.num_draws += 1
        self.num_batches += 1
        sum_norm_sq, microbatch_norm_sq = self._agree_on_norms(
            self._accumulator.sum_squared_norm().to(device), microbatch_norm_sq
        )
        obs = Observation(
            count=global_count,
            total_count=self._total_count,
            draws=self.num_draws,
            mean_norm_sq=sum_norm_sq / self._total_count.square(),
            microbatch_norm_sq=microbatch_norm_sq,
            metric=metric,
        )
        self.controller.observe(obs)

        if self.num_draws >= self.max_draws:
            reason = "max_batch_draws"
        else:
            ready = self.controller.ready(obs)
            ready = bool(ready.item()) if isinstance(ready, torch.Tensor) else bool(ready)
            reason = self.controller.reason if ready else "accumulating"
        self.last_reason = reason
        if reason == "accumulating":
            return False
        self._apply(obs)
        return True

    def _agree_on_microbatch(
        self, count: float | torch.Tensor, metric: torch.Tensor | None, device: torch.device
    ) -> tuple[float | torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The microbatch's weight, total count and metric as all ranks see them.

        Returns (fold weight, count, metric), or None when a GradScaler found an overflow on
        any rank. Single process with a plain-number count: no tensor is even created.
        """
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        if (
            self._reducer.world_size == 1
            and found_inf is None
            and not isinstance(count, torch.Tensor)
        ):
            global_count = torch.tensor(count, dtype=torch.float64, device=device)
            return count, global_count, None if metric is None else metric.to(device)
        head = torch.zeros(3, dtype=torch.float64, device=device)
        head[0] = count.to(device) if isinstance(count, torch.Tensor) else count
        if metric is not None:
            head[1] = head[0] * metric.to(device)
        if found_inf is not None:
            head[2] = found_inf.to(device=device, dtype=torch.float64)
        self._reducer.sum(head)
        if found_inf is not None and bool(head[2] > 0):
            return None
        return head[0], head[0], None if metric is None else head[1] / head[0]

    def _agree_on_norms(
        self, sum_norm_sq: torch.Tensor, microbatch_norm_sq: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """|S|^2 and |g|^2 combined over ranks as the gradient layout requires."""
        if self._reducer.world_size == 1:
            return sum_norm_sq, microbatch_norm_sq
        pair = torch.stack(
            [sum_norm_sq, sum_norm_sq if microbatch_norm_sq is None else microbatch_norm_sq]
        )
        pair = self._reducer.sum(pair) * self._reducer.norm_sq_scale()
        return pair[0], None if microbatch_norm_sq is None else pair[1]

    def _skip_overflowed(self, params: list[torch.Tensor]) -> bool:
        for p in params:
            p.grad = None
        self.num_skipped += 1
        self.last_reason = "overflow_skipped"
        return False

    def _transform_mean_gradient(self, grads: list[torch.Tensor], obs: Observation) -> None:
        """Hook for subclasses: change the averaged gradient in place before the inner step."""
        if self.clip_grad_norm is not None and grads:
            total_norm = obs.mean_norm_sq.sqrt()
            coef = (self.clip_grad_norm / (total_norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))

    def _apply(self, obs: Observation) -> None:
        grads = self._accumulator.write_mean(self._total_count)
        self._transform_mean_gradient(grads, obs)
        self.last_optimizer_result = self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.controller.end_window(obs)
        self.last_step_num_draws = self.num_draws
        self._last_mean_norm_sq = obs.mean_norm_sq
        self.last_step_count = self._total_count
        self.num_steps += 1
        self.num_draws = 0
        self._total_count = None

    # ----------------------------------------------------------------- reporting
    def statistics(self) -> dict[str, Any]:
        """Counters and the controller's knobs, for logging (converting tensors syncs once).

        Keys as in GQC, which reads them *before* each microbatch: ``batches`` and
        ``num_draws`` count the microbatch about to be processed (1-based), so at the moment a
        step happens ``num_draws`` read just before it is the window's size. Also:
        ``accumulated_draws`` (folded so far), ``accumulated_count``, ``skipped_batches``
        (overflows) and ``reason`` (why the last ``step`` call did or did not step:
        ``accumulating``, ``max_batch_draws``, ``overflow_skipped`` or the rule's name).
        """
        norm_sq = self._last_mean_norm_sq
        stats: dict[str, Any] = {
            "batches": self.num_batches + 1,
            "steps": self.num_steps,
            "num_draws": self.num_draws + 1,
            "last_mean_grad_norm": None if norm_sq is None else float(norm_sq.sqrt()),
            "last_step_num_draws": self.last_step_num_draws,
            "accumulated_draws": self.num_draws,
            "accumulated_count": (0.0 if self._total_count is None else float(self._total_count)),
            "skipped_batches": self.num_skipped,
            "reason": self.last_reason,
        }
        stats.update(self.controller.statistics())
        return stats

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__}: controller={type(self.controller).__name__}, "
            f"batches={self.num_batches}, steps={self.num_steps}, "
            f"core={type(self.optimizer).__name__}>"
        )

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, the partial accumulation, counters and controller state.

        Only tensors, numbers, strings, lists, dicts and None: ``torch.load(weights_only=True)``
        reads it back.
        """
        return {
            "version": _STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "accumulated_sums": self._accumulator.state_dict(self._params()),
            "controller": self.controller.state_dict(),
            "counters": {
                "num_batches": self.num_batches,
                "num_steps": self.num_steps,
                "num_draws": self.num_draws,
                "num_skipped": self.num_skipped,
                "total_count": self._total_count,
                "last_step_num_draws": self.last_step_num_draws,
                "last_step_count": self.last_step_count,
                "last_mean_norm_sq": self._last_mean_norm_sq,
                "last_reason": self.last_reason,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, including a partially accumulated window."""
        expected = {"version", "optimizer", "accumulated_sums", "controller", "counters"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict)
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expected keys {sorted(expected)} but "
                f"got {keys}; a plain optimizer's state dict belongs to "
                "wrapper.optimizer.load_state_dict"
            )
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(f"unsupported state version {state_dict['version']!r}")
        counters = state_dict["counters"]
        known = {
            "num_batches",
            "num_steps",
            "num_draws",
            "num_skipped",
            "total_count",
            "last_step_num_draws",
            "last_step_count",
            "last_mean_norm_sq",
            "last_reason",
        }
        if set(counters) != known:
            raise ValueError(
                f"checkpoint counters have keys {sorted(counters)}, expected {sorted(known)}"
            )
        self._accumulator.load_state_dict(state_dict["accumulated_sums"], self._params())
        self.controller.load_state_dict(state_dict["controller"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.num_batches = int(counters["num_batches"])
        self.num_steps = int(counters["num_steps"])
        self.num_draws = int(counters["num_draws"])
        self.num_skipped = int(counters["num_skipped"])
        self._total_count = counters["total_count"]
        self.last_step_num_draws = counters["last_step_num_draws"]
        self.last_step_count = counters["last_step_count"]
        self._last_mean_norm_sq = counters["last_mean_norm_sq"]
        self.last_reason = str(counters["last_reason"])
