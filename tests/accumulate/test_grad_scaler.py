"""GradScaler: each microbatch unscaled once by its own scale; overflowed microbatches dropped."""

from __future__ import annotations

import pytest
import torch
from tests.accumulate.helpers import capture_applied_gradients
from torch import nn

from grabkit.accumulate import AdaptiveAccumulationWrapper, NormThreshold, OptimizerWrapperGNTS


def unit_gradient_setup(dtype: torch.dtype, draws: int):
    weight = nn.Parameter(torch.zeros(3, dtype=dtype))
    inner = torch.optim.SGD([weight], lr=0.0)
    applied = capture_applied_gradients(inner)
    wrapper = AdaptiveAccumulationWrapper(inner, NormThreshold(0.0), max_batch_draws=draws)
    return weight, wrapper, applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("growth_interval", [1, 2000])
def test_two_unit_gradients_average_to_exactly_one(dtype, growth_interval):
    weight, wrapper, applied = unit_gradient_setup(dtype, draws=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    scales = []
    for _ in range(2):
        scales.append(scaler.get_scale())
        scaler.scale(weight.sum()).backward()
        scaler.step(wrapper)
        scaler.update()
    if growth_interval == 1:
        assert scales[0] != scales[1]  # the scale changed inside the window
    assert applied[0][0].dtype == dtype
    assert torch.equal(applied[0][0], torch.ones(3, dtype=dtype))
    stats = wrapper.statistics()
    assert stats["last_mean_grad_norm"] == pytest.approx(3**0.5)  # in true units, not scaled


def test_overflowed_microbatch_is_dropped_and_never_poisons_the_accumulator():
    weight, wrapper, applied = unit_gradient_setup(torch.float32, draws=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    outcomes = []
    for factor in (1.0, float("inf"), 3.0):
        scaler.scale(weight.sum() * factor).backward()
        outcomes.append(scaler.step(wrapper))
        if factor == float("inf"):
            assert wrapper.statistics()["reason"] == "overflow_skipped"
        scaler.update()
    assert outcomes == [False, False, True]
    assert scaler.get_scale() == 2.0**7  # the scaler saw the overflow and backed off
    assert torch.equal(applied[0][0], torch.full((3,), 2.0))  # (1 + 3) / 2
    assert wrapper.statistics()["skipped_batches"] == 1
    assert wrapper.statistics()["batches"] == 3  # two folded, the next is the third


def test_explicit_unscale_then_step_is_not_unscaled_twice():
    weight, wrapper, applied = unit_gradient_setup(torch.float32, draws=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(weight.sum() * 5.0).backward()
    scaler.unscale_(wrapper)
    torch.nn.utils.clip_grad_norm_([weight], max_norm=1e9)
    scaler.step(wrapper)
    scaler.update()
    assert torch.equal(applied[0][0], torch.full((3,), 5.0))


def test_gnts_under_grad_scaler_decides_on_true_norms():
    weight = nn.Parameter(torch.zeros(4))
    wrapper = OptimizerWrapperGNTS(torch.optim.SGD([weight], lr=0.0), norm_threshold=2.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(weight.sum()).backward()  # |g| = 2 <= 2.5 even though the scaled norm is 2^17
    scaler.step(wrapper)
    scaler.update()
    assert wrapper.statistics()["steps"] == 1
