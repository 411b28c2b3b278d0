"""Checks for user input, one message style for the whole package.

Every check names the argument and the value it got, in PyTorch's sampler style ("`batch_size`
should be a positive integer, but got batch_size=0"), raises ``ValueError`` for a bad value and
:class:`ArgumentTypeError` (both a ``TypeError`` and a ``ValueError``, as numpy's ``AxisError``
is both an ``IndexError`` and a ``ValueError``) for a value of the wrong type, and returns the
value normalised (``int`` or ``float``), so a constructor reads
``self.theta = check_positive("theta", theta)``.

``bool`` is refused wherever a number is expected: ``True`` is an ``int`` to Python, never a size
or a rate to a user. Not-a-number and infinities are refused by every number check.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_choice",
    "check_count",
    "check_int",
    "check_int_in_range",
    "check_non_negative",
    "check_non_negative_int",
    "check_positive",
    "check_positive_int",
    "check_probability",
]


class ArgumentTypeError(TypeError, ValueError):
    """A user argument of the wrong type: caught by ``except TypeError`` and by
    ``except ValueError`` (PyTorch's samplers raise ValueError for both)."""


def _number(name: str, value: Any, hint: str = "") -> float:
    """``value`` as a float; ArgumentTypeError for anything but a real Python number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"`{name}` should be a number{hint}, but got {name}={value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"`{name}` should be an integer, but got {name}={value!r}")
    return value


def check_int(name: str, value: Any) -> int:
    """``value`` if it is an integer (a seed, say)."""
    return _integer(name, value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"`{name}` should be a bool, but got {name}={value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices`` (a mode, say)."""
    expected = " or ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise ArgumentTypeError(f"`{name}` should be {expected}, but got {name}={value!r}")
    if value not in choices:
        raise ValueError(f"`{name}` should be {expected}, but got {name}={value!r}")
    return value


def check_int_in_range(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an integer in [low, high]."""
    value = _integer(name, value)
    if not low <= value <= high:
        raise ValueError(
            f"`{name}` should be an integer in [{low}, {high}], but got {name}={value!r}"
        )
    return value


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum`` (default 1)."""
    value = _integer(name, value)
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"`{name}` should be {what}, but got {name}={value!r}")
    return value


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` if it is an integer >= 0."""
    value = _integer(name, value)
    if value < 0:
        raise ValueError(f"`{name}` should be a non-negative integer, but got {name}={value!r}")
    return value


def check_positive(name: str, value: Any, hint: str = "") -> float:
    """``value`` as a float if it is a finite number > 0; ``hint`` (" (what it means)") is
    added to the messages after what was expected."""
    number = _number(name, value, hint)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            f"`{name}` should be a positive finite number{hint}, but got {name}={value!r}"
        )
    return number


def check_non_negative(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number >= 0."""
    number = _number(name, value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(
            f"`{name}` should be a non-negative finite number, but got {name}={value!r}"
        )
    return number


def check_probability(name: str, value: Any, *, allow_one: bool = False) -> float:
    """``value`` as a float if it lies in (0, 1), or (0, 1] with ``allow_one``."""
    number = _number(name, value)
    if not (0.0 < number < 1.0 or (allow_one and number == 1.0)):
        interval = "(0, 1]" if allow_one else "(0, 1)"
        raise ValueError(f"`{name}` should be in {interval}, but got {name}={value!r}")
    return number


def check_count(name: str, value: Any) -> float | torch.Tensor:
    """A microbatch's weight (examples or tokens): a positive finite number or a 1-element tensor.

    A number is checked here. A tensor is only checked for its shape and returned detached as a
    0-dim tensor: checking its value would wait for the device, so callers that accept tensors
    check the value where they already synchronise (the accumulation wrapper does, together with
    its overflow flag).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"`{name}` should be a number or a one-element tensor, but got a tensor of "
                f"shape {tuple(value.shape)}"
            )
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"`{name}` should be a positive number (examples or tokens), but got {name}={value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` should be a positive finite number (examples or tokens), but got "
            f"{name}={value!r}"
        )
    return float(value)
