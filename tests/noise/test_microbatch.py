"""MicrobatchNoiseScale (norms in) and AccumulationNoiseScale (hooks) against exact truth."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from tests.noise.helpers import Z_LIMIT, linear_losses, per_example_loss, problem, z_score
from tests.support.device_sends import DeviceSends

from grabkit.group import backward_by_group, group_batch, plan_from_partition
from grabkit.noise import AccumulationNoiseScale, MicrobatchNoiseScale


def _microbatch_norms(prob, index: torch.Tensor, sizes: list[int]):
    """Per-block |g_k|^2 of each microbatch's mean gradient and |G_B|^2 of the step mean."""
    grads = prob.per_example[index]
    parts = torch.split(grads, sizes)
    micro = [prob.block_sq(p.mean(0)) for p in parts]
    return micro, prob.block_sq(grads.mean(0))


@pytest.mark.parametrize("sizes", [[16, 16, 16, 16], [5, 20, 9]])
def test_step_estimates_are_unbiased_without_replacement(sizes):
    prob = problem(10)
    expected_g, expected_t = prob.expected_without_replacement()
    true_g, true_t = prob.truth()
    gen = torch.Generator().manual_seed(1)
    est = MicrobatchNoiseScale(block_names=prob.names)
    corrected = MicrobatchNoiseScale(block_names=prob.names, population_size=prob.n)
    g_draws, t_draws, g_fixed, t_fixed = [], [], [], []
    for _ in range(400):
        index = torch.randperm(prob.n, generator=gen)[: sum(sizes)]
        micro, big = _microbatch_norms(prob, index, sizes)
        for norm, size in zip(micro, sizes, strict=True):
            est.observe_microbatch(norm, size)
            corrected.observe_microbatch(norm, size)
        g, t, examples = est.step_estimates(big)
        assert examples == sum(sizes)
        g_draws.append(g)
        t_draws.append(t)
        corrected.observe_step(big)
        g_fixed.append(corrected.tracker.last_observation[0].sum())
        t_fixed.append(corrected.tracker.last_observation[1].sum())
    g_draws, t_draws = torch.stack(g_draws), torch.stack(t_draws)
    assert abs(z_score(g_draws.sum(1), float(expected_g.sum()))) < Z_LIMIT
    assert abs(z_score(t_draws.sum(1), float(expected_t.sum()))) < Z_LIMIT
    for block in range(len(prob.names)):  # per-block estimates are unbiased too
        assert abs(z_score(t_draws[:, block], float(expected_t[block]))) < Z_LIMIT
    # with population_size the finite-population correction makes them unbiased for the truth
    assert abs(z_score(torch.stack(g_fixed), float(true_g.sum()))) < Z_LIMIT
    assert abs(z_score(torch.stack(t_fixed), float(true_t.sum()))) < Z_LIMIT


def _hooked_step(model, gns, x, y, sizes, scaler=None):
    total = sum(sizes)
    for xs, ys in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True):
        loss = per_example_loss(model, xs, ys).mean() * len(xs) / total
        (scaler.scale(loss) if scaler is not None else loss).backward()
        gns.end_microbatch(len(xs))
    return gns.end_step()


@pytest.mark.parametrize("sizes", [[7, 12, 5], [3, 2, 4, 3, 2, 5, 3, 2, 4, 3, 2]])
def test_hooks_measure_the_same_norms_as_torch_func(sizes):
    prob = problem(10)
    model = prob.model
    index = torch.arange(100, 100 + sum(sizes))
    gns = AccumulationNoiseScale(model, update_rate=1.0)
    model.zero_grad()
    hooked = _hooked_step(model, gns, prob.x[index], prob.y[index], sizes)
    reference = MicrobatchNoiseScale(update_rate=1.0, block_names=prob.names)
    micro, big = _microbatch_norms(prob, index, sizes)
    for norm, size in zip(micro, sizes, strict=True):
        reference.observe_microbatch(norm, size)
    expected = reference.observe_step(big)
    torch.testing.assert_close(hooked.block_grad_norm_sq, expected.block_grad_norm_sq)
    torch.testing.assert_close(hooked.block_trace_sigma, expected.block_trace_sigma)
    assert hooked.block_names == prob.names
    gns.remove()
    model.zero_grad()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gradients_give_the_cpu_result():
    prob = problem(10)
    index = torch.arange(24)
    results = []
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(prob.model).to(device)
        model.zero_grad()
        x, y = prob.x[index].to(device), prob.y[index].to(device)
        with AccumulationNoiseScale(model, update_rate=1.0) as gns:
            results.append(_hooked_step(model, gns, x, y, [7, 12, 5]))
    on_cpu, on_cuda = results
    torch.testing.assert_close(on_cuda.block_trace_sigma.cpu(), on_cpu.block_trace_sigma)
    torch.testing.assert_close(on_cuda.block_grad_norm_sq.cpu(), on_cpu.block_grad_norm_sq)


def test_an_accumulation_step_sends_to_the_device_only_without_waiting(monkeypatch):
    # on a GPU a send from pageable memory waits for the device; on the CPU each is counted
    prob = problem(10)
    index = torch.arange(24)
    with AccumulationNoiseScale(prob.model, update_rate=1.0) as gns:
        for _ in range(2):
            prob.model.zero_grad()
            sends = DeviceSends(monkeypatch)
            _hooked_step(prob.model, gns, prob.x[index], prob.y[index], [7, 12, 5])
            monkeypatch.undo()
            assert sends.sites == [], sends.sites


def test_two_backward_passes_in_one_microbatch_are_rejected():
    """Each backward is measured on its own, so two before one end_microbatch cannot be used."""
    model = torch.nn.Linear(3, 1)
    with AccumulationNoiseScale(model) as gns:
        model(torch.ones(2, 3)).sum().backward()
        model(torch.zeros(2, 3)).sum().backward()
        with pytest.raises(RuntimeError, match="after every backward"):
            gns.end_microbatch(4)
        model.zero_grad()  # the refused backwards' gradients: a step on top of them is left out
        for _ in range(2):  # the documented way: one end_microbatch per backward
            model(torch.ones(2, 3)).sum().backward()
            gns.end_microbatch(2)
        assert gns.end_step() is not None


def test_backward_by_group_in_one_microbatch_is_rejected_naming_it():
    """backward_by_group runs a backward per length group: refused, naming the runner to use."""
    model = torch.nn.Linear(3, 1)
    lengths = torch.tensor([1, 3, 2, 3])
    plan = plan_from_partition([[0, 2], [1, 3]], lengths)
    batch = group_batch(torch.ones(4, 3, 3), lengths, plan)
    with AccumulationNoiseScale(model) as gns:
        backward_by_group(lambda x: model(x).sum((1, 2)), batch, lambda out, items: out)
        with pytest.raises(RuntimeError, match=r"backward_by_group.*GroupedBatch\.run"):
            gns.end_microbatch(4)
        batch.run(lambda x: model(x).sum((1, 2))).mean().backward()  # one backward: measured
        gns.end_microbatch(4)


def test_a_block_without_gradient_in_a_microbatch_counts_as_zero():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    with AccumulationNoiseScale([("a", a), ("b", b)], update_rate=1.0) as gns:
        ((a * a).sum() + 2 * b.sum()).backward()  # d_1: a -> (2, 4), b -> 2
        gns.end_microbatch(1)
        (3 * a.sum()).backward()  # d_2: a -> (3, 3), b: no gradient
        gns.end_microbatch(1)
        measured = gns.end_step()
    reference = MicrobatchNoiseScale(update_rate=1.0, block_names=("a", "b"))
    # |g_k|^2 = |d_k|^2 (B / n_k)^2 with B / n_k = 2; the step gradient is G = (5, 7), (2)
    reference.observe_microbatch(torch.tensor([20.0, 4.0]) * 4, 1)
    reference.observe_microbatch(torch.tensor([18.0, 0.0]) * 4, 1)
    expected = reference.observe_step(torch.tensor([74.0, 4.0]))
    torch.testing.assert_close(measured.block_grad_norm_sq, expected.block_grad_norm_sq)
    torch.testing.assert_close(measured.block_trace_sigma, expected.block_trace_sigma)


@pytest.mark.slow  # convergence: many simulated steps
def test_ema_converges_to_the_truth():
    prob = problem(10)
    gen = torch.Generator().manual_seed(2)
    _, weights = linear_losses(prob, torch.arange(1))
    with AccumulationNoiseScale(list(weights.items()), update_rate=0.005) as gns:
        for _ in range(800):
            index = torch.randint(prob.n, (64,), generator=gen)  # with replacement: no FPC
            for w in weights.values():
                w.grad = None
            for part in index.chunk(4):
                loss, _ = linear_losses(prob, part, weights)
                (loss.mean() / 4).backward()
                gns.end_microbatch(len(part))
            result = gns.end_step()
    truth = prob.b_simple()
    assert abs(result.b_simple - truth) < 0.1 * truth
    low, high = result.interval
    assert low < truth < high
    assert result.observations == 800 and result.examples == 800 * 64


def test_grad_scaler_and_clipping_after_measuring_leave_the_estimate_unchanged():
    prob = problem(10)
    model = prob.model
    index = torch.arange(40)
    sizes = [10, 10, 20]
    results = []
    for scaler, clip in [(None, False), (torch.amp.GradScaler("cpu", init_scale=1024.0), True)]:
        model.zero_grad()
        with AccumulationNoiseScale(model, update_rate=1.0, grad_scaler=scaler) as gns:
            result = _hooked_step(model, gns, prob.x[index], prob.y[index], sizes, scaler)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            results.append((result, gns.estimate))
    model.zero_grad()
    (plain, _), (scaled, after_clip) = results
    assert plain.trace_sigma == pytest.approx(scaled.trace_sigma, rel=1e-9)
    assert plain.grad_norm_sq == pytest.approx(scaled.grad_norm_sq, rel=1e-9)
    assert after_clip.b_simple == scaled.b_simple


def test_single_microbatch_steps_carry_no_information():
    est = MicrobatchNoiseScale()
    est.observe_microbatch(1.0, 8)
    assert est.observe_step(1.0) is None
    assert est.pending_microbatches == 0


def test_state_dict_round_trips_through_weights_only_load():
    def feed(est, steps):
        for i in range(steps):
            est.observe_microbatch(torch.tensor([1.0 + i, 2.0]), 4)
            est.observe_microbatch(torch.tensor([2.0, 1.0 + 0.5 * i]), 4)
            est.observe_step(torch.tensor([1.2, 1.1]))

    names = ("w", "b")
    whole = MicrobatchNoiseScale(update_rate=0.1, block_names=names)
    feed(whole, 6)
    first = MicrobatchNoiseScale(update_rate=0.1, block_names=names)
    feed(first, 3)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = MicrobatchNoiseScale(update_rate=0.1, block_names=names)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for i in range(3, 6):
        resumed.observe_microbatch(torch.tensor([1.0 + i, 2.0]), 4)
        resumed.observe_microbatch(torch.tensor([2.0, 1.0 + 0.5 * i]), 4)
        resumed.observe_step(torch.tensor([1.2, 1.1]))
    assert resumed.estimate.b_simple == pytest.approx(whole.estimate.b_simple, rel=1e-12)
    assert resumed.estimate.interval == pytest.approx(whole.estimate.interval, rel=1e-9)

    with pytest.raises(ValueError, match="blocks"):
        MicrobatchNoiseScale(block_names=("other", "b")).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="keys"):
        resumed.load_state_dict({**first.state_dict(), "extra": 1})


def test_bad_input_is_rejected_with_a_clear_message():
    est = MicrobatchNoiseScale(block_names=("a", "b"))
    with pytest.raises(ValueError, match="count"):
        est.observe_microbatch(1.0, 0)
    with pytest.raises(ValueError, match="update_rate"):
        MicrobatchNoiseScale(update_rate=0.0)
    with pytest.raises(ValueError, match="window"):
        MicrobatchNoiseScale(window="epochs")
    with pytest.raises(ValueError, match="population_size"):
        MicrobatchNoiseScale(population_size=1)
    est.observe_microbatch(torch.ones(2), 4)
    est.observe_microbatch(torch.ones(2), 4)
    with pytest.raises(ValueError, match="block"):
        est.observe_step(1.0)
    with pytest.raises(ValueError, match="K = len"):
        est.observe_microbatches(torch.ones(3, 2), [4, 4])
    with pytest.raises(ValueError, match="requires grad"):
        AccumulationNoiseScale(torch.nn.Linear(2, 2).requires_grad_(False))

    model = torch.nn.Linear(3, 1)
    with AccumulationNoiseScale(model) as gns:
        model(torch.ones(2, 3)).sum().backward()
        with pytest.raises(RuntimeError, match="end_microbatch"):
            gns.end_step()


def test_example_window_weighs_a_step_by_its_examples():
    by_steps = MicrobatchNoiseScale(update_rate=0.5)
    by_examples = MicrobatchNoiseScale(update_rate=1 - 0.5**0.25, window="examples")
    for est in (by_steps, by_examples):
        for big in (1.0, 2.0, 1.5):
            est.observe_microbatch(3.0, 2)
            est.observe_microbatch(2.0 * big, 2)
            est.observe_step(big)
    assert by_steps.estimate.b_simple == pytest.approx(by_examples.estimate.b_simple)
