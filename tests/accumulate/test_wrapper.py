"""The wrapper as an optimizer: exact averaging, hooks, schedulers, zero_grad, odd parameters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.accumulate.helpers import (
    capture_applied_gradients,
    full_batch_gradient,
    make_microbatches,
    make_model,
    mean_loss,
)
from torch import nn

from grabkit.accumulate import (
    AdaptiveAccumulationWrapper,
    NormThreshold,
    OptimizerWrapperGNR,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
)


def never_before(k: int, optimizer: torch.optim.Optimizer) -> AdaptiveAccumulationWrapper:
    """A wrapper that steps exactly every ``k`` microbatches (threshold 0, max draws k)."""
    return AdaptiveAccumulationWrapper(optimizer, NormThreshold(0.0), max_batch_draws=k)


def test_is_a_real_optimizer_sharing_the_inner_state():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapper = OptimizerWrapperGNTS(inner)
    assert isinstance(wrapper, torch.optim.Optimizer)
    assert wrapper.param_groups is inner.param_groups
    assert wrapper.state is inner.state
    assert wrapper.defaults is inner.defaults
    assert wrapper.optimizer is inner
    assert wrapper.__class__.__name__ == "OptimizerWrapperGNTS"
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = wrapper.nonexistent
    inner.custom_flag = 7
    assert wrapper.custom_flag == 7  # forwarded


def test_stock_lr_scheduler_acts_on_inner_learning_rate():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    wrapper = OptimizerWrapperGNTS(inner)
    scheduler = torch.optim.lr_scheduler.StepLR(wrapper, step_size=1, gamma=0.5)
    x, y = make_microbatches([3])[0]
    mean_loss(model, x, y).backward()
    wrapper.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.5


def test_step_hooks_fire_per_microbatch():
    model = make_model()
    wrapper = never_before(3, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    wrapper.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for x, y in make_microbatches([2, 2, 2]):
        mean_loss(model, x, y).backward()
        wrapper.step()
    assert calls == ["post"] * 3


@pytest.mark.parametrize("counts", [[3, 1, 6], [1, 1, 1]])
def test_applied_gradient_is_the_full_batch_gradient(counts):
    model = make_model()
    batches = make_microbatches(counts)
    reference = full_batch_gradient(model, batches)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(len(counts), inner)
    for x, y in batches:
        mean_loss(model, x, y).backward()
        stepped = wrapper.step(count=len(x))
    assert stepped and len(applied) == 1
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_count_as_tensor_is_kept_on_device_and_exact():
    model = make_model()
    batches = make_microbatches([2, 5])
    reference = full_batch_gradient(model, batches)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(2, inner)
    for x, y in batches:
        mean_loss(model, x, y).backward()
        wrapper.step(count=torch.tensor(len(x)))
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_zero_grad_is_safe_while_accumulating():
    model = make_model()
    batches = make_microbatches([2, 4])
    reference = full_batch_gradient(model, batches)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(2, inner)
    for x, y in batches:
        wrapper.zero_grad()  # the usual loop calls it before and after every microbatch
        mean_loss(model, x, y).backward()
        wrapper.step(count=len(x))
        wrapper.zero_grad()
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_closure_computes_the_microbatch_and_its_loss_is_the_metric():
    model = make_model()
    batches = make_microbatches([2, 2, 2, 2])
    wrapper = OptimizerWrapperMHT(torch.optim.SGD(model.parameters(), lr=0.01), max_batch_draws=3)
    for x, y in batches:

        def closure(x=x, y=y):
            loss = mean_loss(model, x, y)
            loss.backward()
            return loss

        wrapper.step(closure=closure)
    assert wrapper.last_closure_loss is not None
    assert wrapper.statistics()["running_avg_metric"] is not None


def test_unused_frozen_and_sometimes_used_parameters():
    torch.manual_seed(0)
    used = nn.Linear(3, 1).double()
    sometimes = nn.Linear(3, 1).double()
    never = nn.Linear(3, 1).double()
    frozen = nn.Linear(3, 1).double().requires_grad_(False)
    params = [*used.parameters(), *sometimes.parameters(), *never.parameters()]
    inner = torch.optim.SGD(params + list(frozen.parameters()), lr=1.0)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(2, inner)
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    (used(x1) + sometimes(x1) + frozen(x1)).sum().backward()
    wrapper.step(count=1)
    (used(x2) + frozen(x2)).sum().backward()
    wrapper.step(count=3)
    grads = applied[0]
    torch.testing.assert_close(grads[0], (x1.sum(0) + 3 * x2.sum(0)).unsqueeze(0) / 4)
    torch.testing.assert_close(grads[2], x1.sum(0).unsqueeze(0) / 4)  # zero in microbatch 2
    assert grads[4] is None and grads[5] is None  # never used: untouched by the inner step
    assert grads[6] is None  # frozen


@pytest.mark.parametrize(
    "factory",
    [
        lambda opt: OptimizerWrapperGNTS(opt),
        lambda opt: OptimizerWrapperGNS(opt),
        lambda opt: OptimizerWrapperSBC(opt, physical_batch_size=2, initial_logical_batch_size=4),
        lambda opt: OptimizerWrapperGNR(opt),
    ],
)
def test_every_wrapper_survives_a_parameter_without_gradient(factory):
    model = make_model()
    spare = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    wrapper = factory(torch.optim.SGD([*model.parameters(), spare], lr=0.01))
    for x, y in make_microbatches([2] * 5):
        mean_loss(model, x, y).backward()
        wrapper.step()
    assert wrapper.statistics()["batches"] == 6


def test_clip_grad_norm_applies_to_the_averaged_gradient():
    model = make_model()
    batches = make_microbatches([3, 3])
    reference = full_batch_gradient(model, batches)
    ref_norm = torch.stack([g.norm() for g in reference]).norm()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = capture_applied_gradients(inner)
    wrapper = AdaptiveAccumulationWrapper(
        inner, NormThreshold(0.0), max_batch_draws=2, clip_grad_norm=float(ref_norm) / 4
    )
    for x, y in batches:
        mean_loss(model, x, y).backward()
        wrapper.step(count=3)
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want / 4, rtol=1e-5, atol=1e-12)


def test_gnr_rescales_to_target_norm_globally_and_independently():
    model = make_model()
    for mode in ("global", "independent"):
        inner = torch.optim.SGD(model.parameters(), lr=0.0)
        applied = capture_applied_gradients(inner)
        wrapper = OptimizerWrapperGNR(inner, mode=mode, target_norm=0.3)
        x, y = make_microbatches([4])[0]
        mean_loss(model, x, y).backward()
        assert wrapper.step() is True
        norms = torch.stack([g.norm() for g in applied[0]])
        if mode == "global":
            assert float(norms.norm()) == pytest.approx(0.3)
        else:
            torch.testing.assert_close(norms, torch.full_like(norms, 0.3))


def test_gnts_steps_when_norm_at_or_below_threshold_and_at_max_draws():
    model = make_model()
    wrapper = OptimizerWrapperGNTS(torch.optim.SGD(model.parameters(), lr=0.0), max_batch_draws=3)
    x, y = make_microbatches([4])[0]
    mean_loss(model, x, y).backward()
    norm = float(torch.stack([p.grad.norm() for p in model.parameters()]).norm())
    wrapper.norm_threshold = norm * 1.000001
    assert wrapper.step() is True and wrapper.statistics()["reason"] == "norm_threshold"
    wrapper.norm_threshold = 0.0
    outcomes = []
    for _ in range(3):
        mean_loss(model, x, y).backward()
        outcomes.append(wrapper.step())
    assert outcomes == [False, False, True]
    assert wrapper.statistics()["reason"] == "max_batch_draws"
    assert wrapper.statistics()["last_step_num_draws"] == 3


def test_noise_scale_controller_accumulates_beyond_two_on_noisy_gradients():
    """Pure-noise labels: B_simple is large, so windows grow well past 2 microbatches
    (GQC's statistic always stepped after 2)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1).double()
    wrapper = OptimizerWrapperGNS(
        torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_batch_draws=64
    )
    gen = torch.Generator().manual_seed(3)
    draws = []
    for _ in range(200):
        x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
        y = 0.05 + torch.randn(4, 1, generator=gen, dtype=torch.float64)
        ((model(x) - y).square().mean()).backward()
        if wrapper.step(count=4):
            draws.append(wrapper.last_step_num_draws)
    assert draws and min(draws) >= 2 and max(draws) > 4


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda o: OptimizerWrapperGNTS(o, max_batch_draws=0), ValueError, "max_batch_draws"),
        (lambda o: OptimizerWrapperGNTS(o, max_batch_draws=2.5), TypeError, "max_batch_draws"),
        (lambda o: OptimizerWrapperGNTS("sgd"), TypeError, "torch.optim.Optimizer"),
        (lambda o: OptimizerWrapperGNR(o, mode="local"), ValueError, "mode"),
        (lambda o: OptimizerWrapperGNTS(o, clip_grad_norm=0), ValueError, "clip_grad_norm"),
        (lambda o: OptimizerWrapperGNTS(o, gradient_layout="tp"), ValueError, "gradient_layout"),
        (lambda o: OptimizerWrapperGNTS(OptimizerWrapperGNTS(o)), TypeError, "already"),
        (lambda o: OptimizerWrapperGNTS(o).step(count=0), ValueError, "count"),
        (lambda o: OptimizerWrapperGNTS(o).step(count=torch.ones(2)), ValueError, "count"),
        (lambda o: OptimizerWrapperMHT(o).step(), ValueError, "metric"),
        (lambda o: OptimizerWrapperGNTS(o, unequal_counts="ignore"), ValueError, "unequal_counts"),
        (lambda o: OptimizerWrapperGNTS(o, unequal_counts=None), TypeError, "unequal_counts"),
        (lambda o: OptimizerWrapperGNTS(o).set_unequal_counts("off"), ValueError, "'raise'"),
        (lambda o: setattr(OptimizerWrapperGNTS(o), "unequal_counts", 1), TypeError, "unequal"),
        # the integrations set default_count per microbatch: checked as it is set (a negative
        # weight was folded in, a zero or NaN one dropped the window as "not finite")
        (lambda o: setattr(OptimizerWrapperGNTS(o), "default_count", -2.0), ValueError, "default"),
        (lambda o: setattr(OptimizerWrapperGNTS(o), "default_count", 0), ValueError, "default"),
        (
            lambda o: setattr(OptimizerWrapperGNTS(o), "default_count", float("nan")),
            ValueError,
            "default",
        ),
        (lambda o: setattr(OptimizerWrapperGNTS(o), "default_count", "4"), TypeError, "default"),
    ],
)
def test_bad_input_is_rejected_clearly(call, error, message):
    model = make_model()
    with pytest.raises(error, match=message):
        call(torch.optim.SGD(model.parameters(), lr=0.1))


def test_sparse_gradients_are_rejected_clearly():
    emb = nn.Embedding(5, 2, sparse=True)
    wrapper = OptimizerWrapperGNTS(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        wrapper.step()


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    token_weights=st.booleans(),
)
def test_any_window_applies_the_exact_example_weighted_mean(sizes, token_weights):
    """Property: whatever the microbatch sizes, the applied gradient is the full-batch one."""
    model = make_model(1)
    batches = make_microbatches(sizes, seed=len(sizes))
    reference = full_batch_gradient(model, batches)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(len(sizes), inner)
    for x, y in batches:
        mean_loss(model, x, y).backward()
        count = torch.tensor(float(len(x))) if token_weights else len(x)
        wrapper.step(count=count)
    for got, want in zip(applied[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_sbc_counts_tokens_when_given():
    model = make_model()
    wrapper = OptimizerWrapperSBC(torch.optim.SGD(model.parameters(), lr=0.0), 4, 16)
    outcomes = []
    for tokens in (10, 5, 1, 7):  # 10 + 5 + 1 = 16 reaches the logical batch at the third
        x, y = make_microbatches([2])[0]
        mean_loss(model, x, y).backward()
        outcomes.append(wrapper.step(count=tokens))
    assert outcomes == [False, False, True, False]


def test_add_param_group_reaches_the_inner_optimizer_and_is_accumulated():
    model = make_model()
    first, second = model[0], model[2]
    inner = torch.optim.SGD(first.parameters(), lr=0.1)
    wrapper = never_before(1, inner)
    wrapper.add_param_group({"params": list(second.parameters()), "lr": 0.01})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["lr"] == 0.01
    before = second.weight.detach().clone()
    x, y = make_microbatches([3])[0]
    mean_loss(model, x, y).backward()
    assert wrapper.step()
    assert not torch.equal(second.weight, before)


@pytest.mark.parametrize("kind", ["gnts", "gns", "mht", "sbc"])
def test_one_host_transfer_per_microbatch(kind, monkeypatch):
    """The decision flag is the only tensor read on the host (no .item() in the statistics)."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapper = {
        "gnts": lambda: OptimizerWrapperGNTS(inner, norm_threshold=1e-9),
        "gns": lambda: OptimizerWrapperGNS(inner),
        "mht": lambda: OptimizerWrapperMHT(inner),
        "sbc": lambda: OptimizerWrapperSBC(inner, 2, 1000),
    }[kind]()
    reads = []
    for name in ("item", "__bool__", "__float__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    batches = make_microbatches([2] * 6)
    for x, y in batches:
        loss = mean_loss(model, x, y)
        loss.backward()
        wrapper.step(loss.detach()) if kind == "mht" else wrapper.step()
    assert 0 < len(reads) <= len(batches), reads


def test_step_hooks_fire_once_per_call_for_a_subclass_with_its_own_step():
    model = make_model()
    never_before(2, torch.optim.SGD(model.parameters(), lr=0.1))  # patches the base class too
    wrapper = OptimizerWrapperMHT(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    wrapper.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    for x, y in make_microbatches([2, 2, 2]):
        loss = mean_loss(model, x, y)
        loss.backward()
        wrapper.step(loss)
    assert calls == ["pre"] * 3


def test_gradient_views_are_copied_not_taken_over():
    """DDP's gradient_as_bucket_view makes .grad a view of a bucket it rewrites every backward."""
    weight = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    inner = torch.optim.SGD([weight], lr=0.0)
    applied = capture_applied_gradients(inner)
    wrapper = never_before(2, inner)
    bucket = torch.ones(6, dtype=torch.float64)
    weight.grad = bucket[:3]
    wrapper.step()
    bucket.fill_(5.0)  # the next microbatch lands in the same storage
    weight.grad = bucket[:3]
    wrapper.step()
    assert torch.equal(applied[0][0], torch.full((3,), 3.0, dtype=torch.float64))
