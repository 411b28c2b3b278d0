"""Checkpoints: a run resumed at any microbatch reproduces the uninterrupted run bitwise."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss

from grabkit.accumulate import (
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    get_norm_threshold_cosine_annealing_with_warmup,
)

SIZES = [3, 1, 4, 2, 5, 2, 3, 1, 4, 2]


def build(kind: str, model):
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    if kind == "gnts":
        wrapper = OptimizerWrapperGNTS(inner, max_batch_draws=4)
        schedule = get_norm_threshold_cosine_annealing_with_warmup(wrapper, 3, len(SIZES), 0.8)
    elif kind == "gns":
        wrapper = OptimizerWrapperGNS(inner, noise_multiplier=0.5, max_batch_draws=4)
        schedule = None
    else:
        wrapper = OptimizerWrapperMHT(inner, error_tolerance=0.2, confidence=0.5, max_batch_draws=4)
        schedule = None
    return wrapper, schedule


def train(kind: str, model, wrapper, schedule, batches) -> list[bool]:
    stepped = []
    for x, y in batches:
        loss = mean_loss(model, x, y)
        loss.backward()
        if kind == "mht":
            stepped.append(wrapper.step(loss, count=len(x)))
        else:
            stepped.append(wrapper.step(count=len(x)))
        if schedule is not None:
            schedule.step()
    return stepped


def checkpoint(model, wrapper, schedule) -> dict:
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "wrapper": wrapper.state_dict(),
            "schedule": None if schedule is None else schedule.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", ["gnts", "gns", "mht"])
def test_resume_at_every_microbatch_is_bitwise_identical(kind):
    batches = make_microbatches(SIZES, seed=5)
    model = make_model(0)
    wrapper, schedule = build(kind, model)
    stepped = train(kind, model, wrapper, schedule, batches)
    assert any(stepped) and not all(stepped)  # the run has windows of several microbatches
    final = [p.detach().clone() for p in model.parameters()]
    final_stats = wrapper.statistics()

    for cut in range(len(batches) + 1):
        first = make_model(0)
        w1, s1 = build(kind, first)
        train(kind, first, w1, s1, batches[:cut])
        saved = checkpoint(first, w1, s1)

        resumed = make_model(123)  # different initial weights: everything must come from disk
        w2, s2 = build(kind, resumed)
        resumed.load_state_dict(saved["model"])
        w2.load_state_dict(saved["wrapper"])
        if s2 is not None:
            s2.load_state_dict(saved["schedule"])
        assert train(kind, resumed, w2, s2, batches[cut:]) == stepped[cut:]
        for got, want in zip(resumed.parameters(), final, strict=True):
            assert torch.equal(got, want), f"resumed at microbatch {cut}"
        assert w2.statistics() == final_stats


def _windows_of_four(model) -> OptimizerWrapperGNTS:
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    return OptimizerWrapperGNTS(inner, max_batch_draws=4, norm_threshold=0.0)


def test_a_run_continued_from_its_end_is_the_longer_run_when_saved_before_the_flush():
    """A run of 6 microbatches (windows of four) ends with two open, which ``flush()`` applies.
    Its state saved before that flush, continued over the next 4 microbatches, is the
    10-microbatch run; saved after it (the early update in it), the continuation differs, and
    its first step warns (it continued without a word)."""
    batches = make_microbatches(SIZES, seed=5)
    model = make_model(0)
    train("gnts", model, _windows_of_four(model), None, batches)
    first = make_model(0)
    ending = _windows_of_four(first)
    train("gnts", first, ending, None, batches[:6])
    states = {"before": checkpoint(first, ending, None)}
    assert ending.flush()
    states["after"] = checkpoint(first, ending, None)
    for when, saved in states.items():
        resumed = make_model(123)
        wrapper = _windows_of_four(resumed)
        resumed.load_state_dict(saved["model"])
        wrapper.load_state_dict(saved["wrapper"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train("gnts", resumed, wrapper, None, batches[6:])
        warned = [w for w in caught if "after flush()" in str(w.message)]
        pairs = zip(resumed.parameters(), model.parameters(), strict=True)
        same = all(torch.equal(p, q) for p, q in pairs)
        assert (same, len(warned)) == ((True, 0) if when == "before" else (False, 1)), when


def test_state_dict_holds_only_plain_types():
    model = make_model()
    wrapper, _ = build("gns", model)
    train("gns", model, wrapper, None, make_microbatches([2, 2, 2]))

    def check(value):
        if isinstance(value, dict):
            assert all(isinstance(k, (str, int)) for k in value)
            for v in value.values():
                check(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                check(v)
        else:
            assert value is None or isinstance(value, (torch.Tensor, int, float, str, bool))

    check(wrapper.state_dict())


def test_load_state_dict_rejects_foreign_or_mismatched_state():
    model = make_model()
    wrapper, _ = build("gnts", model)
    with pytest.raises(ValueError, match=r"wrapper\.optimizer\.load_state_dict"):
        wrapper.load_state_dict(wrapper.optimizer.state_dict())
    state = wrapper.state_dict()
    state["accumulated_sums"] = state["accumulated_sums"][:-1]
    with pytest.raises(ValueError, match="same parameters"):
        wrapper.load_state_dict(state)
    other, _ = build("gns", make_model())
    with pytest.raises(ValueError, match="different controller"):
        wrapper.load_state_dict(other.state_dict())
    state = wrapper.state_dict()
    state["counters"]["surprise"] = 1
    with pytest.raises(ValueError, match="counters"):
        wrapper.load_state_dict(state)
