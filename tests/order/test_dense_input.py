"""Gradients passed to ``step(grads)`` and the epoch boundaries around them: every input the
sampler cannot attribute exactly raises, naming what and the fix, instead of balancing
something else; a resume followed by ``set_epoch`` continues as the uninterrupted run."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from grabkit import GraBBatchSampler, GraBSampler
from grabkit.order.orderings import ORDERINGS

#: every ordering that reads the gradients and needs nothing but them
BALANCING = sorted(
    k for k, cls in ORDERINGS.items() if cls.uses_gradients and not k.startswith("ntk-fixed")
)


def _grads(n: int = 12, d: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _saved(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# -- the gradient width ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BALANCING)
@pytest.mark.parametrize("width", [1, 7])
def test_a_gradient_width_other_than_the_first_steps_raises(kind, width):
    """Without params= the first step fixes the width: a later step of another width (a
    broadcasting (B, 1) among them) raises a ValueError and changes nothing."""
    sampler = GraBSampler(range(12), balance_type=kind)
    order = list(sampler)
    sampler.step(_grads(4, 5))
    with pytest.raises(ValueError, match=rf"length {width} per example.*first step.*5"):
        sampler.step(torch.randn(4, width, dtype=torch.float64))
    sampler.step(_grads(4, 5, seed=1))  # nothing moved: the same examples are next
    sampler.step(_grads(4, 5, seed=2))
    assert sorted(list(sampler)) == list(range(12)) and len(order) == 12


def test_the_width_holds_across_epochs():
    sampler = GraBSampler(range(6))
    list(sampler)
    sampler.step(_grads(6, 3))
    list(sampler)
    with pytest.raises(ValueError, match="first step"):
        sampler.step(_grads(6, 4))


def test_a_loaded_state_lets_the_next_step_fix_the_width_again():
    """The width this process stepped before a load is not the loaded run's."""
    wide = GraBSampler(range(6))
    list(itertools.islice(iter(wide), 3))
    wide.step(_grads(3, 7))
    sampler = GraBSampler(range(6))
    list(sampler)
    sampler.step(_grads(3, 5))
    sampler.load_state_dict(_saved(wide.state_dict()))
    list(sampler)  # the rest of the loaded epoch
    sampler.step(_grads(3, 7))
    assert sorted(list(sampler)) == list(range(6))


def test_complex_gradients_raise_a_type_error():
    sampler = GraBSampler(range(6))
    list(sampler)
    with pytest.raises(TypeError, match="complex"):
        sampler.step(torch.randn(3, 4, dtype=torch.complex64))


# -- dicts of per-example gradients ---------------------------------------------------------------
def test_dict_gradients_are_flattened_in_the_params_order_whatever_the_dict_order():
    """grab-sampler's dict form: the dict's own key order does not decide the layout."""
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}
    X = _grads(12, 5)
    in_order, reordered = GraBSampler(range(12), params), GraBSampler(range(12), params)
    for _ in range(3):
        order = list(in_order)
        assert list(reordered) == order
        for k, start in enumerate(range(0, 12, 4)):
            rows = X[order[start : start + 4]]
            named = {"a": rows[:, :3], "b": rows[:, 3:]}
            in_order.step(named)
            reordered.step(dict(reversed(named.items())) if k % 2 else named)
    assert in_order.order.tolist() == reordered.order.tolist()


def test_dict_key_order_is_fixed_by_the_first_step_without_params():
    X = _grads(12, 5)
    in_order, reordered = GraBSampler(range(12)), GraBSampler(range(12))
    order = list(in_order)
    assert list(reordered) == order
    for k, start in enumerate(range(0, 12, 4)):
        rows = X[order[start : start + 4]]
        in_order.step({"a": rows[:, :3], "b": rows[:, 3:]})
        swapped = k % 2 == 1
        reordered.step(
            {"b": rows[:, 3:], "a": rows[:, :3]}
            if swapped
            else {"a": rows[:, :3], "b": rows[:, 3:]}
        )
    assert list(in_order) == list(reordered)


@pytest.mark.parametrize(
    "grads, match",
    [
        ({"x": torch.zeros(4, 3), "y": torch.zeros(4, 2)}, r"names.*missing \['a', 'b'\]"),
        ({"a": torch.zeros(4, 2), "b": torch.zeros(4, 3)}, r"'a'.*\(2,\).*\(3,\)"),
        ({"a": torch.zeros(4, 3)}, r"missing \['b'\]"),
    ],
)
def test_dicts_of_other_names_or_shapes_than_params_raise(grads, match):
    sampler = GraBSampler(range(12), {"a": torch.zeros(3), "b": torch.zeros(2)})
    list(sampler)
    with pytest.raises(ValueError, match=match):
        sampler.step(grads)


def test_update_v_takes_a_dict_in_the_gradients_layout_whatever_its_order():
    """An optimiser state dict in another key order used to scale coordinates of the other
    parameters ("adamean" balancing in a scrambled geometry, without a word)."""
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}
    moment = {"a": torch.rand(3, dtype=torch.float64), "b": 50 * torch.rand(2, dtype=torch.float64)}
    X = _grads(12, 5)
    in_order = GraBSampler(range(12), params, balance_type="adamean")
    reordered = GraBSampler(range(12), params, balance_type="adamean")
    in_order.update_v(moment)
    reordered.update_v(dict(reversed(moment.items())))
    for _ in range(3):
        order = list(in_order)
        assert list(reordered) == order
        for start in range(0, 12, 4):
            in_order.step(X[order[start : start + 4]])
            reordered.step(X[order[start : start + 4]])
    assert in_order.order.tolist() == reordered.order.tolist()
    with pytest.raises(ValueError, match=r"update_v\(\).*missing \['b'\]"):
        in_order.update_v({"a": moment["a"]})


# -- positions -------------------------------------------------------------------------------
def test_stepping_examples_not_yet_yielded_raises():
    """Gradients of more examples than were handed out cannot be theirs."""
    sampler = GraBSampler(range(12))
    it = iter(sampler)
    batch = [next(it) for _ in range(3)]
    with pytest.raises(ValueError, match="yielded"):
        sampler.step(_grads(6))
    sampler.step(_grads(3)[: len(batch)])


def test_floating_point_indices_raise():
    sampler = GraBSampler(range(12))
    order = list(sampler)
    with pytest.raises(TypeError, match="indices"):
        sampler.step(_grads(3), indices=torch.tensor(order[:3], dtype=torch.float32))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_update_v_refuses_negative_or_non_finite_moments(bad):
    sampler = GraBSampler(range(12), balance_type="adamean")
    list(sampler)
    v = torch.ones(4)
    v[2] = bad
    with pytest.raises(ValueError, match="update_v"):
        sampler.update_v(v)


# -- resume, then set_epoch ----------------------------------------------------------------------
def _events(epochs: int = 3, batches: int = 4) -> list[tuple]:
    events: list[tuple] = []
    for epoch in range(epochs):
        events += [("set_epoch", epoch), ("iter",)]
        events += [("skip",) if (epoch, b) == (1, 1) else ("step",) for b in range(batches)]
    return events


def _play(sampler, events, X, log, it=None):
    for event in events:
        if event[0] == "set_epoch":
            sampler.set_epoch(event[1])
        elif event[0] == "iter":
            it = iter(sampler)
        else:
            batch = list(itertools.islice(it, 3))
            log.append(batch)
            if event[0] == "step":
                sampler.step(X[batch])
            else:
                sampler.skip(len(batch))
    return it


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive-pair", "rr"])
def test_a_loop_that_numbers_its_epochs_resumes_as_the_uninterrupted_run(kind):
    """``for epoch in range(start, E): sampler.set_epoch(epoch); for batch in loader: ...``
    resumed from a state saved anywhere (after a step, at the epoch's last step, after
    set_epoch, after a skipped batch): the batches and the final order of the uninterrupted
    run. A state saved at an epoch's end followed by set_epoch(next) used to replay an empty
    pass as the next epoch, and every later epoch came one epoch late."""
    X, events = _grads(12, 5), _events()
    full = GraBSampler(range(12), balance_type=kind, seed=3)
    full_log: list = []
    _play(full, events, X, full_log)
    for cut in range(1, len(events)):
        first = GraBSampler(range(12), balance_type=kind, seed=3)
        log: list = []
        _play(first, events[:cut], X, log)
        resumed = GraBSampler(range(12), balance_type=kind, seed=3)
        resumed.load_state_dict(_saved(first.state_dict()))
        rest = events[cut:]
        if events[cut - 1][0] != "set_epoch" and rest[0][0] != "set_epoch":
            rest = [("iter",), *rest]  # mid-epoch: the loop re-enters the epoch's loader
        _play(resumed, rest, X, log)
        assert log == full_log, (kind, cut, events[cut - 1])
        assert resumed.order.tolist() == full.order.tolist(), (kind, cut)


def test_a_state_at_the_epoch_end_without_set_epoch_still_resumes_with_an_empty_pass():
    """torchdata's convention is kept when the loop does not number the next epoch."""
    X = _grads()
    sampler = GraBSampler(range(12))
    order = list(sampler)
    sampler.step(X[order])
    resumed = GraBSampler(range(12))
    resumed.load_state_dict(_saved(sampler.state_dict()))
    assert list(resumed) == []
    assert list(resumed) == list(sampler)


# -- GraBBatchSampler's own settings --------------------------------------------------------------
@pytest.mark.parametrize("change", [{"batch_size": 4}, {"drop_last": True}])
def test_batch_sampler_refuses_a_state_of_another_batch_size_or_drop_last(change):
    saved = GraBBatchSampler(range(10), batch_size=3)
    batches = list(GraBBatchSampler(range(10), batch_size=3))  # the same first epoch
    assert next(iter(saved)) == batches[0]
    saved.step(_grads(10)[batches[0]])
    state = _saved(saved.state_dict())
    other = GraBBatchSampler(range(10), **{"batch_size": 3, **change})
    with pytest.raises(ValueError, match=f"batch_sampler_{next(iter(change))}"):
        other.load_state_dict(state)
    same = GraBBatchSampler(range(10), batch_size=3)
    same.load_state_dict(state)
    assert list(same) == batches[1:]
    plain = GraBSampler(range(10), batch_size=3)  # the sampler form keeps loading it
    plain.load_state_dict(state)
    assert list(plain) == [i for b in batches[1:] for i in b]


# -- precomputed kernels ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ntk-fixed", "ntk-fixed-eigen"])
@pytest.mark.parametrize("option", ["ntk_features", "ntk_kernel"])
def test_a_precomputed_kernel_with_nan_or_inf_raises(kind, option):
    """A NaN kernel used to give "ntk-fixed" an arbitrary fixed order without a word."""
    matrix = torch.eye(5, dtype=torch.float64)
    matrix[1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"`{option}` holds NaN or Inf"):
        GraBSampler(range(5), balance_type=kind, **{option: matrix})


# -- switches ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"prob_balance": "False"},
        {"random_first_epoch": "no"},
        {"balance_type": "norm", "descending_norm": "False"},
        {"drop_last": "False"},
        {"normalize": "False"},
    ],
)
def test_a_switch_given_as_a_string_raises_a_type_error(options):
    """A string from a config file or argparse ("False") used to be truthy: probabilistic
    balancing on, a dropped tail, a reversed norm order, without a word."""
    with pytest.raises(TypeError, match=next(iter(options.keys() - {"balance_type"}))):
        GraBSampler(range(10), **options)
    with pytest.raises(TypeError):
        GraBBatchSampler(range(10), batch_size=3, **options)


# -- ranks -------------------------------------------------------------------------------------
def _other_world_body(rank: int, world_size: int, payload: None) -> str:
    sampler = GraBSampler(range(12), num_replicas=3, rank=rank)
    list(sampler)
    try:
        sampler.step(_grads(2, 3))
    except ValueError as error:
        return str(error)
    return "stepped"


@pytest.mark.distributed
def test_num_replicas_other_than_the_world_size_raises_a_clear_error():
    """Two processes told num_replicas=3 failed inside gloo's all_gather (a RuntimeError about
    tensor lists); the message now names num_replicas and the fix."""
    from tests.support.distributed import run_distributed

    for message in run_distributed(_other_world_body, world_size=2, payload=None):
        assert "num_replicas=3, but the process group has 2 ranks" in message
