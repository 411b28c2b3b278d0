"""The shared argument checks: accepted values come back normalised, every refusal names the
argument and the value in PyTorch's style, and a wrong type is both a TypeError and a
ValueError."""

from __future__ import annotations

import math

import pytest
import torch

from grabkit.validation import (
    ArgumentTypeError,
    check_choice,
    check_count,
    check_non_negative,
    check_non_negative_int,
    check_positive,
    check_positive_int,
    check_probability,
)


def test_accepted_values_come_back_normalised():
    assert check_positive_int("batch_size", 3) == 3
    assert check_positive_int("min_draws", 2, minimum=2) == 2
    assert check_non_negative_int("steps", 0) == 0
    assert check_positive("theta", 2) == 2.0 and isinstance(check_positive("theta", 2), float)
    assert check_non_negative("norm", 0) == 0.0
    assert check_probability("confidence", 0.5) == 0.5
    assert check_probability("ema_alpha", 1, allow_one=True) == 1.0
    assert check_count("count", 4) == 4.0
    count = check_count("count", torch.tensor([3.0]))
    assert count.shape == () and float(count) == 3.0


def test_the_message_is_pytorch_style():
    with pytest.raises(
        ValueError,
        match=r"^`batch_size` should be a positive integer, but got "
        r"batch_size=0$",
    ):
        check_positive_int("batch_size", 0)
    with pytest.raises(ValueError, match=r"`min_draws` should be an integer >= 2, but got "):
        check_positive_int("min_draws", 1, minimum=2)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (check_positive_int, -1),
        (check_non_negative_int, -1),
        (check_positive, 0.0),
        (check_positive, math.inf),
        (check_positive, math.nan),
        (check_non_negative, -1e-9),
        (check_non_negative, math.nan),
        (check_probability, 1.0),
        (check_probability, 0.0),
        (check_count, 0),
        (check_count, math.inf),
        (check_count, -2.0),
    ],
)
def test_bad_values_are_value_errors_naming_the_argument(check, value):
    with pytest.raises(ValueError, match="`x` should be") as info:
        check("x", value)
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (check_positive_int, 2.0),
        (check_positive_int, True),
        (check_non_negative_int, "1"),
        (check_positive, "1"),
        (check_positive, None),
        (check_probability, True),
        (check_count, "3"),
    ],
)
def test_wrong_types_are_both_type_and_value_errors(check, value):
    with pytest.raises(ArgumentTypeError, match="`x` should be") as info:
        check("x", value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_a_count_tensor_must_hold_one_element():
    with pytest.raises(ValueError, match="one-element tensor"):
        check_count("count", torch.ones(2))


def test_a_choice_is_one_of_its_strings():
    assert check_choice("unequal_counts", "raise", ("warn", "raise")) == "raise"
    with pytest.raises(
        ValueError,
        match=r"^`unequal_counts` should be 'warn' or 'raise', but got unequal_counts='error'$",
    ):
        check_choice("unequal_counts", "error", ("warn", "raise"))
    with pytest.raises(ArgumentTypeError, match="unequal_counts=True"):
        check_choice("unequal_counts", True, ("warn", "raise"))
