"""Quantiles of Student's t distribution, without scipy.

The hypothesis-test controller needs t_{q, df} for small integer ``df`` (at most the window length),
so each quantile is computed once by bisection on the CDF and cached. The CDF uses the identity
P(|T| <= x) = I_{x^2/(df+x^2)}(1/2, df/2), with the regularised incomplete beta function evaluated
by its continued fraction (Lentz's method), accurate to ~1e-12.
"""

from __future__ import annotations

import functools
import math

from grabkit.validation import check_positive_int

__all__ = ["student_t_quantile"]


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def _regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def _central_probability(x: float, df: int) -> float:
    """P(|T| <= x) for T ~ t(df), x >= 0."""
    return _regularized_incomplete_beta(0.5, df / 2.0, x * x / (df + x * x))


@functools.lru_cache(maxsize=4096)
def student_t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (0.5 < p < 1)."""
    if not 0.5 < probability < 1.0:
        raise ValueError(f"probability should be in (0.5, 1), but got probability={probability}")
    check_positive_int("df", df)
    central = 2.0 * probability - 1.0
    low, high = 0.0, 1.0
    while _central_probability(high, df) < central:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if _central_probability(mid, df) < central:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)
