"""The framework-free pieces of the integrations, without a framework (fast tier)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grabkit.integrations.example_norms import ExampleGradientNorms
from grabkit.integrations.grouped_forward import check_padded_labels, right_padded_lengths
from grabkit.integrations.resume import adopt_rank, replay_state, rewound_state
from grabkit.order import GraBSampler


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(8, 4), torch.randint(0, 2, (8,))


def _reference(model, x, y, rows) -> torch.Tensor:
    norms = []
    for i in rows:
        loss = nn.functional.cross_entropy(model(x[[i]]), y[[i]])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    return torch.stack(norms)


def test_example_norms_of_every_backward_equal_per_example_autograd():
    model, x, y = _model_and_data()
    norms = ExampleGradientNorms(model)
    for part in (slice(0, 3), slice(3, 8)):  # two microbatches, one read
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
    got = norms.take()
    assert norms.summary() == {}  # nothing since the last read
    torch.testing.assert_close(got, _reference(model, x, y, range(8)), rtol=1e-5, atol=1e-6)
    summary = norms.summarize(got)
    median = float(torch.quantile(got.double(), 0.5))  # interpolated, as logged
    assert summary["grad_norm_per_example/median"] == pytest.approx(median, rel=1e-6)
    assert summary["grad_norm_per_example/count"] == 8
    norms.close()
    assert not model[0]._forward_hooks


def test_example_norms_from_a_sketching_sampler_estimate_the_norms():
    model, x, y = _model_and_data()
    sampler = GraBSampler(range(8), model=model, statistics="sketch", sketch_dim=4096, batch_size=4)
    norms = ExampleGradientNorms(model, stats=sampler.stats)  # the sampler's hooks, shared
    order = list(sampler)
    for part in (order[:4], order[4:]):
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        sampler.step()
    ratio = norms.take() / _reference(model, x, y, order)
    assert ratio.sub(1).abs().max() < 0.1  # unbiased squares, error ~ sqrt(2 / k) relative


def test_example_norms_over_shared_statistics_read_them_as_they_are_defined():
    """Shared statistics have their own loss reduction and model: a reduction or a model of
    the norms' own that differs would give other numbers than asked for (the statistics of
    'mean' read for a summed loss: B times the norms; those of a submodule: its part alone),
    so it is refused; left out, the reduction is the statistics'."""
    model, x, y = _model_and_data()
    head = GraBSampler(range(8), model=model[2], balance_type="pair", batch_size=8)
    with pytest.raises(ValueError, match=r"\['0\.weight', '0\.bias'\].*not measured.*stats\.model"):
        ExampleGradientNorms(model, stats=head.stats)
    head.close()
    sampler = GraBSampler(range(8), model=model, balance_type="pair", batch_size=8,
                          loss_reduction="sum")  # fmt: skip
    with pytest.raises(ValueError, match=r"loss_reduction='mean'.*'sum'"):
        ExampleGradientNorms(model, stats=sampler.stats, loss_reduction="mean")
    norms = ExampleGradientNorms(model, stats=sampler.stats)  # the statistics' own: "sum"
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    torch.testing.assert_close(norms.take(), _reference(model, x, y, range(8)))
    sampler.close()


def test_example_norms_divide_out_the_loss_scale_of_their_own_backward():
    """Norms taken at log time, after GradScaler updates grew the scale (a sampler stepped
    with grad_scale=scaler beside them): each backward's norms are divided by the scale its
    loss was multiplied by, not by the scale at the time they are read."""
    model, x, y = _model_and_data()
    sampler = GraBSampler(range(8), model=model, balance_type="pair", batch_size=2)
    norms = ExampleGradientNorms(model, stats=sampler.stats)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    norms.grad_scaler = scaler
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    order = list(sampler)
    for start in range(0, 8, 2):
        idx = order[start : start + 2]
        scaler.scale(nn.functional.cross_entropy(model(x[idx]), y[idx])).backward()
        sampler.step(grad_scale=scaler)
        scaler.step(optimizer)
        scaler.update()  # the scale doubles: 4, 8, 16, 32
        optimizer.zero_grad()
    assert scaler.get_scale() == 64.0
    torch.testing.assert_close(norms.take(), _reference(model, x, y, order), rtol=1e-5, atol=1e-6)
    norms.close()
    sampler.close()


@pytest.mark.parametrize("quantiles", [(), (0.5, 1.5), ("median",)])
def test_example_norms_refuse_bad_quantiles(quantiles):
    with pytest.raises(ValueError, match=r"quantiles should be numbers in \[0, 1\]"):
        ExampleGradientNorms.check_quantiles(quantiles)


def test_grouping_checks_the_padding():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert right_padded_lengths(mask).tolist() == [2, 3]
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        right_padded_lengths(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="labels at padded positions"):
        check_padded_labels(torch.tensor([[5, 6, 7], [1, 2, 3]]), mask)
    check_padded_labels(torch.tensor([[5, 6, -100], [1, 2, 3]]), mask)


def _state_after(steps: int, epoch_size: int = 8, prefetched: int = 4) -> dict:
    sampler = GraBSampler(range(epoch_size), balance_type="rr", batch_size=4)
    iterator = iter(sampler)
    for _ in range(min(steps * 4 + prefetched, epoch_size)):
        next(iterator)
    for _ in range(steps):
        sampler.skip(4)
    return sampler.state_dict()


def test_framework_states_mark_an_epoch_stepped_through_as_ended():
    middle, end = _state_after(1), _state_after(2)
    assert rewound_state(middle, 8)["yielded"] == 4 and not rewound_state(middle, 8)["ended"]
    assert replay_state(middle, 8)["yielded"] == 0 and not replay_state(middle, 8)["ended"]
    assert rewound_state(end, 8)["ended"] and replay_state(end, 8)["ended"]
    resumed = GraBSampler(range(8), balance_type="rr", batch_size=4)
    resumed.load_state_dict(rewound_state(end, 8))
    assert len(list(resumed)) == 8 and resumed.epoch == 1  # the next epoch, not an empty pass
    raw = GraBSampler(range(8), balance_type="rr", batch_size=4)
    raw.load_state_dict(end)  # the sampler's own snapshot: the epoch's empty rest first
    assert list(raw) == [] and len(list(raw)) == 8


def test_adopt_rank_takes_rank_0s_state_for_this_rank_only_at_the_same_world_size():
    state = {"config": {"num_replicas": 2, "rank": 0}, "live": {}}
    assert adopt_rank(state, 2, 1)["config"]["rank"] == 1
    assert adopt_rank(state, 4, 1)["config"]["rank"] == 0  # refused later, naming both


def test_example_norms_over_statistics_their_owner_closed_say_so():
    """A sampler closed while ExampleGradientNorms still reads its statistics: the backwards
    after it are measured by nothing, which the norms say instead of logging fewer norms."""
    model, x, y = _model_and_data()
    sampler = GraBSampler(range(8), model=model, balance_type="pair", batch_size=4)
    norms = ExampleGradientNorms(model, stats=sampler.stats)
    nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
    sampler.close()  # its statistics keep the backward that ran, and measure nothing more
    nn.functional.cross_entropy(model(x[4:]), y[4:]).backward()
    with pytest.warns(RuntimeWarning, match=r"closed by their owner.*not measured"):
        assert norms.take().shape == (4,)
