"""GraBSampler: epochs, inputs, errors, resuming, DataLoader use, hook mode, the batch form."""

from __future__ import annotations

import copy
import io
import pickle
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.order.reference import ReferenceBalancer, own_options
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from grabkit import GraBBatchSampler, GraBSampler
from grabkit.integrations.resume import rewound_state
from grabkit.order import BALANCE_TYPES
from grabkit.stats.gradient_batch import DenseGradientBatch

PERMUTING = [b for b in BALANCE_TYPES if b != "swr"]  # swr samples with replacement


def make_sampler(kind: str, n: int, X: torch.Tensor, **kwargs) -> GraBSampler:
    if kind.startswith("ntk"):
        kwargs.setdefault("ntk_features", X)
    return GraBSampler(range(n), balance_type=kind, **kwargs)


def run_epoch(sampler: GraBSampler, X: torch.Tensor, batch_size: int, limit=None) -> list[int]:
    order = list(sampler)
    stop = len(order) if limit is None else limit
    for start in range(0, stop, batch_size):
        sampler.step(X[order[start : min(start + batch_size, stop)]])
    return order


# -- every epoch is a permutation ------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(PERMUTING),
    n=st.integers(1, 17),
    batch_size=st.integers(1, 6),
    probabilistic=st.booleans(),
    seed=st.integers(0, 1000),
    partial_epoch=st.booleans(),
)
def test_every_epoch_is_a_permutation(kind, n, batch_size, probabilistic, seed, partial_epoch):
    X = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sampler = make_sampler(
        kind, n, X, prob_balance=probabilistic, seed=seed, **own_options(kind, depth=2)
    )
    for epoch in range(3):
        limit = n // 2 if partial_epoch and epoch == 1 else None
        order = run_epoch(sampler, X, batch_size, limit)
        assert sorted(order) == list(range(n)), (kind, epoch, order)


def test_swr_samples_with_replacement():
    sampler = GraBSampler(range(50), balance_type="swr", seed=1)
    first, second = list(sampler), list(sampler)
    assert len(first) == 50 and all(0 <= i < 50 for i in first)
    assert len(set(first)) < 50 and first != second


# -- epoch semantics ----------------------------------------------------------------------------
def test_plus_to_front_minus_to_back_reversed():
    # 1-d gradients: deterministic signs are easy to follow by hand
    X = torch.tensor([[1.0], [1.0], [1.0], [-1.0]], dtype=torch.float64)
    sampler = GraBSampler(range(4), balance_type="mean", random_first_epoch=False)
    assert list(sampler) == [0, 1, 2, 3]
    # grab-sampler's rule, +1 iff <s, z> < 0: s = 0 -> - (0), <-1, 1> < 0 -> + (1), s = 0 -> - (2),
    # <-1, -1> > 0 -> - (3); front [1], back [0, 2, 3] reversed
    sampler.step(X)
    assert list(sampler) == [1, 3, 2, 0]


def test_iter_twice_without_progress_repeats_the_epoch():
    sampler = GraBSampler(range(10), balance_type="rr", seed=0)
    it1 = iter(sampler)
    it2 = iter(sampler)
    assert list(it2) == list(sampler.order)
    assert list(it1) == []  # an older iterator stops once a newer one took over
    assert sampler.epoch == 0
    list(sampler)  # the epoch was consumed: this is epoch 1
    assert sampler.epoch == 1


def test_abandoned_epoch_keeps_unvisited_in_the_middle():
    X = torch.randn(12, 3, dtype=torch.float64)
    sampler = GraBSampler(range(12), balance_type="mean")
    order = run_epoch(sampler, X, 4, limit=8)
    nxt = list(sampler)
    assert sorted(nxt) == list(range(12))
    # examples never stepped keep their relative order, between front and back parts
    unvisited = order[8:]
    positions = [nxt.index(i) for i in unvisited]
    assert positions == sorted(positions)
    assert positions == list(range(positions[0], positions[0] + 4))


def test_odd_n_with_pair_balance_and_batches_of_one():
    X = torch.randn(7, 3, dtype=torch.float64)
    sampler = GraBSampler(range(7), balance_type="pair")
    for _ in range(3):
        order = run_epoch(sampler, X, 1)
        assert sorted(order) == list(range(7))
    # the unpaired last example sits between the front and back halves
    order = list(sampler)
    sampler2 = GraBSampler(range(7), balance_type="pair")
    assert sorted(order) == list(range(7)) and len(sampler2) == 7


def test_more_gradients_than_the_epoch_has_left_is_an_error():
    sampler = GraBSampler(range(5))
    list(sampler)
    sampler.step(torch.randn(4, 3))
    with pytest.raises(ValueError, match="only 1 of its 5 examples left"):
        sampler.step(torch.randn(2, 3))
    sampler.step(torch.randn(1, 3))  # the rest still fits; state was unchanged by the error


def test_a_step_before_the_first_iter_is_refused_when_the_loop_then_iterates():
    """One step() before the loop's first iter() (a warm-up backward on a batch the sampler
    never handed out): on the old code its gradients went to the first B examples of epoch 0,
    and iter() then ended that epoch and began epoch 1, so the loop's first epoch was never
    balanced, silently. The loop's iter() now refuses, and nothing changed."""
    sampler = GraBSampler(range(8), balance_type="mean", batch_size=2)
    sampler.step(torch.randn(2, 3))
    before = copy.deepcopy(sampler.state_dict())
    with pytest.raises(ValueError, match="before the first iter"):
        iter(sampler)
    assert sampler.epoch == 0
    _assert_same_state(sampler.state_dict(), before)


def test_an_epoch_driven_by_its_order_without_iter_is_stepped_whole():
    """Stepping a whole epoch through ``sampler.order`` without iterating, then iter(): the
    supported way to drive the sampler without a loader, as before."""
    grads = torch.randn(8, 3, dtype=torch.float64)
    driven = GraBSampler(range(8), balance_type="mean", batch_size=2)
    iterated = GraBSampler(range(8), balance_type="mean", batch_size=2)
    for _ in range(3):
        order = driven.order.tolist()
        for k in range(0, 8, 2):
            driven.step(grads[order[k : k + 2]])
        iter(driven)
        yielded = list(iterated)
        for k in range(0, 8, 2):
            iterated.step(grads[yielded[k : k + 2]])
    assert driven.order.tolist() == list(iter(iterated))


def test_drop_last_loader_leaves_last_examples_unstepped():
    X = torch.randn(10, 3, dtype=torch.float64)
    ds = TensorDataset(X)
    sampler = GraBSampler(ds, balance_type="mean")
    loader = DataLoader(ds, sampler=sampler, batch_size=4, drop_last=True)
    for _ in range(3):
        seen = []
        for (x,) in loader:
            sampler.step(x)
            seen.append(len(x))
        assert seen == [4, 4]
    assert sorted(sampler.order.tolist()) == list(range(10))


def test_non_finite_gradients_raise_and_change_nothing():
    sampler = GraBSampler(range(6))
    list(sampler)
    before = copy.deepcopy(sampler.state_dict())  # state_dict() shares the live state
    bad = torch.randn(3, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf.*clip gradients"):
        sampler.step(bad)
    after = sampler.state_dict()
    assert after["live"]["stepped"] == before["live"]["stepped"] == 0
    sampler.step(torch.randn(3, 4))


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive"])
def test_a_held_state_shows_later_steps_and_an_unheld_one_is_rebuilt_alike(kind):
    """A state handed out and still held (a loader's snapshot taken ahead of the steps) shows
    every later step; while none is held, steps leave the live part stale and the next
    ``state_dict()`` rebuilds it: both read the same at every point of an epoch."""
    X = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    holding, lazy = (
        GraBSampler(range(12), balance_type=kind),
        GraBSampler(range(12), balance_type=kind),
    )
    held = holding.state_dict()
    for epoch in range(2):
        orders = list(holding), list(lazy)
        assert orders[0] == orders[1]
        for start in range(0, 12, 3):
            batch = X[orders[0][start : start + 3]]
            holding.step(batch)
            lazy.step(batch)
            _assert_same_state(held["live"], copy.deepcopy(lazy.state_dict())["live"])
        assert held["live"]["epoch"] == epoch


def _assert_same_state(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("balance_type", ["mean", "pair", "recursive"])
@pytest.mark.parametrize("bad_row", [0, 3, 7])
@pytest.mark.parametrize("block_bytes", [1, 4 << 20])
def test_a_non_finite_row_anywhere_leaves_the_whole_state_unchanged(
    balance_type, bad_row, block_bytes
):
    from grabkit.order.balance import BlockPolicy

    g = torch.Generator().manual_seed(0)
    # 1 byte: one row a block; else pair's differences in one piece (short rows)
    policy = BlockPolicy(max_bytes=block_bytes, one_gram_macs=0 if block_bytes == 1 else 1 << 21)
    sampler = GraBSampler(range(24), balance_type=balance_type, block_policy=policy)
    list(sampler)
    sampler.step(torch.randn(8, 5, generator=g))  # running sums are no longer zero
    before = copy.deepcopy(sampler.state_dict())  # state_dict() shares the live state
    bad = torch.randn(8, 5, generator=g)
    bad[bad_row, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.step(bad)
    _assert_same_state(sampler.state_dict(), before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"balance_type": "nope"}, ValueError, "balance_type"),
        ({"batch_size": 0}, ValueError, "batch_size=0"),
        ({"num_replicas": 2, "rank": 2}, ValueError, "rank"),
        ({"num_replicas": 0}, ValueError, "num_replicas"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"projection": "fancy"}, ValueError, "projection"),
        ({"random_projection": "jl", "projection": "sparse"}, ValueError, "disagree"),
        ({"prob_balance": True, "probabilistic": False}, ValueError, "disagree"),
        ({"balance_type": "fixed", "orders": [0, 0, 1]}, ValueError, "permutation"),
        ({"balance_type": "recursive", "depth": -1}, ValueError, "depth"),
        ({"balance_type": "ema", "ema_decay": 0.0}, ValueError, "ema_decay"),
        ({"balance_type": "ntk-fixed"}, ValueError, "ntk_features"),
        ({"prob_balance": True, "prob_balance_c": -3}, ValueError, "prob_balance_c"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        GraBSampler(range(3), **kwargs)


def test_bad_inputs_to_step_are_rejected():
    sampler = GraBSampler(range(6), {"w": torch.zeros(2, 2)})
    list(sampler)
    with pytest.raises(ValueError, match="leading batch dimension"):
        sampler.step(torch.randn(4))
    with pytest.raises(ValueError, match=r"length 3 per example.*4 numbers"):
        sampler.step(torch.randn(2, 3))
    with pytest.raises(TypeError, match="dict of"):
        sampler.step([1, 2])
    with pytest.raises(ValueError, match="model="):
        sampler.step()
    with pytest.raises(TypeError, match="iterable-style"):
        GraBSampler(iter(range(3)))
    with pytest.raises(ValueError, match="empty dataset"):
        GraBSampler([])


def test_fixed_with_no_orders_is_natural_order():
    sampler = GraBSampler(range(5), balance_type="fixed")
    assert list(sampler) == list(range(5)) and list(sampler) == list(range(5))


# -- resume ---------------------------------------------------------------------------------
def _train(sampler, X, epochs, batch_size, save_at=None, in_flight=0):
    """Run epochs, stepping each batch once ``in_flight`` newer batches were yielded (a loader
    that prefetches). Right after stepping batch ``save_at[1]`` of epoch ``save_at[0]``, snapshot
    the state and the batches still in flight. Returns every epoch's order, the final order, and
    the snapshot."""
    orders, snapshot = [], None
    for epoch in range(epochs):
        order, current, queue, stepped_batches = [], [], [], 0
        for index in sampler:
            order.append(index)
            current.append(index)
            if len(current) == batch_size or len(order) == len(sampler):
                queue.append(current)
                current = []
            while len(queue) > in_flight:
                sampler.step(X[queue.pop(0)])
                stepped_batches += 1
                if save_at == (epoch, stepped_batches):
                    # state_dict() shares the live ordering state: freeze it as a save would
                    snapshot = (copy.deepcopy(sampler.state_dict()), [list(b) for b in queue])
        for b in queue:
            sampler.step(X[b])
        orders.append(order)
    orders.append(sampler.order.tolist())
    return orders, snapshot


def _resume(sampler, X, state, in_flight, epochs_done, epochs, batch_size):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    sampler.load_state_dict(torch.load(buffer, weights_only=True))
    for b in in_flight:  # gradients of examples handed out before the snapshot
        sampler.step(X[b])
    orders = []
    rest = list(sampler)
    for start in range(0, len(rest), batch_size):
        sampler.step(X[rest[start : start + batch_size]])
    orders.append(rest)
    for _ in range(epochs - epochs_done - 1):
        orders.append(run_epoch(sampler, X, batch_size))
    orders.append(sampler.order.tolist())
    return orders


RESUME_CASES = [(kind, i % 2 == 0, i % 3) for i, kind in enumerate(BALANCE_TYPES)]


@pytest.mark.parametrize(("kind", "probabilistic", "in_flight"), RESUME_CASES)
def test_mid_epoch_resume_reproduces_uninterrupted_orders(kind, probabilistic, in_flight):
    n, bs, epochs = 19, 3, 4
    X = torch.randn(n, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    kw = {"balance_type": kind, "prob_balance": probabilistic, "seed": 11}
    kw.update(own_options(kind, depth=2))
    if kind.startswith("ntk"):
        kw["ntk_features"] = X
    full, snap = _train(GraBSampler(range(n), **kw), X, epochs, bs, save_at=(1, 3), in_flight=0)
    _, snap = _train(GraBSampler(range(n), **kw), X, 2, bs, save_at=(1, 3), in_flight=in_flight)
    state, pending = snap
    assert state["yielded"] - state["live"]["stepped"] == sum(len(b) for b in pending)
    resumed = _resume(GraBSampler(range(n), **kw), X, state, pending, 1, epochs, bs)
    # the interrupted epoch: what was yielded before the snapshot plus the rest afterwards
    assert full[1][state["yielded"] :] == resumed[0]
    assert full[2:] == resumed[1:]


def test_state_dict_loads_with_weights_only_and_rejects_mismatch():
    sampler = GraBSampler(range(8), balance_type="mean", prob_balance=True, record_orders=True)
    run_epoch(sampler, torch.randn(8, 3), 3)
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    with pytest.raises(ValueError, match="unexpected keys \\['extra'\\]"):
        GraBSampler(range(8), prob_balance=True).load_state_dict({**state, "extra": 1})
    with pytest.raises(ValueError, match="n=8 vs 9"):
        GraBSampler(range(9)).load_state_dict(state)
    with pytest.raises(ValueError, match="num_replicas"):
        GraBSampler(range(8), num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="balance_type"):
        GraBSampler(range(8), balance_type="pair").load_state_dict(state)


# -- the grab-sampler README example, with only the import changed --------------------------------
def test_readme_example_with_torch_func():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    loss_fn = torch.nn.CrossEntropyLoss()
    dataset = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    sampler = GraBSampler(dataset, params)
    dataloader = DataLoader(dataset, sampler=sampler, batch_size=8)

    def compute_loss(model, loss_fn, params, buffers, inputs, targets):
        prediction = functional_call(model, (params, buffers), (inputs,))
        return loss_fn(prediction, targets)

    per_sample = vmap(grad(partial(compute_loss, model, loss_fn)), in_dims=(None, None, 0, 0))
    params = {k: v.detach() for k, v in params.items()}
    orders = []
    for _epoch in range(3):
        seen = []
        for x, y in dataloader:
            g = per_sample(params, buffers, x.unsqueeze(1), y.unsqueeze(1))
            sampler.step(g)
            params = {k: p - 0.1 * g[k].mean(0) for k, p in params.items()}
            seen.append(len(x))
        orders.append(sampler.order.tolist())
        assert seen == [8, 8, 8]
    assert all(sorted(o) == list(range(24)) for o in orders)
    assert orders[1] != orders[2] or orders[0] != orders[1]


# -- hook mode (statistics object) ------------------------------------------------------------
class FakeStats:
    """Stands in for PerSampleStats: hands out the batch it was given as a GradientBatch."""

    def __init__(self) -> None:
        self.current = None

    def gradient_batch(self):
        return self.current


class InnerProductsOnly:
    """A GradientBatch with no ``matrix``: the orderings may only use the protocol."""

    def __init__(self, X):
        self._d = DenseGradientBatch(X)
        self.size, self.dim, self.dtype, self.device = X.shape[0], X.shape[1], X.dtype, X.device

    def gram(self):
        return self._d.gram()

    def norms_squared(self):
        return self._d.norms_squared()

    def dot(self, v):
        return self._d.dot(v)

    def total(self):
        return self._d.total()

    def weighted_sum(self, w):
        return self._d.weighted_sum(w)


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive", "recursive-pair", "batch", "ema",
                                  "norm"])  # fmt: skip
def test_hook_mode_matches_dense_mode(kind):
    X = torch.randn(13, 4, dtype=torch.float64)
    dense = GraBSampler(range(13), balance_type=kind, **own_options(kind, depth=2), seed=2)
    stats = FakeStats()
    hooked = GraBSampler(
        range(13), balance_type=kind, **own_options(kind, depth=2), seed=2, stats=stats
    )
    for _ in range(3):
        order = list(dense)
        assert list(hooked) == order
        for start in range(0, 13, 5):
            rows = X[order[start : start + 5]]
            dense.step(rows)
            stats.current = InnerProductsOnly(rows)
            hooked.step()
    assert list(dense) == list(hooked)


@pytest.mark.parametrize("kind", ["sign", "adamean", "adaema", "greedy", "ntk-eigen"])
def test_hook_mode_orderings_needing_coordinates_say_so(kind):
    stats = FakeStats()
    sampler = GraBSampler(range(4), balance_type=kind, stats=stats)
    list(sampler)
    stats.current = InnerProductsOnly(torch.randn(2, 3))
    with pytest.raises(TypeError, match="dense per-example gradients"):
        sampler.step()


def _projected_reference(kw: dict, X: torch.Tensor) -> torch.Tensor:
    """What the sampler should balance for each option, built independently."""
    from grabkit.order.projection import make_projection
    from grabkit.order.transforms import jl_dimension

    if kw.get("normalize"):
        return X / X.norm(dim=1, keepdim=True)
    if callable(kw.get("projection")):
        return kw["projection"](X)
    kind = {"kron": "kronecker"}.get(kw.get("random_projection"), kw.get("projection"))
    k = kw.get("projection_dim") or min(X.shape[1], jl_dimension(X.shape[0], 0.1))
    return make_projection(kind, X.shape[1], k, seed=0, dtype=X.dtype)(X)


def test_normalize_and_projection_options_run():
    X = torch.randn(16, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for kw in ({"normalize": True}, {"projection": "gaussian", "projection_dim": 8},
               {"projection": "sparse", "projection_dim": 8}, {"random_projection": "kron"},
               {"projection": lambda G: G[:, :5]}):  # fmt: skip
        sampler = GraBSampler(range(16), **kw)
        reference = ReferenceBalancer("mean")
        Y = _projected_reference(kw, X)
        order = list(sampler)
        for epoch in range(2):
            expected = reference.epoch(Y, order, [4, 4, 4, 4], epoch)
            for start in range(0, 16, 4):
                sampler.step(X[order[start : start + 4]])
            order = list(sampler)
            assert sorted(order) == list(range(16))
            assert order == expected, (kw, epoch)


def test_normalize_is_scale_free_per_example():
    X = torch.randn(10, 4, dtype=torch.float64)
    scales = torch.rand(10, 1, dtype=torch.float64) * 100 + 0.01
    a = GraBSampler(range(10), normalize=True)
    b = GraBSampler(range(10), normalize_grads=True)
    for _ in range(3):
        order = list(a)
        assert list(b) == order
        a.step(X[order])
        b.step((X * scales)[order])
    assert list(a) == list(b)


def test_batch_sampler_form():
    X = torch.randn(10, 3)
    bs = GraBBatchSampler(range(10), batch_size=4, balance_type="pair")
    assert len(bs) == 3
    for _ in range(2):
        batches = list(bs)
        assert [len(b) for b in batches] == [4, 4, 2]
        for b in batches:
            bs.step(X[b])
    dropping = GraBBatchSampler(range(10), batch_size=4, drop_last=True)
    assert len(dropping) == 2 and [len(b) for b in dropping] == [4, 4]
    dropping.load_state_dict(dropping.state_dict())


def test_set_epoch_numbers_random_orders_like_distributed_sampler():
    a = GraBSampler(range(20), balance_type="rr", seed=3)
    b = GraBSampler(range(20), balance_type="rr", seed=3)
    a.set_epoch(5)
    b.set_epoch(5)
    epoch5 = list(a)
    assert list(b) == epoch5 and a.epoch == 5
    b.set_epoch(7)
    epoch7 = list(b)
    assert epoch7 != epoch5 and b.epoch == 7
    assert list(a) != epoch5 and a.epoch == 6  # without set_epoch the number counts up
    c = GraBSampler(range(20), balance_type="rr", seed=3)
    c.set_epoch(7)
    assert list(c) == epoch7


def test_hook_mode_with_per_sample_stats_matches_torch_func():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = model.double()
    x = torch.randn(12, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    hooked = GraBSampler(range(12), model=model, balance_type="recursive", depth=2)
    dense = GraBSampler(range(12), params, balance_type="recursive", depth=2)

    def example_loss(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return torch.nn.functional.cross_entropy(out, yi[None])

    per_sample = vmap(grad(example_loss), in_dims=(None, 0, 0))
    for _ in range(3):
        order = list(hooked)
        assert list(dense) == order
        for start in range(0, 12, 4):
            idx = order[start : start + 4]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            hooked.step()
            dense.step(per_sample(params, x[idx], y[idx]))
    assert list(hooked) == list(dense)
    hooked.stats.close()


def test_distributed_misuse_is_explained():
    sampler = GraBSampler(range(8), num_replicas=2, rank=1)
    list(sampler)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sampler.step(torch.randn(2, 3))
    stats = FakeStats()
    hooked = GraBSampler(range(8), num_replicas=2, rank=0, stats=stats)
    list(hooked)
    stats.current = InnerProductsOnly(torch.randn(2, 3))
    with pytest.raises(NotImplementedError, match="hook statistics"):
        hooked.step()


def test_large_batches_are_balanced_in_blocks_with_the_same_decisions():
    from grabkit.order.balance import BlockPolicy

    X = torch.randn(40, 3, dtype=torch.float64)
    whole = GraBSampler(range(40), balance_type="pair")
    blocked = GraBSampler(range(40), balance_type="pair", block_policy=BlockPolicy(observe_rows=7))
    for _ in range(2):
        order = list(whole)
        assert list(blocked) == order
        whole.step(X[order[:33]])
        blocked.step(X[order[:33]])
    assert list(whole) == list(blocked)


def test_probabilistic_decisions_do_not_depend_on_batch_boundaries():
    X = torch.randn(30, 4, dtype=torch.float64)
    a = GraBSampler(range(30), prob_balance=True, seed=5)
    b = GraBSampler(range(30), prob_balance=True, seed=5)
    for _ in range(3):
        assert run_epoch(a, X, 30) == run_epoch(b, X, 4)
    assert list(a) == list(b)


def test_set_epoch_after_resume_keeps_numbering():
    X = torch.randn(9, 2, dtype=torch.float64)
    a = GraBSampler(range(9), balance_type="mean", prob_balance=True, seed=1)
    a.set_epoch(0)
    it = iter(a)
    first = [next(it) for _ in range(3)]
    a.step(X[first])
    state = a.state_dict()
    order = first + list(it)
    b = GraBSampler(range(9), balance_type="mean", prob_balance=True, seed=1)
    b.load_state_dict(state)
    b.set_epoch(0)  # a training loop that calls set_epoch every epoch, resumed in epoch 0
    assert list(b) == order[3:]
    b.step(X[order[3:]])
    a.step(X[order[3:]])
    assert list(b) == list(a) and a.epoch == b.epoch == 1


def test_normalize_equals_balancing_unit_vectors():
    X = torch.randn(12, 4, dtype=torch.float64) * torch.rand(12, 1, dtype=torch.float64) * 5
    unit = X / X.norm(dim=1, keepdim=True)
    for kind in ("mean", "pair", "recursive"):
        a = GraBSampler(range(12), balance_type=kind, normalize=True, **own_options(kind, depth=2))
        b = GraBSampler(range(12), balance_type=kind, **own_options(kind, depth=2))
        for _ in range(3):
            order = list(a)
            assert list(b) == order
            for start in range(0, 12, 5):
                a.step(X[order[start : start + 5]])
                b.step(unit[order[start : start + 5]])


def test_dtype_option_and_record_orders():
    X = torch.randn(10, 3, dtype=torch.float64)
    a = GraBSampler(range(10), dtype=torch.float64, record_orders=True)
    b = GraBSampler(range(10))
    for _ in range(3):
        order = list(a)
        assert list(b) == order
        a.step(X[order].float())
        b.step(X[order])
    assert list(a) == list(b)
    assert len(a.orders_history) == 4 and a.orders_history[-1] == a.order.tolist()


def test_normalize_in_hook_mode_matches_dense_mode():
    X = torch.randn(12, 4, dtype=torch.float64) * torch.rand(12, 1, dtype=torch.float64) * 5
    dense = GraBSampler(range(12), balance_type="pair", normalize=True)
    stats = FakeStats()
    hooked = GraBSampler(range(12), balance_type="pair", normalize=True, stats=stats)
    for _ in range(3):
        order = list(dense)
        assert list(hooked) == order
        for start in range(0, 12, 5):
            dense.step(X[order[start : start + 5]])
            stats.current = InnerProductsOnly(X[order[start : start + 5]])
            hooked.step()
    assert list(dense) == list(hooked)


def test_in_flight_examples_not_stepped_after_resume_are_skipped():
    X = torch.randn(12, 3, dtype=torch.float64)
    sampler = GraBSampler(range(12), seed=2)
    it = iter(sampler)
    handed_out = [next(it) for _ in range(6)]
    sampler.step(X[handed_out[:3]])
    state = sampler.state_dict()
    assert (state["yielded"], state["live"]["stepped"]) == (6, 3)
    resumed = GraBSampler(range(12), seed=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest == sampler.order.tolist()[6:]
    resumed.step(X[rest])  # the rest of the epoch, not the three in flight at the snapshot
    resumed.step(torch.zeros(0, 3))  # an empty batch is a no-op
    nxt = list(resumed)
    in_flight = handed_out[3:]
    positions = sorted(nxt.index(i) for i in in_flight)
    assert positions == list(range(positions[0], positions[0] + 3))  # between front and back


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume(num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    n, bs = 17, 3
    X = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ds = TensorDataset(torch.arange(n))

    def run(state=None, save_at=None, epochs=3):
        sampler = GraBSampler(ds, prob_balance=True, seed=3)
        loader = stateful.StatefulDataLoader(
            ds, sampler=sampler, batch_size=bs, num_workers=num_workers
        )
        if state is not None:
            loader.load_state_dict(state)
        seen_epochs, saved = [], None
        for epoch in range(epochs):
            seen = []
            for k, (idx,) in enumerate(loader):
                seen += idx.tolist()
                sampler.step(X[idx])
                if (epoch, k) == save_at:
                    saved = copy.deepcopy(loader.state_dict())  # as torch.save would
            seen_epochs.append(seen)
        return seen_epochs, saved

    full, saved = run(save_at=(1, 2))
    resumed, _ = run(state=saved, epochs=2)
    assert resumed[0] == full[1][9:]  # the rest of the interrupted epoch
    assert all(sorted(e) == list(range(n)) for e in resumed[1:])
    # exact with workers too: the state's ordering part is live, so the decisions of batches
    # stepped after the loader took its snapshot at dispatch are in the checkpoint
    assert resumed[1:] == full[2:]


@pytest.mark.parametrize("kwargs", [{"balance_type": "sign"}, {"projection": "gaussian"}])
def test_hook_mode_rejects_coordinate_needs_at_construction(kwargs):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="hook mode"):
        GraBSampler(range(4), model=model, **kwargs)


@pytest.mark.parametrize("kind", ["pair", "recursive", "ema", "recursive-pair", "norm"])
def test_non_finite_anywhere_in_the_batch_is_rejected(kind):
    sampler = GraBSampler(range(40), balance_type=kind, **own_options(kind, depth=2))
    list(sampler)
    sampler.step(torch.randn(4, 3))
    before = copy.deepcopy(sampler.state_dict())["live"]  # state_dict() shares the live state
    bad = torch.randn(33, 3)
    bad[-1, 0] = float("inf")  # the last row: pair balance's odd one out, the last CPU block
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.step(bad)
    after = sampler.state_dict()["live"]
    assert after["stepped"] == before["stepped"]
    for key in ("acc", "rule"):
        if key in before["ordering"]:
            assert torch.equal(before["ordering"][key], after["ordering"][key])
    assert torch.equal(before["rule"]["generator"], after["rule"]["generator"])


def test_grab_sampler_readme_verbatim_with_torchopt():
    """The grab-sampler README loop, its '...' filled in, with only the import changed."""
    torchopt = pytest.importorskip("torchopt")
    from torch.func import grad_and_value

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    loss_fn = torch.nn.CrossEntropyLoss()
    dataset = TensorDataset(torch.randn(16, 5), torch.randint(0, 3, (16,)))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    optimizer = torchopt.sgd(lr=0.1)
    opt_state = optimizer.init(params)

    sampler = GraBSampler(dataset, params)
    dataloader = DataLoader(dataset, sampler=sampler)

    def compute_loss(model, loss_fn, params, buffers, inputs, targets):
        prediction = functional_call(model, (params, buffers), (inputs,))
        return loss_fn(prediction, targets)

    ft_compute_sample_grad_and_loss = vmap(
        grad_and_value(partial(compute_loss, model, loss_fn)), in_dims=(None, None, 0, 0)
    )
    orders = []
    for _epoch in range(3):
        for _, (x, y) in enumerate(dataloader):
            ft_per_sample_grads, _batch_loss = ft_compute_sample_grad_and_loss(
                params, buffers, x, y
            )
            sampler.step(ft_per_sample_grads)
            grads = {k: g.mean(dim=0) for k, g in ft_per_sample_grads.items()}
            updates, opt_state = optimizer.update(grads, opt_state, params=params)
            params = torchopt.apply_updates(params, updates)
        orders.append(sampler.order.tolist())
    assert all(sorted(o) == list(range(16)) for o in orders)


def test_a_hook_mode_sampler_refuses_to_be_pickled_with_the_fix():
    dense = GraBSampler(range(8), balance_type="pair")
    assert list(pickle.loads(pickle.dumps(dense))) == list(dense)
    hooked = GraBSampler(range(8), model=torch.nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"setup\(\).*state_dict"):
        pickle.dumps(hooked)
    hooked.close()


def test_two_numbers_for_the_next_epoch_are_refused():
    """A loop's set_epoch(1) and another's set_epoch(0) (accelerate's prepared loader, whose
    count restarts at 0 after load_state) before one iter(): raised, naming loader.set_epoch.
    Renumbering the epoch under way (Lightning, after its loader started the epoch) is not a
    second number."""
    sampler = GraBSampler(range(6), balance_type="mean", seed=1)
    sampler.set_epoch(0)
    list(sampler)
    sampler.set_epoch(0)  # the epoch under way
    sampler.set_epoch(1)
    sampler.set_epoch(1)
    with pytest.raises(ValueError, match=r"set_epoch\(0\) after set_epoch\(1\).*loader\.set_epoch"):
        sampler.set_epoch(0)
    list(sampler)
    sampler.set_epoch(2)  # a new epoch after iter(): a fresh number
    assert sampler.epoch == 1


def test_a_number_below_the_resumed_epoch_is_refused():
    """After load_state_dict, a loop that numbers the epochs from 0 again (accelerate's prepared
    loader with no loader.set_epoch: its count restarts at 0 after load_state) would abandon the
    untrained rest of a state saved inside epoch 1 (a whole new epoch trained in its place), or
    number the epoch after a state saved at epoch 1's end as an earlier one: raised, nothing
    changed. The resumed epoch's own number, and later ones, still number it."""
    X = torch.randn(6, 2, dtype=torch.float64)
    sampler = GraBSampler(range(6), balance_type="mean", seed=1)
    run_epoch(sampler, X, 2)
    order = list(sampler)
    sampler.step(X[order[:2]])
    inside = rewound_state(sampler.state_dict(), sampler.num_samples)  # at an optimizer step
    resumed = GraBSampler(range(6), balance_type="mean", seed=1)
    resumed.load_state_dict(copy.deepcopy(inside))
    with pytest.raises(ValueError, match=r"set_epoch\(0\) after load_state_dict.*inside epoch 1"):
        resumed.set_epoch(0)
    resumed.set_epoch(1)
    assert list(resumed) == order[2:]  # the untrained rest, as before the refusal
    sampler.step(X[order[2:]])
    ended = rewound_state(sampler.state_dict(), sampler.num_samples)
    for number, allowed in ((1, False), (2, True)):
        resumed = GraBSampler(range(6), balance_type="mean", seed=1)
        resumed.load_state_dict(copy.deepcopy(ended))
        if not allowed:
            with pytest.raises(ValueError, match=r"end of epoch 1.*loader\.set_epoch"):
                resumed.set_epoch(number)
            continue
        resumed.set_epoch(number)
        assert list(resumed) == list(sampler) and resumed.epoch == sampler.epoch == 2
