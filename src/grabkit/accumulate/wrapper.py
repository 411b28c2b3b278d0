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
also the overflow flag, as GradScaler itself does). Host values (a number count, a metric given as
a number, flags) reach the device through :func:`grabkit.stats.transfer.to_device`: built on the
host and sent from pinned memory without waiting, never a hidden host synchronisation.

Under torch.distributed every statistic is all-reduced first (see
:mod:`grabkit.accumulate.distributed`), so all ranks decide alike; with ``fully_shard`` (FSDP2)
parameters the gradients are shards and norms are summed over ranks. Replicated gradients that
differ across ranks (DDP's ``no_sync()``, accelerate's ``accumulate()``) were not reduced: the
wrapper averages them over the ranks before folding (and warns once that ``no_sync()`` saves
nothing here), so the run is that of the global microbatches.

Window observers (``register_window_observer``; :class:`~grabkit.noise.AccumulationNoiseScale`
with ``optimizer=`` is one) hear of every microbatch folded or dropped, every window discarded and
every window's mean gradient before the wrapper clips or transforms it.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from grabkit.accumulate.accumulator import GradientAccumulator, parameter_squares, squared_norm
from grabkit.accumulate.controllers import Controller, Observation
from grabkit.accumulate.counters import AccumulationCounters
from grabkit.accumulate.distributed import (
    GradientLayout,
    StatisticsReducer,
    average_over_ranks,
    held_by_fully_shard,
    replica_fingerprint,
    replicas_differ,
)
from grabkit.integrations.wiring import check_wiring
from grabkit.sharding import gradient_layout_of, local
from grabkit.state import setting_differences
from grabkit.stats.transfer import to_device
from grabkit.validation import check_choice, check_count, check_positive, check_positive_int

__all__ = ["AdaptiveAccumulationWrapper", "WindowObserver"]

_STATE_VERSION = 2
_COUNTER_NAMES = frozenset(AccumulationCounters.names())
_UNEQUAL_COUNTS = ("warn", "raise")
_RAISED_BY = "AdaptiveAccumulationWrapper(unequal_counts='raise') under torch.distributed"
_EQUAL_WEIGHTS_FIX = (
    "or weigh microbatches as DDP does, equally (the same count on every rank); if each rank's "
    "loss is already divided by the global count, the window is exact: pass "
    "unequal_counts='warn'"
)


class WindowObserver(Protocol):
    """What the wrapper tells an observer (see ``register_window_observer``)."""

    def microbatch_closed(self, folded: bool, count: Any, window_count: Any) -> None:
        """After each ``step()``: the microbatch was folded (its local ``count``, and
        ``window_count`` agreed over the ranks) or dropped (``folded`` False)."""

    def window_discarded(self) -> None:
        """A non-finite window was thrown away."""

    def window_applied(self, means: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``(param, mean gradient)`` of the window about to be applied, before clipping and
        the controller's transform (for sharded parameters, the rank's shard)."""


class _Microbatch(NamedTuple):
    """One microbatch as every rank agreed on it, ready to fold."""

    weight: float | torch.Tensor  # what the gradient is multiplied by when folded
    count: torch.Tensor  # c_k summed over ranks (float64, 0-dim)
    metric: torch.Tensor | None  # count-weighted mean metric over ranks
    norm_sq: torch.Tensor | None  # local |g_k|^2 in true units, when the controller reads it
    averaged: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the gradients to fold
    # instead of ``.grad`` when the ranks' gradients were not reduced (their mean over ranks)


def _shared_with_inner(name: str) -> property:
    """``wrapper.<name>`` *is* ``wrapper.optimizer.<name>``, whatever replaces it later.

    ``Optimizer.load_state_dict`` gives the optimizer new ``param_groups`` and ``state`` objects;
    reading them through the inner optimizer each time keeps a scheduler attached to the wrapper
    acting on the real learning rate after any load. Before the inner optimizer is set (inside
    ``Optimizer.__init__``) the value lives on the wrapper.
    """

    def get(self: Any) -> Any:
        inner = self.__dict__.get("optimizer")
        return self.__dict__[f"_own_{name}"] if inner is None else getattr(inner, name)

    def set_(self: Any, value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is None:
            self.__dict__[f"_own_{name}"] = value
        else:
            setattr(inner, name, value)

    return property(get, set_, doc=f"The inner optimizer's ``{name}`` (the same object).")


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
            :mod:`grabkit.accumulate.distributed`; by default read from the parameters
            (``fully_shard``'s ``DTensor`` parameters are sharded, plain ones replicated).
            ``FullyShardedDataParallel`` (FSDP1) parameters are refused.
        unequal_counts: what to do when the ranks count different weights for one microbatch
            under torch.distributed (DDP and ``fully_shard`` average the ranks' gradients with
            equal weights, so the count-weighted window is the global microbatch's only if each
            rank's loss was divided by the global count): ``"warn"`` once (the default: the
            wrapper cannot tell how the losses were normalised), or ``"raise"`` a ValueError on
            every rank before anything of that microbatch is folded or applied. Detected in the
            all-reduce the wrapper makes anyway (no extra collective); see
            :meth:`set_unequal_counts`.

    The counters (``num_batches``, ``num_steps``, ``num_draws``, ``num_skipped``,
    ``last_step_num_draws``, ``last_step_count``, ``last_reason``, ...) are the fields of
    ``wrapper.counters``, an :class:`~grabkit.accumulate.counters.AccumulationCounters`, and
    readable as attributes of the wrapper. ``scheduled_value`` is the controller's knob, which
    :class:`~grabkit.accumulate.schedules.ValueSchedule` drives.

    Microbatches that are dropped, not folded (``step`` returns False and ``last_reason`` says
    why): ``"no_gradient"`` when no parameter has a ``.grad`` (``zero_grad()`` after backward,
    or ``step()`` without backward: the count is discarded too); ``"overflow_skipped"`` when a
    GradScaler found inf/NaN. Without a GradScaler, a non-finite gradient or metric is only seen
    once folded: the whole window is then discarded, with a RuntimeWarning and reason
    ``"nonfinite_skipped"`` (``num_skipped`` grows by the window's size), so nothing non-finite
    reaches the parameters. A tensor ``count`` that is not positive and finite raises a
    ValueError, as a number does (checking a tensor's value reads it on the host once more).

    Example (one ``step`` per microbatch; no ``zero_grad``: the wrapper clears what it folded)::

        optimizer = AdaptiveAccumulationWrapper(torch.optim.AdamW(model.parameters()), NormTest())
        for inputs, labels in loader:
            loss_fn(model(inputs), labels).backward()
            if optimizer.step(count=len(labels)):  # True when AdamW stepped
                print(optimizer.last_step_num_draws, "microbatches in that update")
        optimizer.flush()  # apply the window still accumulating at the end
    """

    _step_supports_amp_scaling = True
    param_groups = _shared_with_inner("param_groups")
    state = _shared_with_inner("state")
    defaults = _shared_with_inner("defaults")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        controller: Controller,
        *,
        max_batch_draws: int = 64,
        default_count: float = 1.0,
        clip_grad_norm: float | None = None,
        process_group: Any = None,
        gradient_layout: GradientLayout | None = None,
        unequal_counts: str = "warn",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` should be a torch.optim.Optimizer, but got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, AdaptiveAccumulationWrapper):
            raise TypeError("`optimizer` is already an adaptive accumulation wrapper")
        if not isinstance(controller, Controller):
            raise TypeError(f"`controller` should be a Controller, but got {type(controller)}")
        self.max_draws = check_positive_int("max_batch_draws", max_batch_draws)
        if clip_grad_norm is not None:
            clip_grad_norm = check_positive("clip_grad_norm", clip_grad_norm)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        gradient_layout = _check_layout(params, gradient_layout, controller)
        super().__init__([{"params": params}], dict(optimizer.defaults))
        # from here on param_groups / state / defaults are the inner optimizer's own objects
        self.optimizer = optimizer
        for name in ("param_groups", "state", "defaults"):
            del self.__dict__[f"_own_{name}"]

        self.controller = controller
        if isinstance(default_count, torch.Tensor):
            raise ValueError("`default_count` should be a Python number, but got a tensor")
        self.default_count = default_count
        self.clip_grad_norm = clip_grad_norm
        self.set_unequal_counts(unequal_counts)
        self._reducer = StatisticsReducer(process_group, gradient_layout)
        self._accumulator = GradientAccumulator()
        self.counters = AccumulationCounters()
        self.last_closure_loss: Any = None
        self.last_optimizer_result: Any = None  # what the inner optimizer's step returned
        # the state loaded last was saved right after flush(): the next step() warns
        self.continues_a_flush = False
        self._observers: OrderedDict[int, WindowObserver] = OrderedDict()  # weak-referenceable

    def register_window_observer(self, observer: WindowObserver) -> RemovableHandle:
        """Tell ``observer`` (a :class:`WindowObserver`) of every microbatch and window from now
        on; ``handle.remove()`` stops it. Observers only read: they never change what the
        wrapper applies."""
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = observer
        return handle

    @property
    def unequal_counts(self) -> str:
        """``"warn"`` or ``"raise"``: see the constructor and :meth:`set_unequal_counts` (setting
        it keeps the error's ``raised_by`` and ``fix``)."""
        return self._unequal_counts

    @unequal_counts.setter
    def unequal_counts(self, mode: str) -> None:
        self._unequal_counts = check_choice("unequal_counts", mode, _UNEQUAL_COUNTS)

    @property
    def default_count(self) -> float | torch.Tensor:
        """The weight of a microbatch when ``step`` gets no ``count``: a positive finite number,
        or a one-element tensor (its value checked with the step's statistics). The integrations
        set it before each microbatch (Trainer's items, Lightning's ``count_fn``); it is checked
        as it is set, so a zero, negative or NaN weight is refused, never folded in."""
        return self._default_count

    @default_count.setter
    def default_count(self, value: float | torch.Tensor) -> None:
        self._default_count = check_count("default_count", value)

    def set_unequal_counts(
        self, mode: str, *, raised_by: str | None = None, fix: str | None = None
    ) -> None:
        """Warn (``mode="warn"``) or raise (``"raise"``) when the ranks count different weights
        for one microbatch.

        An integration that knows how its losses are normalised sets ``"raise"`` and says who
        refuses and how to fix it in its own terms: the ValueError starts with ``raised_by`` (by
        default ``"AdaptiveAccumulationWrapper(unequal_counts='raise') under torch.distributed"``)
        and ends with ``fix``, the alternative to equal local batches (by default: equal counts
        on every rank, or ``unequal_counts='warn'`` when each rank's loss is divided by the
        global count).
        """
        self._unequal_counts = check_choice("unequal_counts", mode, _UNEQUAL_COUNTS)
        self._unequal_counts_raised_by = _RAISED_BY if raised_by is None else raised_by
        self._unequal_counts_fix = _EQUAL_WEIGHTS_FIX if fix is None else fix

    # ----------------------------------------------------------------- forwarding
    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this object lacks: counters, then the inner optimizer
        if name in _COUNTER_NAMES and "counters" in self.__dict__:
            return getattr(self.__dict__["counters"], name)
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(optimizer, name)

    @property
    def scheduled_value(self) -> float:
        """The controller's knob (norm threshold, theta, noise multiplier, ...): what
        :class:`~grabkit.accumulate.schedules.ValueSchedule` sets."""
        return self.controller.scheduled_value

    @scheduled_value.setter
    def scheduled_value(self, value: float) -> None:
        self.controller.scheduled_value = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer, which fills in its own defaults."""
        inner = self.__dict__.get("optimizer")
        if inner is None:  # Optimizer.__init__ of the wrapper itself
            super().add_param_group(param_group)
        else:
            inner.add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the microbatch in ``.grad`` (if any); the accumulated window is untouched.

        Gradients are always set to None, whatever ``set_to_none`` says: a zero ``.grad``
        would be folded as a microbatch whose gradient is zero, while None tells ``step`` that
        there is nothing to fold (it then returns False with reason ``"no_gradient"``).
        """
        self.optimizer.zero_grad(set_to_none=True)

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
            count: this microbatch's weight in the average (examples, tokens; a positive finite
                number or a one-element tensor); ``default_count`` when None. Under
                torch.distributed pass the local count: the microbatch's weight is the sum over
                ranks.
            metric: this microbatch's metric (loss) for controllers that read one.
        Returns:
            True when the inner optimizer stepped.
        """
        return self._accumulate_step(closure, count, metric)

    def _warn_continued_flush(self) -> None:
        """Warn once that this run continues a state saved right after :meth:`flush`.

        The flush applied a partial window early; a run that ended there (the flush at the end
        of training) and is continued from that state keeps the early update, which the
        uninterrupted longer run never made: it accumulated on. The state cannot tell that
        flush from one the loop makes at the same place in every run (which continues
        exactly), so this warns rather than refuses; an integration that says so in its own
        terms clears ``continues_a_flush`` first.
        """
        self.continues_a_flush = False
        warnings.warn(
            f"{type(self).__name__}: this run continues from a state saved right after flush() "
            f"applied a partial window ({self.counters.last_step_num_draws} microbatches) "
            "early. If the run that saved it flushed because it ended there, this continuation "
            "keeps that early update and is not the uninterrupted longer run, which would have "
            "accumulated on. For an exact continuation, save the state before flush() at the "
            "end of training (it then holds the open window).",
            UserWarning,
            stacklevel=5,  # the loop's step(): through Optimizer's hook wrapper and step
        )

    def _accumulate_step(
        self,
        closure: Callable[[], Any] | None,
        count: float | torch.Tensor | None,
        metric: float | torch.Tensor | None,
    ) -> bool:
        # Subclasses with another step signature call this, not super().step(): Optimizer wraps
        # every class's own ``step`` with the hook runner, so hooks would fire twice.
        if self.continues_a_flush:
            self._warn_continued_flush()
        if not getattr(self, "_wiring_checked", False):  # a framework clipping every microbatch
            self._wiring_checked = True
            check_wiring(self, "adaptive")
        if closure is not None:
            with torch.enable_grad():
                self.last_closure_loss = closure()
            if metric is None:
                metric = self.last_closure_loss
        count = self.default_count if count is None else check_count("count", count)
        params = self._params()
        pending = self._accumulator.pending_gradients(params)
        device = pending[0][1].device if pending else params[0].device
        microbatch = self._agree_on_microbatch(pending, count, self._metric(metric), device)
        if isinstance(microbatch, str):
            return self._drop_microbatch(params, microbatch)
        if microbatch.averaged is not None:
            pending = microbatch.averaged
        obs = self._fold(pending, microbatch, device)
        for observer in list(self._observers.values()):
            observer.microbatch_closed(True, count, microbatch.count)
        reason = self._decide(obs)
        self.counters.last_reason = reason
        if reason == "nonfinite_skipped":
            self._drop_window()
            return False
        if reason == "accumulating":
            return False
        self._apply(obs)
        return True

    def _metric(self, metric: float | torch.Tensor | None) -> torch.Tensor | None:
        """The metric as a 0-dim float64 tensor when the controller reads one, else None."""
        if not self.controller.needs_metric:
            return None
        if metric is None:
            raise ValueError(
                f"{type(self.controller).__name__} decides on a metric: call "
                "step(metric=loss) (or pass a closure that returns the loss)"
            )
        return torch.as_tensor(
            metric.detach() if isinstance(metric, torch.Tensor) else metric, dtype=torch.float64
        ).reshape(())

    def _microbatch_squares(
        self, pending: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> torch.Tensor | None:
        """(n,) |g_p|^2 of this rank's microbatch gradients in true units, float64, when the
        controller reads the microbatch norm or the ranks must compare their gradients."""
        if not pending or not (self.controller.needs_microbatch_norm or self._compares_replicas()):
            return None
        squares = to_device(parameter_squares([local(g) for _, g in pending]), device)
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step for this call
        if grad_scale is not None:
            squares = squares * to_device(grad_scale.double().reciprocal(), device).square()
        return squares

    def _compares_replicas(self) -> bool:
        """Whether every microbatch's gradient is checked to be the same on every rank: several
        ranks holding whole (replicated) gradients."""
        return self._reducer.world_size > 1 and self._reducer.gradient_layout == "replicated"

    def _agree_on_microbatch(
        self,
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        count: float | torch.Tensor,
        metric: torch.Tensor | None,
        device: torch.device,
    ) -> _Microbatch | str:
        """The microbatch as all ranks see it, or the reason to drop it.

        Single process, no GradScaler, a plain-number count: no tensor is even created and
        nothing is read by the host. Otherwise one small vector (count, count * metric, the
        overflow, invalid-count and no-gradient flags, and with replicated gradients a
        fingerprint of the gradient) is summed over ranks and read once, so every rank drops,
        raises or folds alike. Replicated gradients that differ across ranks were not reduced
        (DDP's ``no_sync()``, accelerate's ``accumulate()``, no DDP at all): the wrapper then
        averages them over the ranks itself, so that what it folds and decides on is the
        microbatch of all ranks, as DDP would have reduced it.
        """
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        grad_scale = getattr(self, "grad_scale", None)
        squares = self._microbatch_squares(pending, device)
        norm_sq = squares.sum() if self.controller.needs_microbatch_norm and pending else None
        world = self._reducer.world_size
        held = not pending and self._reducer.gradient_layout == "sharded"
        held = held and held_by_fully_shard(self._params())
        if world == 1 and found_inf is None and not isinstance(count, torch.Tensor):
            if held:
                _refuse_unreduced_shards(1, 1)
            if not pending:
                return "no_gradient"
            global_count = to_device(torch.tensor(count, dtype=torch.float64), device)
            return _Microbatch(
                count, global_count, None if metric is None else to_device(metric, device), norm_sq
            )
        head = to_device(self._host_head(count, not pending, held), device)
        if isinstance(count, torch.Tensor):
            head[0] = to_device(count, device)
            head[3] = ~(torch.isfinite(head[0]) & (head[0] > 0))
        head[7] = head[0].square()  # summed: tells whether the ranks counted alike
        if metric is not None:
            head[1] = head[0] * to_device(metric, device)
        if found_inf is not None:
            head[2] = to_device(found_inf, device).to(torch.float64)
        if squares is not None and self._compares_replicas():  # never with ``held``
            head[5:7] = replica_fingerprint(squares, self._indices_of(pending, device))
        self._reducer.sum(head)
        total, _, overflow, invalid, empty, fingerprint, fingerprint_sq, count_sq = head.tolist()
        if self._reducer.gradient_layout == "sharded" and fingerprint > 0:
            _refuse_unreduced_shards(int(fingerprint), world)
        reason = self._drop_reason(count, overflow, invalid, empty)
        if reason is not None:
            return reason
        if world > 1 and world * count_sq > total * total * (1.0 + 1e-12):
            self._unequal_counts_found(count, total, world)
        inverse_scale = None if grad_scale is None else grad_scale.double().reciprocal()
        weight = head[0] if inverse_scale is None else head[0] * inverse_scale
        metric = None if metric is None else head[1] / head[0]
        if not (self._compares_replicas() and replicas_differ(fingerprint, fingerprint_sq, world)):
            return _Microbatch(weight, head[0], metric, norm_sq)
        self._warn_unreduced()
        averaged = average_over_ranks(self._reducer, self._params(), dict(pending), inverse_scale)
        if norm_sq is not None:  # the averaged microbatch's, the same on every rank
            norm_sq = to_device(squared_norm([g for _, g in averaged]), device)
        return _Microbatch(head[0], head[0], metric, norm_sq, averaged)

    def _indices_of(
        self, pending: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> torch.Tensor:
        position = {p: i for i, p in enumerate(self._params())}
        return to_device(torch.tensor([position[p] for p, _ in pending]), device)

    @staticmethod
    def _host_head(count: float | torch.Tensor, empty: bool, held: bool) -> torch.Tensor:
        """(8,) float64 on the host: what the host knows of the statistics vector (the count
        when it is a number, the no-gradient flag, and under sharding whether ``fully_shard``
        holds the gradient back), sent to the device in one copy that does not wait."""
        head = torch.zeros(8, dtype=torch.float64)
        if not isinstance(count, torch.Tensor):
            head[0] = count
        head[4] = float(empty)
        head[5] = float(held)  # sharded: the ranks whose gradient fully_shard holds back
        return head

    def _warn_unreduced(self) -> None:
        if getattr(self, "_warned_unreduced", False):
            return
        self._warned_unreduced = True
        warnings.warn(
            "the microbatch gradients differ across ranks: they were not all-reduced "
            "(DistributedDataParallel.no_sync(), accelerate's accumulate() or no_sync(), or a "
            "model without DDP), so the wrapper averages them over the ranks itself, one "
            "all-reduce per such microbatch: decisions and updates are those of the global "
            "microbatches. no_sync() saves nothing here (the wrapper decides after every "
            "microbatch, so each one is reduced): leave it out and let DDP overlap the "
            "all-reduce with the backward",
            RuntimeWarning,
            stacklevel=4,
        )

    def _unequal_counts_found(self, count: float | torch.Tensor, total: float, world: int) -> None:
        """The ranks counted different weights for one microbatch (sum c_r^2 > (sum c_r)^2 / W).

        DDP (and ``fully_shard``) average the ranks' gradients with equal weights, while the
        window weighs the microbatch by the summed count: exact when each rank's loss was
        normalised by the global count, misweighted when each rank's loss is its own mean. The
        wrapper cannot tell the two apart, so it says so once, or with ``unequal_counts="raise"``
        refuses the microbatch: every rank read the same sums, so every rank raises, after the
        backward (whose gradient stays in ``.grad``) and before anything of it is folded or any
        update applied.
        """
        shown = float(count) if isinstance(count, torch.Tensor) else count
        if self._unequal_counts == "raise":
            raise ValueError(
                f"{self._unequal_counts_raised_by}: the ranks counted different weights for "
                f"this microbatch (this rank {shown:g}, the mean {total / world:g} over {world} "
                "ranks), but DistributedDataParallel and fully_shard average the ranks' "
                "gradients with equal weights, so the count-weighted window would not be the "
                "mean over the global microbatch's examples or tokens; nothing of this "
                "microbatch was folded and no update applied it. Fix: give every rank "
                "microbatches of the same count (the same local batch size: DistributedSampler "
                "pads the last batch; or drop_last=True when only the last batch differs), "
                f"{self._unequal_counts_fix}"
            )
        if getattr(self, "_warned_unequal_counts", False):
            return
        self._warned_unequal_counts = True
        warnings.warn(
            f"the ranks counted different weights for one microbatch (this rank {shown:g}, "
            f"the mean {total / world:g} over {world} ranks). DistributedDataParallel and "
            "fully_shard average the ranks' gradients with equal weights, so the window holds "
            "the global microbatch's gradient only if each rank's loss was divided by the "
            "global count (as Hugging Face's Trainer does with num_items_in_batch); if each "
            "rank's loss is its own mean, the window is misweighted. Fix: equal local batches "
            "(DistributedSampler pads them), or scale each rank's loss by count * world_size / "
            "global count; or, when the weights differ only in the last batch, drop_last=True; "
            "unequal_counts='raise' refuses such microbatches instead",
            RuntimeWarning,
            stacklevel=4,
        )

    def _drop_reason(
        self, count: float | torch.Tensor, overflow: float, invalid: float, empty: float
    ) -> str | None:
        """Raise for a bad count or a rank without gradient, name why to drop, or None."""
        world = self._reducer.world_size
        if invalid > 0:
            where = f" on {int(invalid)} of {world} ranks" if world > 1 else ""
            shown = float(count) if isinstance(count, torch.Tensor) else count
            raise ValueError(
                "`count` should be a positive finite number (examples or tokens), but got "
                f"count={shown!r}{where}; nothing was folded"
            )
        if 0 < empty < world:
            raise RuntimeError(
                f"{int(empty)} of {world} ranks have no gradient for this microbatch while the "
                "others do; every rank must run backward before step() (or none, to discard it)"
            )
        if empty > 0:
            return "no_gradient"
        if overflow > 0:
            return "overflow_skipped"
        return None

    def _fold(
        self,
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        microbatch: _Microbatch,
        device: torch.device,
    ) -> Observation:
        """Add the microbatch to the window and show the controller the window's statistics."""
        self._accumulator.fold(pending, microbatch.weight)
        counters = self.counters
        counters.total_count = (
            microbatch.count
            if counters.total_count is None
            else counters.total_count + microbatch.count
        )
        counters.num_draws += 1
        counters.num_batches += 1
        sum_norm_sq, microbatch_norm_sq = self._agree_on_norms(
            to_device(self._accumulator.sum_squared_norm(), device),
            microbatch.norm_sq,
        )
        obs = Observation(
            count=microbatch.count,
            total_count=counters.total_count,
            draws=counters.num_draws,
            mean_norm_sq=sum_norm_sq / counters.total_count.square(),
            microbatch_norm_sq=microbatch_norm_sq,
            metric=microbatch.metric,
        )
        self.controller.observe(obs)
        return obs

    def _decide(self, obs: Observation) -> str:
        """``"accumulating"``, ``"nonfinite_skipped"`` or the reason to step now.

        The rule's flag and the window's finiteness (|m|^2 and the metric) travel to the host
        together: one transfer per microbatch. A flag the host already holds (a full window, or
        a rule that decided on host numbers) is not sent to the device: only finiteness is read.
        """
        finite = torch.isfinite(obs.mean_norm_sq)
        if obs.metric is not None:
            finite = finite & torch.isfinite(obs.metric)
        at_max = self.counters.num_draws >= self.max_draws
        ready = True if at_max else self.controller.ready(obs)
        if isinstance(ready, torch.Tensor):
            flags = torch.stack([finite, to_device(ready, finite.device).to(torch.bool)])
            is_finite, is_ready = flags.tolist()  # host sync
        else:
            is_finite, is_ready = bool(finite), bool(ready)  # host sync
        if not is_finite:
            return "nonfinite_skipped"
        if at_max:
            return "max_batch_draws"
        return self.controller.reason if is_ready else "accumulating"

    def _drop_window(self) -> None:
        """A non-finite gradient or metric reached the window: discard the whole window.

        The sums cannot be un-poisoned, so the window's earlier microbatches go too; nothing
        non-finite ever reaches the parameters, and the next microbatch starts a fresh window.
        """
        counters = self.counters
        dropped = counters.num_draws
        self._accumulator.discard()
        self.controller.reset_window()
        counters.num_batches -= dropped
        counters.num_skipped += dropped
        counters.num_draws = 0
        counters.total_count = None
        for observer in list(self._observers.values()):
            observer.window_discarded()
        warnings.warn(
            f"a microbatch's gradient or metric is not finite (NaN or inf): the accumulation "
            f"window ({dropped} microbatch(es), this one included) was discarded and nothing was "
            "applied; check the loss, or use a GradScaler, which skips overflowing microbatches "
            "alone",
            RuntimeWarning,
            stacklevel=4,
        )

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

    def _drop_microbatch(self, params: list[torch.Tensor], reason: str) -> bool:
        for p in params:
            p.grad = None
        for observer in list(self._observers.values()):
            observer.microbatch_closed(False, None, None)
        if reason != "no_gradient":
            self.counters.num_skipped += 1
        self.counters.last_reason = reason
        return False

    def _transform_mean_gradient(self, grads: list[torch.Tensor], obs: Observation) -> None:
        """The controller's transform (e.g. rescaling), then the optional clipping, in place
        (on this rank's part of each gradient: the whole of it, or its shard)."""
        self.controller.transform_mean_gradient(grads, obs)
        if self.clip_grad_norm is not None and grads:
            total_norm = obs.mean_norm_sq.sqrt()  # of the mean before the controller's transform
            coef = (self.clip_grad_norm / (total_norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))

    def flush(self) -> bool:
        """Apply the partially accumulated window now (e.g. at the end of training).

        A loop ends with the microbatches folded since the last step still waiting; ``flush``
        steps the inner optimizer on their exact weighted mean (clipping and the controller's
        transform apply as usual) and returns True, or returns False when the window is empty.
        Collective under torch.distributed: call it on every rank. ``last_reason`` becomes
        ``"flushed"``. To continue the run later exactly, save ``state_dict()`` before the flush
        (it holds the open window); a state saved after it holds the early update, and the
        continued run's first ``step`` warns.
        """
        counters = self.counters
        if counters.num_draws == 0:
            return False
        total = counters.total_count
        sum_norm_sq, _ = self._agree_on_norms(
            to_device(self._accumulator.sum_squared_norm(), total.device), None
        )
        obs = Observation(
            count=total,
            total_count=total,
            draws=counters.num_draws,
            mean_norm_sq=sum_norm_sq / total.square(),
        )
        self._apply(obs)
        counters.last_reason = "flushed"
        return True

    def _apply(self, obs: Observation) -> None:
        means = self._accumulator.write_mean(self.counters.total_count)
        for observer in list(self._observers.values()):
            observer.window_applied(means)
        self._transform_mean_gradient([mean for _, mean in means], obs)
        self.last_optimizer_result = self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.controller.end_window(obs)
        counters = self.counters
        counters.last_step_num_draws = counters.num_draws
        counters.last_mean_norm_sq = obs.mean_norm_sq
        counters.last_step_count = counters.total_count
        counters.num_steps += 1
        counters.num_draws = 0
        counters.total_count = None

    # ----------------------------------------------------------------- reporting
    def statistics(self) -> dict[str, Any]:
        """Counters and the controller's knobs, for logging (converting tensors syncs once).

        Keys as in GQC, which reads them *before* each microbatch: ``batches`` and
        ``num_draws`` count the microbatch about to be processed (1-based), so at the moment a
        step happens ``num_draws`` read just before it is the window's size. Also:
        ``accumulated_draws`` (folded so far), ``accumulated_count``, ``skipped_batches``
        (dropped on overflow or a non-finite value) and ``reason`` (why the last ``step`` call
        did or did not step: ``accumulating``, ``max_batch_draws``, ``overflow_skipped``,
        ``nonfinite_skipped``, ``no_gradient`` or the rule's name).
        """
        c = self.counters
        norm_sq = c.last_mean_norm_sq
        stats: dict[str, Any] = {
            "batches": c.num_batches + 1,
            "steps": c.num_steps,
            "num_draws": c.num_draws + 1,
            "last_mean_grad_norm": None if norm_sq is None else float(norm_sq.sqrt()),
            "last_step_num_draws": c.last_step_num_draws,
            "accumulated_draws": c.num_draws,
            "accumulated_count": (0.0 if c.total_count is None else float(c.total_count)),
            "skipped_batches": c.num_skipped,
            "reason": c.last_reason,
        }
        stats.update(self.controller.statistics())
        return stats

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__}: controller={type(self.controller).__name__}, "
            f"batches={self.counters.num_batches}, steps={self.counters.num_steps}, "
            f"core={type(self.optimizer).__name__}>"
        )

    # ----------------------------------------------------------------- checkpoints
    def _config(self) -> dict[str, Any]:
        """What must match for a checkpoint to continue this run exactly.

        ``default_count`` is not part of it: it only weighs microbatches still to come (the saved
        window holds weighted sums), and integrations set it per call. Nor is ``unequal_counts``:
        a check, which changes nothing the wrapper computes, and which integrations set.
        """
        return {
            "controller": type(self.controller).__name__,
            "controller_config": self.controller.config(),
            "max_batch_draws": self.max_draws,
            "clip_grad_norm": self.clip_grad_norm,
            "gradient_layout": self._reducer.gradient_layout,
        }

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, the partial accumulation, counters, controller state and the
        configuration a load must match.

        Only tensors, numbers, strings, lists, dicts and None: ``torch.load(weights_only=True)``
        reads it back.
        """
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "optimizer": self.optimizer.state_dict(),
            "accumulated_sums": self._accumulator.state_dict(self._params()),
            "controller": self.controller.state_dict(),
            "counters": self.counters.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, including a partially accumulated window.

        Refuses (ValueError, nothing changed) a checkpoint of another controller or another
        configuration (``max_batch_draws``, ``clip_grad_norm``, gradient
        layout, the controller's fixed options); the scheduled value is restored. A state saved
        right after :meth:`flush` sets ``continues_a_flush``: the next ``step`` warns that a run
        that ended with that flush is not continued exactly (save before the flush instead).
        """
        expected = {"version", "config", "optimizer", "accumulated_sums", "controller", "counters"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict)
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expected keys {sorted(expected)} but "
                f"got {keys}; a plain optimizer's state dict belongs to "
                "wrapper.optimizer.load_state_dict"
            )
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(
                f"unsupported state version {state_dict['version']!r} (this grabkit reads "
                f"version {_STATE_VERSION})"
            )
        self._check_config(state_dict["config"])
        counters = AccumulationCounters.from_state_dict(state_dict["counters"])
        self._accumulator.load_state_dict(state_dict["accumulated_sums"], self._params())
        self.controller.load_state_dict(state_dict["controller"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.counters = counters
        self.continues_a_flush = counters.last_reason == "flushed"

    def _check_config(self, saved: dict[str, Any]) -> None:
        mine = self._config()
        if saved.get("controller") != mine["controller"]:
            raise ValueError(
                f"the checkpoint was written with controller {saved.get('controller')!r}, but "
                f"this wrapper uses {mine['controller']!r}: a different controller's state "
                "cannot continue this run"
            )
        detail = setting_differences(saved, mine)
        if detail:
            raise ValueError(
                f"the checkpoint's configuration differs from this wrapper's ({detail}); build "
                "the wrapper with the checkpoint's options to resume"
            )


def _refuse_unreduced_shards(ranks: int, world: int) -> None:
    where = f" on {ranks} of {world} ranks" if world > 1 else ""
    raise ValueError(
        f"fully_shard holds this microbatch's gradient unreduced{where} "
        "(set_requires_gradient_sync(False)), so .grad is empty now and the next synchronised "
        "backward would bring several microbatches' gradients as one: the adaptive wrapper "
        "cannot weigh or decide on them. Keep gradient sync on (the default) and step the "
        "wrapper after every microbatch: it accumulates and decides itself"
    )


def _check_layout(
    params: list[torch.Tensor], layout: GradientLayout | None, controller: Controller
) -> GradientLayout:
    """The gradient layout to combine norms with: the parameters', or the one given if they
    allow it; a controller that needs whole parameters refuses shards."""
    found = gradient_layout_of(params, "AdaptiveAccumulationWrapper")
    if layout is None:
        layout = found
    elif found == "sharded" and layout != "sharded":
        raise ValueError(
            f"gradient_layout={layout!r}, but the parameters are sharded DTensors "
            "(fully_shard): their gradients are shards whose squared norms add up over ranks; "
            "leave gradient_layout unset (or pass 'sharded')"
        )
    if layout == "sharded" and getattr(controller, "mode", None) == "independent":
        raise ValueError(
            f"{type(controller).__name__}(mode='independent') rescales each parameter by its "
            "own norm, which a shard does not know; use mode='global' with sharded gradients"
        )
    return layout
