"""A controller defined outside grabkit, in this one file, plugs into the wrapper, its schedules
and its checkpoints: ``Controller`` is the extension point (no registration beyond passing it)."""

from __future__ import annotations

import io

import pytest
import torch
from tests.accumulate.helpers import (
    capture_applied_gradients,
    full_batch_gradient,
    make_microbatches,
    make_model,
    mean_loss,
)

from grabkit import AdaptiveAccumulationWrapper, Controller
from grabkit.accumulate import NormTest, Observation, ValueSchedule


class EveryKExamples(Controller):
    """Toy rule: step once the window holds at least ``examples`` examples."""

    scheduled_name = "examples"
    reason = "every_k_examples"

    def __init__(self, examples: float = 6.0) -> None:
        self.examples = examples

    def ready(self, obs: Observation) -> torch.Tensor:
        return obs.total_count >= self.examples


def test_a_toy_controller_steps_on_the_exact_weighted_mean_and_resumes():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = AdaptiveAccumulationWrapper(inner, EveryKExamples(6.0))
    schedule = ValueSchedule(wrapper, lambda t: 6.0 + t)
    batches = make_microbatches([2, 3, 2, 4, 1])
    reference = full_batch_gradient(model, batches[:4])  # 2 + 3 + 2 + 4 >= 6 + 3
    decisions = []
    for x, y in batches:
        mean_loss(model, x, y).backward()
        decisions.append(wrapper.step(count=len(x)))
        schedule.step()
    assert decisions == [False, False, False, True, False]
    assert wrapper.statistics()["reason"] == "accumulating" and wrapper.num_steps == 1
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)

    buffer = io.BytesIO()
    torch.save(wrapper.state_dict(), buffer)
    buffer.seek(0)
    fresh = AdaptiveAccumulationWrapper(
        torch.optim.SGD(make_model().parameters(), lr=0.1), EveryKExamples()
    )
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.scheduled_value == wrapper.scheduled_value == 11.0
    with pytest.raises(ValueError, match="controller"):
        AdaptiveAccumulationWrapper(
            torch.optim.SGD(make_model().parameters()), NormTest()
        ).load_state_dict(wrapper.state_dict())


def test_value_schedule_drives_the_core_wrapper():
    model = make_model()
    wrapper = AdaptiveAccumulationWrapper(torch.optim.SGD(model.parameters()), NormTest())
    schedule = ValueSchedule(wrapper, lambda t: 0.5 / (1 + t))
    schedule.step()
    assert wrapper.controller.theta == wrapper.scheduled_value == 0.25


def test_flush_applies_the_window_left_at_the_end_of_training():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = AdaptiveAccumulationWrapper(inner, EveryKExamples(100.0))
    batches = make_microbatches([2, 3])
    reference = full_batch_gradient(model, batches)
    for x, y in batches:
        mean_loss(model, x, y).backward()
        assert not wrapper.step(count=len(x))
    assert wrapper.flush() is True and wrapper.last_reason == "flushed"
    assert wrapper.num_steps == 1 and wrapper.num_draws == 0
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert wrapper.flush() is False
