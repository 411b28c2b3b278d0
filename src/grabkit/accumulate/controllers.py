"""Stepping rules: after each microbatch, is the accumulated gradient good enough to apply?

Every controller reads an :class:`Observation` (statistics already agreed by all ranks) and
returns a 0-dim bool tensor, so the wrapper moves one number to the host per microbatch. Each
rule has one tunable knob (``scheduled_value``) that the schedules in
:mod:`grabkit.accumulate.schedules` drive.

Notation: microbatch i has count c_i (examples or tokens) and mean gradient g_i; the window holds
k microbatches with total count C = sum c_i and weighted mean m = sum c_i g_i / C. For i.i.d.
examples with true gradient G and per-example covariance Sigma,

    E[sum_i c_i |g_i|^2] = C |G|^2 + k tr(Sigma),     E[C |m|^2] = C |G|^2 + tr(Sigma),

so (``window_noise_estimates``) tr(Sigma) and |G|^2 have unbiased estimates from the window alone:
:func:`grabkit.noise.two_batch_estimates` with sum_i c_i |g_i|^2 / C as a small batch of the mean
count C / k and the window mean as the big batch of C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grabkit.accumulate.accumulator import squared_norm
from grabkit.accumulate.student_t import student_t_quantile
from grabkit.noise.averaging import BiasCorrectedEMA
from grabkit.noise.identities import two_batch_estimates
from grabkit.validation import (
    check_non_negative,
    check_positive,
    check_positive_int,
    check_probability,
)

__all__ = [  # noqa: RUF022 (grouped by role, sorted within a group)
    # the extension point and what it is given
    "Controller",
    "Observation",
    "window_noise_estimates",
    # the stepping rules
    "AlwaysStep",
    "MetricHypothesisTest",
    "NoiseScaleController",
    "NormRescale",
    "NormTest",
    "NormThreshold",
    "RelativeNormThreshold",
    "ScheduledBatch",
]


@dataclass
class Observation:
    """What a controller sees after microbatch k of the window (all values agreed across ranks).

    Attributes:
        count: c_k, the microbatch's count (float64, 0-dim).
        total_count: C, the window's total count including this microbatch.
        draws: k, microbatches in the window including this one.
        mean_norm_sq: |m|^2, the squared norm of the window's weighted mean gradient.
        microbatch_norm_sq: |g_k|^2, or None when the controller did not ask for it.
        metric: this microbatch's metric (e.g. loss), or None when not asked for.
    """

    count: torch.Tensor
    total_count: torch.Tensor
    draws: int
    mean_norm_sq: torch.Tensor
    microbatch_norm_sq: torch.Tensor | None = None
    metric: torch.Tensor | None = None


def window_noise_estimates(
    weighted_microbatch_norm_sq: torch.Tensor,
    draws: int,
    total_count: torch.Tensor,
    mean_norm_sq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased (|G|^2, tr Sigma) from one window of ``draws >= 2`` microbatches.

    Args:
        weighted_microbatch_norm_sq: sum_i c_i |g_i|^2.
        draws: k >= 2.
        total_count: C = sum_i c_i.
        mean_norm_sq: |m|^2 of the weighted mean gradient.
    """
    if draws < 2:
        raise ValueError(f"noise estimates need at least 2 microbatches, but got draws={draws}")
    # sum_i c_i |g_i|^2 / C has expectation |G|^2 + tr(Sigma) / (C / k): a "small batch" of the
    # mean count C / k, against the window mean as the big batch of C
    return two_batch_estimates(
        weighted_microbatch_norm_sq / total_count, total_count / draws, mean_norm_sq, total_count
    )


def _to_float(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


class Controller:
    """Base class and extension point: a stepping rule with per-window and per-run state.

    A new rule is one subclass: set ``needs_microbatch_norm`` / ``needs_metric`` when it reads
    those statistics (the wrapper computes them only then), implement :meth:`ready`, keep any
    window state through :meth:`observe` and :meth:`end_window`, name its tunable knob in
    ``scheduled_name`` (an attribute; schedules set it), list fixed options in :meth:`config`
    (a checkpoint of other options is refused) and extend :meth:`state_dict` /
    :meth:`_load_state` with its state. It is then used as
    ``AdaptiveAccumulationWrapper(optimizer, MyRule())``; no registration is needed. Example::

        class EveryK(Controller):
            scheduled_name = "k"
            reason = "every_k"

            def __init__(self, k: int = 4) -> None:
                self.k = k

            def ready(self, obs: Observation) -> bool:
                return obs.draws >= self.k
    """

    needs_microbatch_norm = False
    needs_metric = False
    scheduled_name = "value"
    reason = "rule"

    def observe(self, obs: Observation) -> None:
        """Fold one microbatch's statistics into the window state (before :meth:`ready`)."""

    def ready(self, obs: Observation) -> torch.Tensor | bool:
        """True when the window should be applied now."""
        raise NotImplementedError

    def end_window(self, obs: Observation) -> None:
        """The wrapper stepped on ``obs``: update run state and start a new window."""

    def reset_window(self) -> None:
        """The wrapper discarded the window (a non-finite value): forget its window state,
        keep the run state as it was before the window."""

    def transform_mean_gradient(self, grads: list[torch.Tensor], obs: Observation) -> None:
        """Change the window's mean gradient in place before the inner step (default: no-op).

        ``grads`` are the ``.grad`` tensors of the parameters that have one; ``obs`` is the
        window's last observation (``obs.mean_norm_sq`` is |m|^2 of these gradients).
        """

    def config(self) -> dict:
        """Fixed options a checkpoint must match (the scheduled knob is state, not config)."""
        return {}

    @property
    def scheduled_value(self) -> float:
        return getattr(self, self.scheduled_name)

    @scheduled_value.setter
    def scheduled_value(self, value: float) -> None:
        # a schedule may reach 0 (a threshold annealed to nothing), never below or NaN
        setattr(self, self.scheduled_name, check_non_negative(self.scheduled_name, value))

    def statistics(self) -> dict:
        return {self.scheduled_name: self.scheduled_value}

    def state_dict(self) -> dict:
        return {self.scheduled_name: self.scheduled_value}

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(
                f"{type(self).__name__} state has keys {sorted(state)} but expected "
                f"{sorted(expected)}; was the checkpoint written by a different controller?"
            )
        self._load_state(state)

    def _load_state(self, state: dict) -> None:
        self.scheduled_value = state[self.scheduled_name]


class AlwaysStep(Controller):
    """Step after every microbatch (no accumulation); used by the norm rescaler."""

    reason = "every_microbatch"

    def ready(self, obs: Observation) -> bool:
        return True

    def statistics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def _load_state(self, state: dict) -> None:
        pass


class NormRescale(AlwaysStep):
    """Step after every microbatch with the mean gradient rescaled to ``target_norm`` (GNR).

    ``mode="global"`` scales the whole gradient to total norm ``target_norm``;
    ``"independent"`` scales each parameter's gradient to that norm separately (whole
    parameters only: a shard does not know its parameter's full norm).
    """

    scheduled_name = "target_norm"
    reason = "every_microbatch"
    _MODES = ("global", "independent")

    def __init__(self, target_norm: float = 1.0, mode: str = "global") -> None:
        if mode not in self._MODES:
            raise ValueError(f"`mode` should be 'global' or 'independent', but got mode={mode!r}")
        self.mode = mode
        self.target_norm = check_non_negative("target_norm", target_norm)

    def transform_mean_gradient(self, grads: list[torch.Tensor], obs: Observation) -> None:
        if not grads:
            return
        if self.mode == "global":
            coef = self.target_norm / (obs.mean_norm_sq.sqrt() + 1e-12)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        else:
            for g in grads:
                g.mul_(self.target_norm / (squared_norm([g]).sqrt() + 1e-12).to(g.dtype))

    def config(self) -> dict:
        return {"mode": self.mode}

    def statistics(self) -> dict:
        return {"target_norm": self.target_norm, "mode": self.mode}

    def state_dict(self) -> dict:
        return {"target_norm": self.target_norm, "mode": self.mode}

    def _load_state(self, state: dict) -> None:
        self.target_norm = check_non_negative("target_norm", state["target_norm"])
        if state["mode"] not in self._MODES:
            raise ValueError(f"NormRescale state has an unknown mode {state['mode']!r}")
        self.mode = state["mode"]


class NormThreshold(Controller):
    """Step when the mean gradient is small enough: |m| <= threshold (GQC's GNTS rule).

    Averaging more microbatches shrinks the noise part of |m| like 1/sqrt(C), so the threshold
    sets the gradient's signal-to-noise ratio. It has the gradient's units: not scale-free.
    """

    scheduled_name = "norm_threshold"
    reason = "norm_threshold"

    def __init__(self, norm_threshold: float = 1.0) -> None:
        self.norm_threshold = check_non_negative("norm_threshold", norm_threshold)

    def ready(self, obs: Observation) -> torch.Tensor:
        return obs.mean_norm_sq <= self.norm_threshold**2


class _WindowNormMoments(Controller):
    """Keeps sum_i c_i |g_i|^2 over the window, for the rules that estimate the noise."""

    needs_microbatch_norm = True

    def __init__(self) -> None:
        self._weighted_norm_sq: torch.Tensor | None = None

    def observe(self, obs: Observation) -> None:
        term = obs.count * obs.microbatch_norm_sq
        self._weighted_norm_sq = (
            term if self._weighted_norm_sq is None else (self._weighted_norm_sq + term)
        )

    def end_window(self, obs: Observation) -> None:
        self._weighted_norm_sq = None

    def reset_window(self) -> None:
        self._weighted_norm_sq = None

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["weighted_norm_sq"] = self._weighted_norm_sq
        return state

    def _load_state(self, state: dict) -> None:
        super()._load_state(state)
        self._weighted_norm_sq = state["weighted_norm_sq"]


class RelativeNormThreshold(_WindowNormMoments):
    """Step when |m| <= ratio * (count-weighted RMS of the microbatch norms |g_i|).

    Scale-free: multiplying the loss by any constant leaves the decision unchanged. With pure
    noise |m|^2 / mean |g_i|^2 falls like 1/k, so ``ratio = 0.5`` stops after about 4 equal
    microbatches of noise and at once when the microbatches agree.
    """

    scheduled_name = "ratio"
    reason = "relative_threshold"

    def __init__(self, ratio: float = 0.5) -> None:
        super().__init__()
        self.ratio = check_positive("ratio", ratio)

    def ready(self, obs: Observation) -> torch.Tensor:
        rms_sq = self._weighted_norm_sq / obs.total_count
        return obs.mean_norm_sq <= self.ratio**2 * rms_sq


class NormTest(_WindowNormMoments):
    """The norm test (Byrd et al. 2012): step when tr(Sigma) / C <= theta^2 |m|^2.

    tr(Sigma)/C is the expected squared error of the window mean, so the rule asks that error to
    be at most theta times the gradient's size. Needs two microbatches to estimate tr(Sigma);
    scale-free.
    """

    scheduled_name = "theta"
    reason = "norm_test"

    def __init__(self, theta: float = 1.0) -> None:
        super().__init__()
        self.theta = check_positive("theta", theta)

    def ready(self, obs: Observation) -> torch.Tensor | bool:
        if obs.draws < 2:
            return False
        _, trace = window_noise_estimates(
            self._weighted_norm_sq, obs.draws, obs.total_count, obs.mean_norm_sq
        )
        return trace / obs.total_count <= self.theta**2 * obs.mean_norm_sq


class NoiseScaleController(_WindowNormMoments):
    """Step when the window's count reaches k * B_simple, the gradient noise scale.

    B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) is the batch size at which the noise in
    a step equals its signal; beyond ~B_simple more examples buy little. Each finished window
    gives unbiased (|G|^2, tr Sigma); both are averaged by bias-corrected EMAs and the ratio is
    taken last. Before the first finished window the current window's own estimate is used.
    Every window holds at least ``min_draws >= 2`` microbatches so it can measure the noise.
    B_simple is in the units of the counts passed to ``step(count=...)`` (microbatches when none).
    """

    scheduled_name = "noise_multiplier"
    reason = "noise_scale"

    def __init__(
        self, noise_multiplier: float = 1.0, update_rate: float = 0.2, min_draws: int = 2
    ) -> None:
        super().__init__()
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self.min_draws = check_positive_int("min_draws", min_draws, minimum=2)
        self._grad_sq = BiasCorrectedEMA(update_rate)
        self._trace = BiasCorrectedEMA(update_rate)
        self._last_estimate: torch.Tensor | None = None

    def _current_estimates(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._grad_sq.initialized:
            return self._grad_sq.value, self._trace.value
        if obs.draws >= 2:
            return window_noise_estimates(
                self._weighted_norm_sq, obs.draws, obs.total_count, obs.mean_norm_sq
            )
        return None

    def ready(self, obs: Observation) -> torch.Tensor | bool:
        estimates = self._current_estimates(obs)
        if estimates is None:
            return False
        grad_sq, trace = estimates
        # total_count >= k * trace / grad_sq, written without dividing by a possibly <= 0 grad_sq
        self._last_estimate = trace / grad_sq
        reached = obs.total_count * grad_sq >= self.noise_multiplier * trace
        return (grad_sq > 0) & reached & (obs.draws >= self.min_draws)

    def reset_window(self) -> None:
        super().reset_window()
        if not self._grad_sq.initialized:
            self._last_estimate = None  # it came from the discarded window

    def end_window(self, obs: Observation) -> None:
        if obs.draws >= 2:
            grad_sq, trace = window_noise_estimates(
                self._weighted_norm_sq, obs.draws, obs.total_count, obs.mean_norm_sq
            )
            self._grad_sq.update(grad_sq)
            self._trace.update(trace)
        super().end_window(obs)

    def config(self) -> dict:
        return {"update_rate": self._grad_sq.update_rate, "min_draws": self.min_draws}

    @property
    def noise_scale(self) -> float | None:
        """The current B_simple estimate (a host sync), None before any estimate."""
        if self._grad_sq.initialized:
            return float(self._trace.value / self._grad_sq.value)
        return _to_float(self._last_estimate)

    def statistics(self) -> dict:
        return {"noise_multiplier": self.noise_multiplier, "estimated_gns": self.noise_scale}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(
            min_draws=self.min_draws,
            grad_sq_ema=self._grad_sq.state_dict(),
            trace_ema=self._trace.state_dict(),
            last_estimate=self._last_estimate,
        )
        return state

    def _load_state(self, state: dict) -> None:
        super()._load_state(state)
        self.min_draws = int(state["min_draws"])
        self._grad_sq.load_state_dict(state["grad_sq_ema"])
        self._trace.load_state_dict(state["trace_ema"])
        self._last_estimate = state["last_estimate"]


class MetricHypothesisTest(Controller):
    """Step when a Student-t interval for the mean metric is within a relative tolerance.

    The samples are the running average of past windows' metrics plus this window's k >= 2
    per-microbatch metrics (n = k + 1). Step when

        t_{(1+confidence)/2, n-1} * s / sqrt(n) <= error_tolerance * |mean|,

    i.e. the ``confidence`` interval lies within +-``error_tolerance`` of the mean (GQC's MHT
    rule; ``|mean|`` makes it work for negative metrics too). After a step the running average
    moves toward the window mean by ``ema_alpha``.
    """

    needs_metric = True
    scheduled_name = "error_tolerance"
    reason = "hypothesis_test"

    def __init__(
        self, confidence: float = 0.98, error_tolerance: float = 0.03, ema_alpha: float = 0.01
    ) -> None:
        self.confidence = check_probability("confidence", confidence)
        self.error_tolerance = check_positive("error_tolerance", error_tolerance)
        self.ema_alpha = check_probability("ema_alpha", ema_alpha, allow_one=True)
        self.running_avg_metric: torch.Tensor | None = None
        # window state: the first window starts its running average at its first metric
        self._first: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._sum_sq: torch.Tensor | None = None

    def running_average(self) -> torch.Tensor | None:
        """The running average the test compares with (the first metric before any step)."""
        return self._first if self.running_avg_metric is None else self.running_avg_metric

    def observe(self, obs: Observation) -> None:
        m = obs.metric
        if self._sum is None:
            self._first = m.clone()
        self._sum = m.clone() if self._sum is None else self._sum + m
        self._sum_sq = m * m if self._sum_sq is None else self._sum_sq + m * m

    def ready(self, obs: Observation) -> torch.Tensor | bool:
        if obs.draws < 2:
            return False
        n = obs.draws + 1
        avg = self.running_average()
        mean = (avg + self._sum) / n
        variance = ((avg * avg + self._sum_sq - n * mean * mean) / (n - 1)).clamp_min(0.0)
        half_width = student_t_quantile((1.0 + self.confidence) / 2.0, n - 1) * torch.sqrt(
            variance / n
        )
        return (mean != 0) & (half_width <= self.error_tolerance * mean.abs())

    def end_window(self, obs: Observation) -> None:
        window_mean = self._sum / obs.draws
        self.running_avg_metric = (
            self.ema_alpha * window_mean + (1.0 - self.ema_alpha) * self.running_average()
        )
        self.reset_window()

    def reset_window(self) -> None:
        self._first = self._sum = self._sum_sq = None

    def config(self) -> dict:
        return {"confidence": self.confidence, "ema_alpha": self.ema_alpha}

    def statistics(self) -> dict:
        return {
            "error_tolerance": self.error_tolerance,
            "confidence": self.confidence,
            "running_avg_metric": _to_float(self.running_average()),
        }

    def state_dict(self) -> dict:
        return {
            "error_tolerance": self.error_tolerance,
            "confidence": self.confidence,
            "ema_alpha": self.ema_alpha,
            "running_avg_metric": self.running_avg_metric,
            "first": self._first,
            "sum": self._sum,
            "sum_sq": self._sum_sq,
        }

    def _load_state(self, state: dict) -> None:
        self.error_tolerance = state["error_tolerance"]
        self.confidence = state["confidence"]
        self.ema_alpha = state["ema_alpha"]
        self.running_avg_metric = state["running_avg_metric"]
        self._first, self._sum, self._sum_sq = state["first"], state["sum"], state["sum_sq"]


class ScheduledBatch(Controller):
    """Step when the window's count reaches the logical batch size (GQC's SBC rule).

    The target is rounded to whole microbatches as GQC does: ``target_draws = max(1,
    round(logical / physical))`` and the window closes once its count reaches ``target_draws *
    physical_batch_size`` (with the default count per microbatch, ``physical_batch_size``, that is
    exactly ``target_draws`` microbatches).
    """

    scheduled_name = "target_logical_batch_size"
    reason = "scheduled_batch"

    def __init__(self, physical_batch_size: float, target_logical_batch_size: float) -> None:
        self.physical_batch_size = check_positive("physical_batch_size", physical_batch_size)
        self.target_logical_batch_size = check_positive(
            "target_logical_batch_size", target_logical_batch_size
        )

    @property
    def target_draws(self) -> int:
        return max(1, round(self.target_logical_batch_size / self.physical_batch_size))

    def ready(self, obs: Observation) -> torch.Tensor:
        target = self.target_draws * self.physical_batch_size
        return obs.total_count >= target * (1.0 - 1e-12)

    def config(self) -> dict:
        return {"physical_batch_size": self.physical_batch_size}

    def statistics(self) -> dict:
        return {
            "target_draws": self.target_draws,
            "target_logical_batch_size": self.target_logical_batch_size,
            "physical_batch_size": self.physical_batch_size,
        }

    def state_dict(self) -> dict:
        return {
            "target_logical_batch_size": self.target_logical_batch_size,
            "physical_batch_size": self.physical_batch_size,
        }

    def _load_state(self, state: dict) -> None:
        super()._load_state(state)
        self.physical_batch_size = state["physical_batch_size"]
