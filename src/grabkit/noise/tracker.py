"""Averaging per-step (|G|^2, tr Sigma) estimates into a ``NoiseScaleResult`` with an interval.

Every estimator in ``grabkit.noise`` turns one step into unbiased estimates of |G|^2 and
tr(Sigma) per parameter block (via ``two_batch_estimates``) and hands them to a
``NoiseScaleTracker``. The tracker keeps bias-corrected EMAs of both (numerator and denominator
separately; the ratio is taken only when reporting), plus the second moments of the totals, from
which it derives the uncertainty of the averages and Fieller's confidence interval for the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

from grabkit.noise.averaging import BiasCorrectedEMA
from grabkit.noise.estimator import NoiseEstimator
from grabkit.noise.result import NoiseScaleResult
from grabkit.state import Stateful
from grabkit.stats.transfer import to_device
from grabkit.validation import check_positive, check_positive_int, check_probability

__all__ = ["NoiseScaleTracker", "TrackedEstimator", "ratio_interval"]

_WINDOWS = ("steps", "examples")


def ratio_interval(
    numerator: float,
    denominator: float,
    var_numerator: float,
    var_denominator: float,
    covariance: float,
    confidence: float,
) -> tuple[float, float]:
    """Fieller's confidence interval for numerator / denominator.

    The estimates are taken as jointly normal with the given (co)variances. The interval is the
    set of ratios R with (T - R G)^2 <= z^2 Var(T - R G); it is bounded only when the denominator
    (|G|^2, positive in truth) is significantly positive, otherwise ``(-inf, inf)`` is returned.
    """
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    z2 = z * z
    # the quadratic's terms are squares of the inputs: put the inputs near 1 by a power of two
    # (exact, so the interval is unchanged) lest those squares underflow or overflow
    largest = max(abs(numerator), abs(denominator), math.sqrt(var_numerator + var_denominator))
    if 0.0 < largest < math.inf:
        shift = -math.frexp(largest)[1]
        numerator, denominator = math.ldexp(numerator, shift), math.ldexp(denominator, shift)
        var_numerator, var_denominator = (
            math.ldexp(var_numerator, 2 * shift),
            math.ldexp(var_denominator, 2 * shift),
        )
        covariance = math.ldexp(covariance, 2 * shift)
    a = denominator * denominator - z2 * var_denominator
    if denominator <= 0.0 or a <= 0.0:
        return (-math.inf, math.inf)
    half_b = numerator * denominator - z2 * covariance
    c = numerator * numerator - z2 * var_numerator
    disc = max(half_b * half_b - a * c, 0.0)
    root = math.sqrt(disc)
    return ((half_b - root) / a, (half_b + root) / a)


class NoiseScaleTracker(Stateful):
    """Bias-corrected EMAs of per-block |G|^2 and tr(Sigma), reported as a ``NoiseScaleResult``.

    Args:
        update_rate: weight of the newest observation, as in ALF's ``ScalarEMAverager``: per step
            when ``window="steps"``, per example when ``window="examples"`` (a step of n examples
            then weighs like n single-example steps).
        window: "steps" or "examples", the unit ``update_rate`` is measured in.
        confidence: coverage of the reported interval for B_simple, in (0, 1).
        block_names: names of the P parameter blocks the observations are split into.
        population_size: N, when each step's batches are drawn *without* replacement from a data
            set of N examples (epochs of a shuffled loader). The two-batch identities then
            return tr(Sigma) N / (N - 1) and |G|^2 - tr(Sigma) / (N - 1) on average; the tracker
            undoes that (finite-population correction). None: batches drawn with replacement or
            N large enough not to matter (the bias of B_simple is about B_simple / N).

    ``last_observation`` holds the newest step's raw (|G|^2, tr Sigma) per block, (P,) each
    (not saved in ``state_dict``).
    """

    def __init__(
        self,
        update_rate: float,
        window: str = "steps",
        confidence: float = 0.95,
        block_names: Sequence[str] = ("all",),
        population_size: int | None = None,
    ) -> None:
        if window not in _WINDOWS:
            raise ValueError(f"window should be one of {_WINDOWS}, but got window={window!r}")
        confidence = check_probability("confidence", confidence)
        if len(block_names) == 0:
            raise ValueError("block_names should name at least one parameter block, but is empty")
        if population_size is not None:  # the data set size
            check_positive_int("population_size", population_size, minimum=2)
        self.population_size = population_size
        self.window = window
        self.confidence = float(confidence)
        self.block_names = tuple(str(n) for n in block_names)
        # one EMA over (2P + 3,): |G|^2 per block, tr(Sigma) per block, then G^2, T^2 and G*T of
        # the totals (the second moments behind the interval)
        averages = BiasCorrectedEMA(update_rate)
        # what a checkpoint must match: the averaging and the reported interval
        self.add_config("window", self.window)
        self.add_config("confidence", self.confidence)
        self.add_config("update_rate", averages.update_rate)
        self.add_config("population_size", self.population_size)
        self.add_config("block_names", list(self.block_names))
        self.add_state("averages", averages, attribute="_ema")
        # sum of squared EMA weights, for the effective sample size
        self.add_state("weight_sq_sum", 0.0, attribute="_weight_sq_sum", load=float)
        self.add_state("observations", 0, load=int)
        self.add_state("examples", 0.0, load=float)
        self.last_observation: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def update_rate(self) -> float:
        return self._ema.update_rate

    def update(
        self,
        grad_norm_sq: torch.Tensor | float,
        trace_sigma: torch.Tensor | float,
        examples: float,
    ) -> None:
        """Fold in one step's unbiased estimates.

        Args:
            grad_norm_sq: scalar or (P,) estimate of |G|^2 per block.
            trace_sigma: same shape, estimate of tr(Sigma) per block.
            examples: number of examples the step used (the weight when window="examples").
        """
        g = torch.as_tensor(grad_norm_sq, dtype=torch.float64).reshape(-1)
        t = to_device(torch.as_tensor(trace_sigma, dtype=torch.float64).reshape(-1), g.device)
        if g.numel() != len(self.block_names) or t.numel() != len(self.block_names):
            raise ValueError(
                f"expected {len(self.block_names)} block values {self.block_names}, but got "
                f"grad_norm_sq with {g.numel()} and trace_sigma with {t.numel()} entries"
            )
        examples = check_positive("examples", examples)
        if self.population_size is not None:
            n = float(self.population_size)
            g, t = g + t / n, t * (n - 1.0) / n
        weight = float(examples) if self.window == "examples" else 1.0
        g_total, t_total = g.sum(), t.sum()
        moments = torch.stack([g_total * g_total, t_total * t_total, g_total * t_total])
        self._ema.update(torch.cat([g, t, moments]), weight=weight)
        decay = math.pow(1.0 - self.update_rate, weight)
        self._weight_sq_sum = decay * decay * self._weight_sq_sum + (1.0 - decay) ** 2
        self.observations += 1
        self.examples += float(examples)
        self.last_observation = (g, t)

    @property
    def effective_count(self) -> float:
        """Kish's effective number of observations behind the EMA: (sum w)^2 / sum w^2."""
        if self.observations == 0:
            return 0.0
        return self._ema.count_weight**2 / self._weight_sq_sum

    def result(self) -> NoiseScaleResult:
        """The current averages, B_simple and its interval; raises before the first update."""
        if self.observations == 0:
            raise RuntimeError("no step observed yet: the noise scale needs at least one step")
        p = len(self.block_names)
        values = self._ema.value.cpu()
        block_g, block_t = values[:p], values[p : 2 * p]
        g, t = float(block_g.sum()), float(block_t.sum())
        g2, t2, gt = values[2 * p :].tolist()
        n_eff = self.effective_count
        if n_eff > 1.0 + 1e-9:
            scale = 1.0 / (n_eff - 1.0)  # weighted variance, reliability-weights correction
            var_g = max(g2 - g * g, 0.0) * scale
            var_t = max(t2 - t * t, 0.0) * scale
            cov = (gt - g * t) * scale
            interval = ratio_interval(t, g, var_t, var_g, cov, self.confidence)
        else:
            interval = (-math.inf, math.inf)
        return NoiseScaleResult(
            grad_norm_sq=g,
            trace_sigma=t,
            b_simple=t / g if g > 0 else math.inf,
            interval=interval,
            confidence=self.confidence,
            block_names=self.block_names,
            block_grad_norm_sq=block_g,
            block_trace_sigma=block_t,
            observations=self.observations,
            examples=self.examples,
        )


class TrackedEstimator(NoiseEstimator, Stateful):
    """Base of the estimators that fold per-step (|G|^2, tr Sigma) into a ``NoiseScaleTracker``.

    Subclasses compute one step's unbiased estimates their own way and hand them to ``fold``,
    which skips non-finite steps (an overflowing loss scale, a NaN loss) so that one bad step
    never poisons the averages. The tracker is the saved state; subclasses declare what else
    they keep (``add_state``).
    """

    def __init__(
        self,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        block_names: Sequence[str] = ("all",),
        population_size: int | None = None,
    ) -> None:
        tracker = NoiseScaleTracker(update_rate, window, confidence, block_names, population_size)
        self.add_state("tracker", tracker)
        self.clear_pending()

    def clear_pending(self) -> None:
        """Forget what was observed of the current step (nothing, unless a subclass keeps it)."""

    def fold(self, grad_norm: torch.Tensor, trace: torch.Tensor, examples: float) -> None:
        """Average one step's (P,) |G|^2 and tr Sigma over ``examples`` in, unless non-finite."""
        if bool(torch.isfinite(grad_norm).all() & torch.isfinite(trace).all()):
            self.tracker.update(grad_norm, trace, examples)

    @property
    def estimate(self) -> NoiseScaleResult | None:
        """The current ``NoiseScaleResult``, or None before the first informative step."""
        return self.tracker.result() if self.tracker.observations else None
