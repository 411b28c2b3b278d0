"""Silent wrong results in stepping, each a test that failed on the old code.

* a scheduler on the wrapper acts on the real learning rate after any ``load_state_dict``;
* ``zero_grad()`` between backward and step, or ``step()`` without backward, discards the
  microbatch *and its count*;
* a NaN microbatch without a GradScaler never reaches the parameters and never stalls a rule;
* tensor counts that are zero, negative, infinite or NaN are refused;
* the torch-gqc schedules also schedule a plain optimizer's learning rate.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tests.accumulate.helpers import (
    capture_applied_gradients,
    full_batch_gradient,
    make_microbatches,
    make_model,
    mean_loss,
)

from grabkit.accumulate import (
    AdaptiveAccumulationWrapper,
    NormTest,
    NormThreshold,
    OptimizerWrapperGNR,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
    RelativeNormThreshold,
    get_curved_batch_schedule,
    get_direct_cosine_annealing_with_warmup,
    get_norm_threshold_cosine_annealing_with_warmup,
    get_quadratic_batch_schedule,
)


def _always(inner: torch.optim.Optimizer) -> OptimizerWrapperGNTS:
    return OptimizerWrapperGNTS(inner, norm_threshold=1e12)  # steps after every microbatch


# ----------------------------------------------------------------- item 1: LR after a load
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@pytest.mark.parametrize("load", ["wrapper", "inner"])
def test_scheduler_on_the_wrapper_drives_the_real_lr_after_load(load):
    model = make_model()
    wrapper = _always(torch.optim.SGD(model.parameters(), lr=1.0))
    for x, y in make_microbatches([2, 2]):
        mean_loss(model, x, y).backward()
        wrapper.step()
    saved = wrapper.state_dict() if load == "wrapper" else wrapper.optimizer.state_dict()

    fresh_model = make_model()
    fresh = _always(torch.optim.SGD(fresh_model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda t: 0.5**t)
    if load == "wrapper":
        fresh.load_state_dict(saved)
    else:
        fresh.optimizer.load_state_dict(saved)
    assert fresh.param_groups is fresh.optimizer.param_groups
    assert fresh.state is fresh.optimizer.state
    assert fresh.defaults is fresh.optimizer.defaults
    scheduler.step()
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    scheduler.step()
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


def test_a_param_group_added_through_the_wrapper_gets_the_inner_defaults():
    model = make_model()
    params = list(model.parameters())
    wrapper = _always(torch.optim.AdamW(params[:2], lr=0.1))
    wrapper.add_param_group({"params": params[2:]})
    assert wrapper.optimizer.param_groups[1]["betas"] == (0.9, 0.999)
    for x, y in make_microbatches([2]):
        mean_loss(model, x, y).backward()
        assert wrapper.step()  # AdamW would raise a KeyError on a group without its defaults


# ----------------------------------------------------------------- item 6: discarded microbatch
@pytest.mark.parametrize("discard", ["zero_grad", "zero_grad_keep", "no_backward"])
def test_a_discarded_microbatch_leaves_no_count_behind(discard):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = AdaptiveAccumulationWrapper(inner, NormThreshold(0.0), max_batch_draws=2)
    b0, b1, b2 = make_microbatches([3, 3, 3])
    reference = full_batch_gradient(model, [b0, b2])

    mean_loss(model, *b0).backward()
    assert wrapper.step(count=3) is False
    if discard != "no_backward":
        mean_loss(model, *b1).backward()
        wrapper.zero_grad(set_to_none=discard == "zero_grad")
    assert wrapper.step(count=3) is False
    assert wrapper.last_reason == "no_gradient"
    assert wrapper.num_draws == 1 and wrapper.num_batches == 1 and wrapper.num_skipped == 0
    mean_loss(model, *b2).backward()
    assert wrapper.step(count=3) is True
    assert wrapper.last_step_num_draws == 2 and float(wrapper.last_step_count) == 6.0
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------- item 8: NaN microbatches
def _wrapper(kind: str, inner: torch.optim.Optimizer) -> AdaptiveAccumulationWrapper:
    return {
        "gnts": lambda: OptimizerWrapperGNTS(inner, norm_threshold=0.4, max_batch_draws=5),
        "normtest": lambda: AdaptiveAccumulationWrapper(inner, NormTest(0.8), max_batch_draws=5),
        "relative": lambda: AdaptiveAccumulationWrapper(
            inner, RelativeNormThreshold(0.6), max_batch_draws=5
        ),
        "mht": lambda: OptimizerWrapperMHT(
            inner, confidence=0.5, error_tolerance=0.3, max_batch_draws=5
        ),
        "gns": lambda: OptimizerWrapperGNS(inner, noise_multiplier=0.5, max_batch_draws=5),
        "sbc": lambda: OptimizerWrapperSBC(inner, 2, 6, max_batch_draws=5),
        "gnr": lambda: OptimizerWrapperGNR(inner, target_norm=0.5),
    }[kind]()


def _train(kind: str, batches, nan_at: set[int]) -> tuple[torch.nn.Module, list, object]:
    model = make_model()
    wrapper = _wrapper(kind, torch.optim.SGD(model.parameters(), lr=0.05))
    reasons = []
    for i, (x, y) in enumerate(batches):
        loss = mean_loss(model, x, y) * (math.nan if i in nan_at else 1.0)
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if kind == "mht":
                wrapper.step(loss, count=len(x))
            else:
                wrapper.step(count=len(x))
        assert bool(caught) == (wrapper.last_reason == "nonfinite_skipped")
        reasons.append(wrapper.last_reason)
    return model, reasons, wrapper


KINDS = ["gnts", "normtest", "relative", "mht", "gns", "sbc", "gnr"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_microbatch_first_in_its_window_is_as_if_it_never_came(kind):
    batches = make_microbatches([2, 3, 2, 4, 2, 3, 2, 2, 3, 2, 4, 2])
    clean_model, clean_reasons, _ = _train(kind, batches[1:], set())
    model, reasons, wrapper = _train(kind, batches, {0})
    assert reasons[0] == "nonfinite_skipped" and reasons[1:] == clean_reasons
    assert wrapper.num_skipped == 1
    for p, q in zip(model.parameters(), clean_model.parameters(), strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_microbatch_in_mid_window_discards_that_window_and_never_stalls(kind):
    batches = make_microbatches([2, 3, 2, 4, 2, 3, 2, 2, 3, 2, 4, 2] * 2)
    model, reasons, wrapper = _train(kind, batches, {3, 9})
    assert reasons.count("nonfinite_skipped") == 2
    assert "max_batch_draws" not in reasons[3:5]  # the next window starts fresh
    assert wrapper.num_steps > 0 and wrapper.num_draws < 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "count", [torch.tensor(0.0), torch.tensor(-2.0), torch.tensor(math.inf), torch.tensor(math.nan)]
)
def test_bad_tensor_counts_are_refused_and_change_nothing(count):
    model = make_model()
    wrapper = _always(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    (x, y) = make_microbatches([2])[0]
    mean_loss(model, x, y).backward()
    with pytest.raises(ValueError, match="`count` should be a positive finite number"):
        wrapper.step(count=count)
    assert wrapper.num_batches == 0 and wrapper.num_steps == 0
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("count", [0, -1.0, math.inf, math.nan, True, "3"])
def test_bad_number_counts_are_refused(count):
    model = make_model()
    wrapper = _always(torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y) = make_microbatches([2])[0]
    mean_loss(model, x, y).backward()
    with pytest.raises(ValueError, match="count"):
        wrapper.step(count=count)


def test_a_good_tensor_count_folds_as_the_number_does():
    batches = make_microbatches([2, 3, 4])
    results = []
    for as_tensor in (False, True):
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapper = AdaptiveAccumulationWrapper(inner, NormThreshold(0.0), max_batch_draws=3)
        for x, y in batches:
            mean_loss(model, x, y).backward()
            wrapper.step(count=torch.tensor(float(len(x))) if as_tensor else len(x))
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=0)


# ----------------------------------------------------------------- schedules on a plain optimizer
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda o: get_direct_cosine_annealing_with_warmup(o, 0.4, 2, 6, 0.1),
            [0.0, 0.2, 0.4, 0.1 + 0.3 * 0.5 * (1 + math.cos(math.pi / 4))],
        ),
        (
            lambda o: get_norm_threshold_cosine_annealing_with_warmup(o, 2, 6, 1.0, 0.0, 3.0),
            [3.0, 2.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4))],
        ),
        (lambda o: get_quadratic_batch_schedule(o, 1.0, 5.0, 4), [1.0, 1.25, 2.0, 3.25]),
        (lambda o: get_curved_batch_schedule(o, 1.0, 5.0, 4, 1.0), [1.0, 2.0, 3.0, 4.0]),
    ],
)
def test_gqc_schedules_schedule_a_plain_optimizers_learning_rate(make, expected):
    params = [torch.zeros(2, requires_grad=True)]
    optimizer = torch.optim.SGD([{"params": params}, {"params": [torch.zeros(1)]}], lr=9.0)
    schedule = make(optimizer)
    got = []
    for _ in expected:
        got.append(schedule.get_last_lr())
        schedule.step()
    assert [lrs[0] for lrs in got] == pytest.approx(expected)
    assert all(lrs[0] == lrs[1] for lrs in got)
    assert [g["lr"] for g in optimizer.param_groups] == [schedule.get_last_value()] * 2
