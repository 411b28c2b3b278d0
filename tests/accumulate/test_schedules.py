"""The knob schedules against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from grabkit.accumulate import (
    NormWarmupScheduler,
    OptimizerWrapperSBC,
    get_curved_batch_schedule,
    get_direct_cosine_annealing_with_warmup,
    get_norm_threshold_cosine_annealing_with_warmup,
    get_quadratic_batch_schedule,
)
from grabkit.accumulate.gqc import OptimizerWrapperGNTS
from grabkit.accumulate.schedules import ValueSchedule


def wrapper():
    return OptimizerWrapperGNTS(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


def values(schedule, steps):
    out = [schedule.get_last_value()]
    for _ in range(steps):
        schedule.step()
        out.append(schedule.get_last_value())
    return out


def test_norm_threshold_schedule_formula_and_hold():
    w = wrapper()
    got = values(get_norm_threshold_cosine_annealing_with_warmup(w, 4, 12, 2.0, 0.5, 3.0), 15)
    for t, v in enumerate(got):
        if t < 4:
            want = 6.0 - (t / 4) * (6.0 - 2.0)
        else:
            p = min(1.0, (t - 4) / 8)
            want = 0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * p))
        assert v == pytest.approx(want)
    assert got[4] == pytest.approx(2.0) and got[12:] == pytest.approx([0.5] * 4)
    assert w.norm_threshold == got[-1]
    assert w.optimizer.param_groups[0]["lr"] == 0.1  # the learning rate is untouched


def test_direct_cosine_and_batch_schedules():
    w = wrapper()
    got = values(get_direct_cosine_annealing_with_warmup(w, 2.0, 2, 6, 0.5), 7)
    assert got[:3] == pytest.approx([0.0, 1.0, 2.0]) and got[6:] == pytest.approx([0.5, 0.5])
    sbc = OptimizerWrapperSBC(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 8)
    got = values(get_quadratic_batch_schedule(sbc, 8, 72, 4), 5)
    assert got == pytest.approx([8, 12, 24, 44, 72, 72])
    assert sbc.target_draws == 9
    got = values(get_curved_batch_schedule(sbc, 8, 72, 4, polynomial_exponent=1.0), 2)
    assert got == pytest.approx([8, 24, 40])


def test_norm_warmup_scheduler_then_hands_over():
    w = wrapper()
    base = get_norm_threshold_cosine_annealing_with_warmup(w, 0, 10, 1.0, 0.0)
    warm = NormWarmupScheduler(base, num_warmup_steps=4, warmup_start=8.0, warmup_end=2.0)
    got = values(warm, 6)
    assert got[:4] == pytest.approx([8.0, 6.5, 5.0, 3.5])
    assert got[4] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.4)))
    state = warm.state_dict()
    other = NormWarmupScheduler(
        get_norm_threshold_cosine_annealing_with_warmup(wrapper(), 0, 10, 1.0, 0.0), 4, 8.0, 2.0
    )
    other.load_state_dict(state)
    assert other.get_last_value() == pytest.approx(got[-1])


def test_schedules_reject_bad_input():
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        get_norm_threshold_cosine_annealing_with_warmup(object(), 1, 2)
    with pytest.raises(ValueError, match="num_training_steps"):
        get_norm_threshold_cosine_annealing_with_warmup(wrapper(), 10, 5)
    with pytest.raises(ValueError, match="num_warmup_steps"):
        get_norm_threshold_cosine_annealing_with_warmup(wrapper(), -1, 5)
    with pytest.raises(TypeError, match="ValueSchedule"):
        NormWarmupScheduler(object(), 3)
    with pytest.raises(ValueError, match="polynomial_exponent"):
        get_curved_batch_schedule(wrapper(), 1, 2, 3, polynomial_exponent=0)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_a_schedule_never_sets_a_nan_or_negative_value(bad):
    target = wrapper()
    schedule = ValueSchedule(target, lambda t: 1.0 if t < 2 else bad)
    schedule.step()
    with pytest.raises(ValueError, match="norm_threshold"):
        schedule.step()
    assert target.scheduled_value == 1.0  # the last good value stays
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="learning rate"):
        ValueSchedule(plain, lambda t: bad)
    assert plain.param_groups[0]["lr"] == 0.1
