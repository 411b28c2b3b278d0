"""AccumulationNoiseScale following an AdaptiveAccumulationWrapper (which folds ``.grad`` away
after every microbatch) gives the estimate of the windows the wrapper applied."""

from __future__ import annotations

import pytest
import torch
from tests.noise.helpers import make_model, per_example_loss, problem

from grabkit import AdaptiveAccumulationWrapper, NormTest
from grabkit.noise import AccumulationNoiseScale, MicrobatchNoiseScale


def _loop(model, optimizer, x, y, sizes, on_backward=None):
    """One wrapper step per microbatch; yields after each the wrapper's decision."""
    start = 0
    for size in sizes:
        xs, ys = x[start : start + size], y[start : start + size]
        start += size
        per_example_loss(model, xs, ys).mean().backward()
        if on_backward is not None:
            on_backward(size)
        yield optimizer.step(count=size)


def test_the_estimator_follows_the_windows_the_wrapper_applies():
    prob = problem(10)
    model = make_model(0)
    names = tuple(n for n, _ in model.named_parameters())
    optimizer = AdaptiveAccumulationWrapper(
        torch.optim.SGD(model.parameters(), lr=0.5), NormTest(1.0), max_batch_draws=4
    )
    gns = AccumulationNoiseScale(model, update_rate=0.5, optimizer=optimizer)
    reference = MicrobatchNoiseScale(update_rate=0.5, block_names=names)
    window: list[tuple[list[torch.Tensor], int]] = []
    sizes = [5, 8, 3, 6, 7, 4, 9, 5, 6, 8, 3, 7]

    def record(size):  # the microbatch's own mean gradient, before the wrapper folds it
        window.append(([p.grad.clone() for p in model.parameters()], size))

    windows = 0
    for stepped in _loop(model, optimizer, prob.x, prob.y, sizes, record):
        if not stepped:
            continue
        windows += 1
        for grads, size in window:
            reference.observe_microbatch(torch.stack([(g * g).sum() for g in grads]), size)
        total = sum(size for _, size in window)
        mean = [sum(g[i] * size for g, size in window) / total for i in range(len(names))]
        want = reference.observe_step(torch.stack([(m * m).sum() for m in mean]))
        got = gns.estimate
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got.block_grad_norm_sq, want.block_grad_norm_sq)
            torch.testing.assert_close(got.block_trace_sigma, want.block_trace_sigma)
        window = []
    assert (
        windows >= 3
        and gns.estimate is not None
        and torch.isfinite(torch.tensor(gns.estimate.b_simple))
    )
    with pytest.raises(RuntimeError, match="called by the AdaptiveAccumulationWrapper"):
        gns.end_step()
    gns.remove()


def test_measuring_leaves_the_wrapped_training_bitwise_unchanged():
    prob = problem(10)
    sizes = [5, 8, 3, 6, 7, 4, 9, 5]
    finals = []
    for measured in (False, True):
        model = make_model(0)
        optimizer = AdaptiveAccumulationWrapper(
            torch.optim.SGD(model.parameters(), lr=0.5), NormTest(1.0), max_batch_draws=4
        )
        gns = AccumulationNoiseScale(model, optimizer=optimizer) if measured else None
        list(_loop(model, optimizer, prob.x, prob.y, sizes))
        finals.append([p.detach().clone() for p in model.parameters()])
        if gns is not None:
            gns.remove()
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


def test_the_manual_loop_with_a_wrapper_names_optimizer_instead_of_returning_inf():
    prob = problem(10)
    model = make_model(0)
    optimizer = AdaptiveAccumulationWrapper(
        torch.optim.SGD(model.parameters(), lr=0.5), NormTest(1e9)
    )
    with AccumulationNoiseScale(model) as gns:
        list(_loop(model, optimizer, prob.x, prob.y, [4, 4], gns.end_microbatch))
        with pytest.raises(RuntimeError, match=r"after 2 microbatch.*optimizer=wrapper"):
            gns.end_step()


def test_the_wrapper_never_changes_a_gradient_the_user_holds():
    model = torch.nn.Linear(3, 2)
    optimizer = AdaptiveAccumulationWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1), NormTest(1e-6)
    )
    held = []
    for count in (3.0, 5.0):
        model(torch.randn(4, 3)).pow(2).mean().backward()
        held.append([(p.grad, p.grad.clone()) for p in model.parameters()])
        optimizer.step(count=count)
    optimizer.flush()
    for grads in held:
        for tensor, copy in grads:
            assert torch.equal(tensor, copy)
