"""Noise estimators under NaN and resume, each failing on the old code:

* one NaN loss no longer breaks ``GradientNoiseScaleEstimator`` for good;
* ``AccumulationNoiseScale`` / ``MicrobatchNoiseScale`` checkpointed in mid-step resume to the
  same estimate;
* property tier: every estimator, checkpointed at a random event and read back with
  ``torch.load(weights_only=True)`` into a fresh object, continues exactly;
* a state of another configuration is refused.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from grabkit.noise import (
    AccumulationNoiseScale,
    GradientNoiseScaleEstimator,
    MicrobatchNoiseScale,
    NoiseScaleTracker,
    PerExampleNoiseScale,
)


def _through_weights_only(state: object) -> object:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 3, generator=g, dtype=torch.float64),
        torch.randn(n, 2, generator=g, dtype=torch.float64),
    )


def _per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().sum(1)


def _summary(result) -> tuple | None:
    if result is None:
        return None
    return (
        result.grad_norm_sq,
        result.trace_sigma,
        result.b_simple,
        tuple(result.interval),
        result.observations,
    )


# ----------------------------------------------------------------- item 7: NaN in the ALF estimator
def _alf_run(calls: list[int], nan_at: set[int]) -> tuple[list[float], object]:
    model = _model()
    est = GradientNoiseScaleEstimator(update_rate=0.3)
    values = []
    for i in calls:
        x, y = _data(8, seed=i)
        loss = _per_example_loss(model, x, y) * (math.nan if i in nan_at else 1.0)
        torch.manual_seed(100 + i)  # the split
        values.append(float(est(loss, list(model.parameters()))))
    return values, est


def test_one_nan_loss_leaves_the_alf_estimator_as_if_it_never_came():
    got, est = _alf_run(list(range(8)), {3})
    clean, clean_est = _alf_run([0, 1, 2, 4, 5, 6, 7], set())
    assert got[3] == got[2]  # the last valid estimate, not NaN
    assert got[:3] + got[4:] == clean
    assert _summary(est.result()) == _summary(clean_est.result())
    assert not math.isnan(est.result().b_simple)


# ----------------------------------------------------------------- item 9: mid-step checkpoints
STEPS = [[3, 2, 4], [2, 2], [5, 1, 2, 3], [2, 3], [4, 4, 2]]


def _events() -> list[tuple]:
    """("backward", step, k) and ("end_microbatch", n) per microbatch, ("end_step",) per step."""
    events = []
    for s, sizes in enumerate(STEPS):
        for k, n in enumerate(sizes):
            events += [("backward", s, k, n), ("end_microbatch", n)]
        events.append(("end_step",))
    return events


def _accumulation_play(model, gns, events, out) -> None:
    for event in events:
        if event[0] == "backward":
            _, s, k, n = event
            x, y = _data(n, seed=10 * s + k)
            total = sum(STEPS[s])
            (_per_example_loss(model, x, y).mean() * n / total).backward()
        elif event[0] == "end_microbatch":
            gns.end_microbatch(event[1])
        else:
            out.append(_summary(gns.end_step()))
            model.zero_grad()


def _accumulation_state(model, gns) -> object:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return _through_weights_only({"gns": gns.state_dict(), "grads": grads})


def _accumulation_resume(state) -> tuple[nn.Module, AccumulationNoiseScale]:
    model = _model()
    gns = AccumulationNoiseScale(model, update_rate=0.3)
    gns.load_state_dict(state["gns"])
    for p, g in zip(model.parameters(), state["grads"], strict=True):
        p.grad = g
    return model, gns


@settings(max_examples=25, deadline=None)
@given(cut=st.integers(0, len(_events())))
def test_accumulation_noise_scale_resumes_exactly_at_any_event(cut):
    events = _events()
    whole = []
    model = _model()
    with AccumulationNoiseScale(model, update_rate=0.3) as gns:
        _accumulation_play(model, gns, events, whole)
    got = []
    model = _model()
    with AccumulationNoiseScale(model, update_rate=0.3) as gns:
        _accumulation_play(model, gns, events[:cut], got)
        state = _accumulation_state(model, gns)
    model, gns = _accumulation_resume(state)
    with gns:
        _accumulation_play(model, gns, events[cut:], got)
    assert got == whole


def test_accumulation_noise_scale_checkpointed_in_mid_step_gives_the_same_estimate():
    events = _events()
    cut = events.index(("end_step",), 8) - 2  # after one microbatch of a 4-microbatch step
    whole, got = [], []
    model = _model()
    with AccumulationNoiseScale(model, update_rate=0.3) as gns:
        _accumulation_play(model, gns, events, whole)
    model = _model()
    with AccumulationNoiseScale(model, update_rate=0.3) as gns:
        _accumulation_play(model, gns, events[:cut], got)
        state = _accumulation_state(model, gns)
    model, gns = _accumulation_resume(state)
    _accumulation_play(model, gns, events[cut:], got)
    assert got[-1] == whole[-1]


@settings(max_examples=25, deadline=None)
@given(cut=st.integers(0, 14))
def test_microbatch_noise_scale_resumes_exactly_in_mid_step(cut):
    g = torch.Generator().manual_seed(0)
    events = []
    for _ in range(4):
        for _ in range(3):
            events.append(("micro", torch.rand(2, generator=g, dtype=torch.float64) + 1, 3))
        events.append(("step", torch.rand(2, generator=g, dtype=torch.float64) + 0.5))

    def play(est, evs, out):
        for e in evs:
            if e[0] == "micro":
                est.observe_microbatch(e[1], e[2])
            else:
                out.append(_summary(est.observe_step(e[1])))

    whole, got = [], []
    play(MicrobatchNoiseScale(0.3, block_names=("a", "b")), events, whole)
    first = MicrobatchNoiseScale(0.3, block_names=("a", "b"))
    play(first, events[:cut], got)
    resumed = MicrobatchNoiseScale(0.3, block_names=("a", "b"))
    resumed.load_state_dict(_through_weights_only(first.state_dict()))
    play(resumed, events[cut:], got)
    assert got == whole


@settings(max_examples=20, deadline=None)
@given(cut=st.integers(0, 8))
def test_alf_estimator_resumes_exactly_through_its_module_state(cut):
    def play(est, model, calls, out):
        for i in calls:
            x, y = _data(8, seed=i)
            torch.manual_seed(100 + i)
            out.append(float(est(_per_example_loss(model, x, y), list(model.parameters()))))

    model = _model()
    whole, got = [], []
    play(GradientNoiseScaleEstimator(update_rate=0.3), model, range(8), whole)
    first = GradientNoiseScaleEstimator(update_rate=0.3)
    play(first, model, range(cut), got)
    resumed = GradientNoiseScaleEstimator(update_rate=0.3)
    resumed.load_state_dict(_through_weights_only(first.state_dict()))
    play(resumed, model, range(cut, 8), got)
    assert got == whole


@settings(max_examples=20, deadline=None)
@given(cut=st.integers(0, 6))
def test_per_example_noise_scale_resumes_exactly(cut):
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.rand(5, 2, generator=g, dtype=torch.float64) + 1, torch.rand(2, generator=g) + 0.1)
        for _ in range(6)
    ]

    def play(est, bs, out):
        for norms, big in bs:
            out.append(_summary(est.observe(norms, big.double())))

    whole, got = [], []
    play(PerExampleNoiseScale(0.3, block_names=("a", "b")), batches, whole)
    first = PerExampleNoiseScale(0.3, block_names=("a", "b"))
    play(first, batches[:cut], got)
    resumed = PerExampleNoiseScale(0.3, block_names=("a", "b"))
    resumed.load_state_dict(_through_weights_only(first.state_dict()))
    play(resumed, batches[cut:], got)
    assert got == whole


# ----------------------------------------------------------------- mismatched configuration
@pytest.mark.parametrize(
    ("saved", "loader", "message"),
    [
        (dict(update_rate=0.1), dict(update_rate=0.2), "update_rate"),
        (dict(update_rate=0.1), dict(update_rate=0.1, window="examples"), "window"),
        (dict(update_rate=0.1), dict(update_rate=0.1, confidence=0.9), "confidence"),
        (dict(update_rate=0.1), dict(update_rate=0.1, population_size=100), "population_size"),
    ],
)
def test_a_tracker_state_of_another_configuration_is_refused(saved, loader, message):
    first = NoiseScaleTracker(**saved)
    first.update(1.0, 2.0, 4)
    other = NoiseScaleTracker(**loader)
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(first.state_dict())
    assert other.observations == 0


def test_an_alf_state_of_another_configuration_is_refused():
    model = _model()
    est = GradientNoiseScaleEstimator(update_rate=0.3)
    x, y = _data(8, seed=0)
    est(_per_example_loss(model, x, y), list(model.parameters()))
    with pytest.raises(ValueError, match="update_rate"):
        GradientNoiseScaleEstimator(update_rate=0.1).load_state_dict(est.state_dict())
    with pytest.raises(ValueError, match="mode"):
        GradientNoiseScaleEstimator(update_rate=0.3, mode="paper").load_state_dict(est.state_dict())
