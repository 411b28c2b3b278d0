"""Resume, property-tested: every stateful stepping object, checkpointed at a random microbatch,
saved, read back with ``torch.load(weights_only=True)`` into fresh objects, continues exactly as
the uninterrupted run (bitwise parameters and decisions). Mismatched checkpoints are refused.

One representative case runs the resumed half in a fresh Python process.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss

from grabkit.accumulate import (
    AdaptiveAccumulationWrapper,
    MetricHypothesisTest,
    NoiseScaleController,
    NormTest,
    NormWarmupScheduler,
    OptimizerWrapperGNR,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
    RelativeNormThreshold,
    ValueSchedule,
    get_curved_batch_schedule,
    get_direct_cosine_annealing_with_warmup,
    get_norm_threshold_cosine_annealing_with_warmup,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SIZES = [3, 1, 4, 2, 5, 2, 3, 1, 4, 2, 3, 3, 2, 5]


def build(kind: str, model: torch.nn.Module):
    """(wrapper, schedule or None, lr scheduler or None) for one kind of stateful stepping."""
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    lr_schedule = None
    if kind == "gnts":
        wrapper = OptimizerWrapperGNTS(inner, max_batch_draws=4)
        schedule = get_norm_threshold_cosine_annealing_with_warmup(wrapper, 3, len(SIZES), 0.8)
        lr_schedule = torch.optim.lr_scheduler.LambdaLR(wrapper, lambda t: 1.0 / (1.0 + t))
    elif kind == "gnts_warmup":
        wrapper = OptimizerWrapperGNTS(inner, max_batch_draws=4)
        base = get_norm_threshold_cosine_annealing_with_warmup(wrapper, 0, len(SIZES), 0.8)
        schedule = NormWarmupScheduler(base, 4, warmup_start=5.0, warmup_end=0.8)
    elif kind == "gns":
        wrapper = OptimizerWrapperGNS(inner, noise_multiplier=0.5, max_batch_draws=4)
        schedule = get_direct_cosine_annealing_with_warmup(wrapper, 0.8, 2, len(SIZES), 0.2)
    elif kind == "mht":
        wrapper = OptimizerWrapperMHT(inner, error_tolerance=0.2, confidence=0.5, max_batch_draws=4)
        schedule = None
    elif kind == "gnr":
        wrapper = OptimizerWrapperGNR(inner, "independent", target_norm=0.3)
        schedule = get_direct_cosine_annealing_with_warmup(wrapper, 0.5, 2, len(SIZES))
    elif kind == "sbc":
        wrapper = OptimizerWrapperSBC(inner, 2, 2, max_batch_draws=6)
        schedule = get_curved_batch_schedule(wrapper, 2, 10, len(SIZES))
    elif kind == "normtest":
        wrapper = AdaptiveAccumulationWrapper(inner, NormTest(0.5), max_batch_draws=4)
        schedule = ValueSchedule(wrapper, lambda t: 0.5 + 0.1 * t)
    elif kind == "relative":
        wrapper = AdaptiveAccumulationWrapper(
            inner, RelativeNormThreshold(0.5), max_batch_draws=4, clip_grad_norm=0.5
        )
        schedule = None
    elif kind == "lr_only":  # a GQC schedule used as an LR schedule of a plain optimizer
        wrapper = inner
        schedule = get_direct_cosine_annealing_with_warmup(inner, 0.05, 2, len(SIZES))
    else:
        raise AssertionError(kind)
    return wrapper, schedule, lr_schedule


KINDS = ["gnts", "gnts_warmup", "gns", "mht", "gnr", "sbc", "normtest", "relative", "lr_only"]


def train(kind, model, wrapper, schedule, lr_schedule, batches) -> list:
    decisions = []
    for x, y in batches:
        loss = mean_loss(model, x, y)
        loss.backward()
        if kind == "lr_only":
            wrapper.step()
            wrapper.zero_grad()
            decisions.append(True)
        elif kind == "mht":
            decisions.append((wrapper.step(loss, count=len(x)), wrapper.last_reason))
        else:
            decisions.append((wrapper.step(count=len(x)), wrapper.last_reason))
        if schedule is not None:
            schedule.step()
        if lr_schedule is not None:
            lr_schedule.step()
    return decisions


def save(model, wrapper, schedule, lr_schedule) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "wrapper": wrapper.state_dict(),
            "schedule": None if schedule is None else schedule.state_dict(),
            "lr_schedule": None if lr_schedule is None else lr_schedule.state_dict(),
        },
        buffer,
    )
    return buffer.getvalue()


def restore(kind: str, blob: bytes):
    state = torch.load(io.BytesIO(blob), weights_only=True)
    model = make_model(seed=7)  # other initial weights: everything must come from the state
    wrapper, schedule, lr_schedule = build(kind, model)
    model.load_state_dict(state["model"])
    wrapper.load_state_dict(state["wrapper"])
    if schedule is not None:
        schedule.load_state_dict(state["schedule"])
    if lr_schedule is not None:
        lr_schedule.load_state_dict(state["lr_schedule"])
    return model, wrapper, schedule, lr_schedule


def uninterrupted(kind: str):
    model = make_model()
    wrapper, schedule, lr_schedule = build(kind, model)
    batches = make_microbatches(SIZES)
    decisions = train(kind, model, wrapper, schedule, lr_schedule, batches)
    return model, decisions


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), cut=st.integers(0, len(SIZES)))
def test_resume_at_any_microbatch_continues_exactly(kind, cut):
    batches = make_microbatches(SIZES)
    whole_model, whole = uninterrupted(kind)

    model = make_model()
    wrapper, schedule, lr_schedule = build(kind, model)
    first = train(kind, model, wrapper, schedule, lr_schedule, batches[:cut])
    model, wrapper, schedule, lr_schedule = restore(
        kind, save(model, wrapper, schedule, lr_schedule)
    )
    second = train(kind, model, wrapper, schedule, lr_schedule, batches[cut:])

    assert first + second == whole
    for p, q in zip(model.parameters(), whole_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.slow
def test_resume_in_a_fresh_process_continues_exactly(tmp_path):
    kind, cut = "gns", 6
    batches = make_microbatches(SIZES)
    whole_model, whole = uninterrupted(kind)
    model = make_model()
    wrapper, schedule, lr_schedule = build(kind, model)
    first = train(kind, model, wrapper, schedule, lr_schedule, batches[:cut])
    (tmp_path / "ckpt.pt").write_bytes(save(model, wrapper, schedule, lr_schedule))
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / "src")!r}]
        from tests.accumulate.helpers import make_microbatches
        from tests.accumulate.test_resume_property import SIZES, restore, train
        blob = open({str(tmp_path / "ckpt.pt")!r}, "rb").read()
        model, wrapper, schedule, lr_schedule = restore({kind!r}, blob)
        decisions = train({kind!r}, model, wrapper, schedule, lr_schedule,
                          make_microbatches(SIZES)[{cut}:])
        torch.save({{"decisions": decisions, "params": list(model.parameters())}},
                   {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert first + [tuple(d) for d in out["decisions"]] == whole
    for p, q in zip(out["params"], whole_model.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=0)


# ----------------------------------------------------------------- mismatched checkpoints
def _state(wrapper_factory) -> dict:
    model = make_model()
    wrapper = wrapper_factory(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_microbatches([3])[0]
    loss = mean_loss(model, x, y)
    loss.backward()
    if wrapper.controller.needs_metric:
        AdaptiveAccumulationWrapper.step(wrapper, metric=loss)
    else:
        wrapper.step()
    return wrapper.state_dict()


@pytest.mark.parametrize(
    ("saved", "loader", "message"),
    [
        (lambda o: OptimizerWrapperGNTS(o), lambda o: OptimizerWrapperGNS(o), "controller"),
        (
            lambda o: AdaptiveAccumulationWrapper(o, NormTest()),
            lambda o: AdaptiveAccumulationWrapper(o, RelativeNormThreshold()),
            "controller",
        ),
        (
            lambda o: OptimizerWrapperGNTS(o, max_batch_draws=8),
            lambda o: OptimizerWrapperGNTS(o, max_batch_draws=4),
            "max_batch_draws",
        ),
        (
            lambda o: OptimizerWrapperGNTS(o, clip_grad_norm=1.0),
            lambda o: OptimizerWrapperGNTS(o),
            "clip_grad_norm",
        ),
        (
            lambda o: OptimizerWrapperGNS(o, update_rate=0.2),
            lambda o: OptimizerWrapperGNS(o, update_rate=0.5),
            "update_rate",
        ),
        (
            lambda o: AdaptiveAccumulationWrapper(o, NoiseScaleController(min_draws=2)),
            lambda o: AdaptiveAccumulationWrapper(o, NoiseScaleController(min_draws=3)),
            "min_draws",
        ),
        (
            lambda o: AdaptiveAccumulationWrapper(o, MetricHypothesisTest(confidence=0.9)),
            lambda o: AdaptiveAccumulationWrapper(o, MetricHypothesisTest(confidence=0.8)),
            "confidence",
        ),
        (
            lambda o: OptimizerWrapperSBC(o, 2, 8),
            lambda o: OptimizerWrapperSBC(o, 4, 8),
            "physical_batch_size",
        ),
        (
            lambda o: OptimizerWrapperGNR(o, "global"),
            lambda o: OptimizerWrapperGNR(o, "independent"),
            "mode",
        ),
    ],
)
def test_a_checkpoint_of_another_controller_or_configuration_is_refused(saved, loader, message):
    state = _state(saved)
    model = make_model()
    wrapper = loader(torch.optim.SGD(model.parameters(), lr=0.1))
    before = wrapper.state_dict()
    with pytest.raises(ValueError, match=message):
        wrapper.load_state_dict(state)
    after = wrapper.state_dict()
    assert after["counters"] == before["counters"] and after["controller"] == before["controller"]


def test_a_scheduled_value_that_is_negative_or_nan_is_refused():
    model = make_model()
    wrapper = AdaptiveAccumulationWrapper(torch.optim.SGD(model.parameters()), NormTest())
    with pytest.raises(ValueError, match="theta"):
        ValueSchedule(wrapper, lambda t: -1.0)
    with pytest.raises(ValueError, match="norm_threshold"):
        OptimizerWrapperGNTS(torch.optim.SGD(model.parameters())).scheduled_value = float("nan")
