"""PerExampleNoiseScale: exact truth, finite-population sampling, PerSampleStats input, errors."""

from __future__ import annotations

import io

import pytest
import torch
from tests.noise.helpers import Z_LIMIT, per_example_loss, problem, z_score

from grabkit.noise import PerExampleNoiseScale


def _norms(prob, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) per-example block norms and (P,) block norms of the batch mean gradient."""
    grads = prob.per_example[index]
    return prob.block_sq(grads), prob.block_sq(grads.mean(0))


def test_estimates_are_unbiased_without_replacement():
    prob = problem(10)
    expected_g, expected_t = prob.expected_without_replacement()
    gen = torch.Generator().manual_seed(6)
    draws = [
        PerExampleNoiseScale.step_estimates(
            *_norms(prob, torch.randperm(prob.n, generator=gen)[:24])
        )
        for _ in range(400)
    ]
    g = torch.stack([d[0] for d in draws])
    t = torch.stack([d[1] for d in draws])
    assert abs(z_score(g.sum(1), float(expected_g.sum()))) < Z_LIMIT
    assert abs(z_score(t.sum(1), float(expected_t.sum()))) < Z_LIMIT
    for block in range(len(prob.names)):
        assert abs(z_score(g[:, block], float(expected_g[block]))) < Z_LIMIT


@pytest.mark.slow  # convergence: many simulated steps
def test_ema_converges_to_the_truth_and_windows_in_examples():
    prob = problem(10)
    gen = torch.Generator().manual_seed(7)
    by_steps = PerExampleNoiseScale(update_rate=0.004, block_names=prob.names)
    by_examples = PerExampleNoiseScale(update_rate=0.004 / 32, window="examples")
    for _ in range(1000):
        norms, mean_sq = _norms(prob, torch.randint(prob.n, (32,), generator=gen))
        by_steps.observe(norms, mean_sq)
        by_examples.observe(norms.sum(1), mean_sq.sum())
    truth = prob.b_simple()
    for est in (by_steps, by_examples):
        result = est.estimate
        assert abs(result.b_simple - truth) < 0.1 * truth
        assert result.interval[0] < truth < result.interval[1]
    torch.testing.assert_close(  # per block: tr(Sigma) is well determined in every block
        by_steps.estimate.block_trace_sigma, prob.truth()[1], rtol=0.1, atol=0.0
    )


def test_reads_per_sample_stats_like_torch_func():
    pytest.importorskip("grabkit.stats")
    from grabkit.stats import PerSampleStats

    prob = problem(10)
    index = torch.arange(200, 232)
    norms, mean_sq = _norms(prob, index)
    expected = PerExampleNoiseScale(update_rate=1.0, block_names=prob.names).observe(norms, mean_sq)
    with PerSampleStats(prob.model) as stats:
        prob.model.zero_grad()
        per_example_loss(prob.model, prob.x[index], prob.y[index]).mean().backward()
        per_block = PerExampleNoiseScale.for_stats(stats, update_rate=1.0).observe_stats(stats)
        total = PerExampleNoiseScale(update_rate=1.0).observe_stats(stats)
        scaled = PerExampleNoiseScale(update_rate=1.0).observe(
            stats.norms_squared() * 64.0, float(mean_sq.sum()) * 64.0, grad_scale=8.0
        )
    prob.model.zero_grad()
    assert per_block.block_names == prob.names
    torch.testing.assert_close(per_block.block_trace_sigma, expected.block_trace_sigma)
    torch.testing.assert_close(per_block.block_grad_norm_sq, expected.block_grad_norm_sq)
    assert total.b_simple == pytest.approx(expected.b_simple, rel=1e-9)
    assert scaled.b_simple == pytest.approx(expected.b_simple, rel=1e-9)


def test_state_dict_round_trips_through_weights_only_load():
    prob = problem(10)
    est = PerExampleNoiseScale(update_rate=0.3, block_names=prob.names)
    est.observe(*_norms(prob, torch.arange(10)))
    buffer = io.BytesIO()
    torch.save(est.state_dict(), buffer)
    buffer.seek(0)
    resumed = PerExampleNoiseScale(update_rate=0.3, block_names=prob.names)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for e in (est, resumed):
        e.observe(*_norms(prob, torch.arange(10, 30)))
    assert resumed.estimate.b_simple == est.estimate.b_simple
    with pytest.raises(ValueError, match="keys"):
        resumed.load_state_dict({})


def test_bad_input_is_rejected_with_a_clear_message():
    est = PerExampleNoiseScale()
    with pytest.raises(ValueError, match="at least 2 examples"):
        est.observe(torch.ones(1), 1.0)
    with pytest.raises(ValueError, match=r"\(B,\) or \(B, P\)"):
        est.observe(torch.ones(2, 2, 2), 1.0)
    with pytest.raises(ValueError, match="block"):
        est.observe(torch.ones(4, 3), 1.0)
    with pytest.raises(ValueError, match="grad_scale"):
        est.observe(torch.ones(4), 1.0, grad_scale=0.0)


def test_observe_stats_folds_each_backward_once_from_exact_statistics_only():
    """A second observe_stats of one backward (a per-microbatch call and a window's end after
    the same last backward) would fold its batch twice; sketched statistics hold estimated
    norms and no batch gradient: both refused, naming what to do."""
    from grabkit.stats import PerSampleStats
    from grabkit.stats.sketch import SketchedStats

    prob = problem(10)
    model = prob.model
    estimator = PerExampleNoiseScale(update_rate=1.0)
    with PerSampleStats(model) as stats:
        model.zero_grad()
        per_example_loss(model, prob.x[:16], prob.y[:16]).mean().backward()
        estimator.observe_stats(stats)
        with pytest.raises(ValueError, match="already folded"):
            estimator.observe_stats(stats)
        model.zero_grad()
        per_example_loss(model, prob.x[16:32], prob.y[16:32]).mean().backward()
        assert estimator.observe_stats(stats).observations == 2
    with SketchedStats(model, dim=64) as sketched:
        per_example_loss(model, prob.x[:16], prob.y[:16]).mean().backward()
        with pytest.raises(TypeError, match=r"SketchedStats.*observe\("):
            PerExampleNoiseScale().observe_stats(sketched)
    model.zero_grad()
