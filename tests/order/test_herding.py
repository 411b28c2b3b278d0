"""Herding bound: exact against a brute-force loop, streaming against exact."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grabkit.order.herding as herding
from grabkit.order.herding import StreamingHerdingBound, herding_bound


def brute_force_bound(vectors, order, mean) -> float:
    """max over prefixes of the inf-norm of the centred prefix sum, one example at a time."""
    running = [0.0] * vectors.shape[1]
    best = 0.0
    for index in order:
        for j in range(vectors.shape[1]):
            running[j] += float(vectors[index, j]) - float(mean[j])
        best = max(best, max(abs(v) for v in running))
    return best


@st.composite
def vectors_and_order(draw):
    n = draw(st.integers(1, 12))
    d = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    vectors = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
    order = torch.randperm(n, generator=g)
    return vectors, order


@given(vectors_and_order(), st.booleans())
@settings(max_examples=60, deadline=None)
def test_exact_bound_equals_brute_force(data, give_mean):
    vectors, order = data
    mean = torch.randn(vectors.shape[1], dtype=torch.float64) if give_mean else None
    reference_mean = mean if give_mean else vectors.mean(dim=0)
    expected = brute_force_bound(vectors, order.tolist(), reference_mean)
    assert herding_bound(vectors, order, mean) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@given(vectors_and_order(), st.lists(st.integers(0, 12), max_size=4))
@settings(max_examples=60, deadline=None)
def test_streaming_equals_exact_for_any_batching(data, cuts):
    vectors, order = data
    mean = vectors.mean(dim=0)
    ordered = vectors[order]
    bounds = sorted({0, len(order), *(min(c, len(order)) for c in cuts)})
    stream = StreamingHerdingBound(mean)
    for start, stop in itertools.pairwise(bounds):
        stream.update(ordered[start:stop])
    assert stream.count == len(order)
    assert stream.compute() == pytest.approx(herding_bound(vectors, order), rel=1e-9, abs=1e-12)
    low, high = stream.compute_interval()
    assert low == pytest.approx(high, abs=1e-9)


def test_small_example_by_hand():
    vectors = torch.tensor([[1.0, 0.0], [-1.0, 2.0], [3.0, -2.0], [-3.0, 0.0]])  # mean 0
    assert herding_bound(vectors) == 3.0  # prefix sums (1,0) (0,2) (3,0) (0,0)
    assert herding_bound(vectors, [0, 3, 2, 1]) == 2.0  # (1,0) (-2,0) (1,-2) (0,0)
    assert herding_bound(vectors, [0, 1], mean=torch.zeros(2)) == 2.0


def test_defaults_are_identity_order_and_exact_mean():
    vectors = torch.randn(20, 3)
    explicit = herding_bound(vectors, torch.arange(20), vectors.double().mean(0))
    assert herding_bound(vectors) == pytest.approx(explicit, rel=1e-12)


def test_partial_and_repeating_orders_are_measured_as_given():
    vectors = torch.randn(6, 2, dtype=torch.float64)
    mean = vectors.mean(dim=0)
    for order in ([4, 1, 0], [2, 2, 5, 2], []):
        expected = brute_force_bound(vectors, order, mean)
        assert herding_bound(vectors, order) == pytest.approx(expected, abs=1e-12)


def test_blocks_give_the_same_answer(monkeypatch):
    vectors = torch.randn(50, 7)
    order = torch.randperm(50)
    whole = herding_bound(vectors, order)
    monkeypatch.setattr(herding, "_BLOCK_ELEMENTS", 10)  # one row per block
    assert herding_bound(vectors, order) == pytest.approx(whole, rel=1e-12)


def test_good_order_beats_a_bad_one():
    # +1/-1 alternating keeps prefix sums at 1; all +1 first climbs to n/2.
    vectors = torch.tensor([[1.0]] * 10 + [[-1.0]] * 10)
    alternating = [i // 2 if i % 2 == 0 else 10 + i // 2 for i in range(20)]
    assert herding_bound(vectors, alternating) == 1.0
    assert herding_bound(vectors) == 10.0


def test_stale_mean_interval_brackets_the_exact_bound():
    g = torch.Generator().manual_seed(3)
    vectors = torch.randn(40, 6, generator=g, dtype=torch.float64) + 0.5
    stale = vectors.mean(dim=0) + 0.05 * torch.randn(6, generator=g, dtype=torch.float64)
    stream = StreamingHerdingBound(stale)
    for batch in vectors.split(7):
        stream.update(batch)
    torch.testing.assert_close(stream.seen_mean(), vectors.mean(dim=0))
    assert stream.compute() == pytest.approx(herding_bound(vectors, mean=stale), rel=1e-12)
    low, high = stream.compute_interval()
    assert low <= herding_bound(vectors) <= high
    assert low < high


def test_state_dict_round_trip_resumes_exactly():
    vectors = torch.randn(30, 4, dtype=torch.float64)
    mean = vectors.mean(dim=0)
    stream = StreamingHerdingBound(mean)
    stream.update(vectors[:13])
    buffer = io.BytesIO()
    torch.save(stream.state_dict(), buffer)
    buffer.seek(0)
    resumed = StreamingHerdingBound(torch.zeros(4))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.update(vectors[13:])
    stream.update(vectors[13:])
    assert resumed.compute() == stream.compute() == pytest.approx(herding_bound(vectors))
    assert resumed.count == 30


def test_reset_and_empty_stream():
    stream = StreamingHerdingBound(torch.zeros(3))
    assert stream.compute() == 0.0 and stream.compute_interval() == (0.0, 0.0)
    stream.update(torch.ones(3))
    stream.update(torch.ones(0, 3))
    assert stream.compute() == 1.0 and stream.count == 1
    stream.reset()
    assert stream.compute() == 0.0 and stream.count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    vectors = torch.randn(64, 9)
    order = torch.randperm(64)
    assert herding_bound(vectors.cuda(), order) == pytest.approx(herding_bound(vectors, order))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: herding_bound(torch.randn(5)), ValueError, r"\(n, d\) matrix"),
        (lambda: herding_bound([[1.0]]), TypeError, "`vectors` should be a torch.Tensor"),
        (lambda: herding_bound(torch.randn(0, 3)), ValueError, "at least one row"),
        (lambda: herding_bound(torch.randn(4, 2), [0, 4]), ValueError, r"in \[0, 3\]"),
        (lambda: herding_bound(torch.randn(4, 2), [-1]), ValueError, "from -1 to -1"),
        (lambda: herding_bound(torch.randn(4, 2), torch.tensor([0.0])), TypeError, "integer"),
        (lambda: herding_bound(torch.randn(4, 2), torch.zeros(2, 2)), ValueError, "1-D"),
        (lambda: herding_bound(torch.randn(4, 2), 3), TypeError, "sequence of indices"),
        (lambda: herding_bound(torch.randn(4, 2), None, torch.zeros(3)), ValueError, r"\(2,\)"),
        (lambda: StreamingHerdingBound(torch.zeros(2, 2)), ValueError, r"1-D \(d,\)"),
        (lambda: StreamingHerdingBound(torch.zeros(2)).update(torch.ones(3)), ValueError, "(B, 2)"),
        (lambda: StreamingHerdingBound(torch.zeros(2)).update([1, 2]), TypeError, "torch.Tensor"),
        (lambda: StreamingHerdingBound(torch.zeros(2)).seen_mean(), ValueError, "no vectors"),
        (
            lambda: StreamingHerdingBound(torch.zeros(2)).load_state_dict({"mean": 1}),
            ValueError,
            "should have keys",
        ),
        (
            lambda: StreamingHerdingBound(torch.zeros(2)).load_state_dict(
                StreamingHerdingBound(torch.zeros(3)).state_dict()
            ),
            ValueError,
            "d=2",
        ),
    ],
)
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
