"""No silent wrong results in ordering: skipped batches, gradient accumulation in hook mode, a
resume at an epoch's end, sign balancing on NaN, checked states, distributed agreement."""

from __future__ import annotations

import copy
import gc
import io
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.order.reference import own_options
from tests.support.distributed import run_distributed
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import BatchSampler, RandomSampler, TensorDataset

from grabkit import GraBBatchSampler, GraBSampler


def _grads(n: int = 24, d: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- item 2: a skipped (NaN) batch ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mean", "pair", "recursive"])
def test_skipped_batch_does_not_take_the_next_batch_gradients(kind):
    X = _grads()
    by_indices = GraBSampler(range(24), balance_type=kind, seed=1, **own_options(kind, depth=2))
    by_skip = GraBSampler(range(24), balance_type=kind, seed=1, **own_options(kind, depth=2))
    reference = GraBSampler(range(24), balance_type=kind, seed=1, **own_options(kind, depth=2))
    order = list(by_indices)
    assert list(by_skip) == list(reference) == order
    batches = [order[i : i + 4] for i in range(0, 24, 4)]
    bad = X[batches[1]].clone()
    bad[0, 0] = float("nan")
    for sampler in (by_indices, by_skip):
        sampler.step(X[batches[0]])
        with pytest.raises(ValueError, match=r"skip\(.*indices="):
            sampler.step(bad)
    by_skip.skip(4)
    reference.step(X[batches[0]])
    reference.skip(4)
    for b in batches[2:]:
        by_indices.step(X[b], indices=torch.tensor(b))  # batch 1 was never stepped
        by_skip.step(X[b])
        reference.step(X[b])
    assert list(by_indices) == list(by_skip) == list(reference)
    nxt = reference.order.tolist()
    positions = [nxt.index(i) for i in batches[1]]  # undecided: kept together, in order
    assert positions == list(range(positions[0], positions[0] + 4))


def test_indices_that_were_not_yielded_next_are_rejected():
    sampler = GraBSampler(range(8), seed=0)
    order = list(sampler)
    with pytest.raises(ValueError, match="not the next examples"):
        sampler.step(_grads(2), indices=[order[1], order[0]])
    with pytest.raises(ValueError, match="one dataset index per gradient"):
        sampler.step(_grads(2), indices=order[:3])
    sampler.step(_grads(2), indices=order[2:4])  # skips the first two
    with pytest.raises(ValueError, match="not the next examples"):
        sampler.step(_grads(2), indices=order[:2])  # already passed over: never twice


def test_batch_sampler_skip_defaults_to_one_batch():
    X = _grads(10)
    a = GraBBatchSampler(range(10), batch_size=4, seed=2)
    b = GraBBatchSampler(range(10), batch_size=4, seed=2)
    batches = list(a)
    assert list(b) == batches
    a.skip()
    b.sampler.skip(4)
    for s in (a, b):
        for batch in batches[1:]:
            s.step(X[batch])
    assert list(a) == list(b)


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_left_out_without_skip_is_refused(workers, hook):
    """A loop that leaves a batch out (``continue`` before its backward, an exception caught)
    and forgets ``skip()``: silently wrong on the old code (every later batch's gradients went
    to the examples yielded one batch before them, to the epoch's end). The examples handed out
    but not stepped grow by a batch, which no loader does between two steps."""
    model, sampler, loader = _pair_loop(32, hook, workers)
    with pytest.raises(ValueError, match=r"left out.*skip\(\)"):
        _train_leaving_out(loader, sampler, model, hook, left_out=2)
    sampler.close()


def _pair_loop(n: int, hook: bool, workers: int):
    """A model, a pair-balancing sampler over n examples (hook mode or not) and its loader of
    batches of 4 yielding (x, y, index)."""
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,))
    data = TensorDataset(x, y, torch.arange(n))
    model = _model()
    kwargs = {"model": model} if hook else {}
    sampler = GraBSampler(data, balance_type="pair", batch_size=4, **kwargs)
    loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=4, num_workers=workers)
    return model, sampler, loader


def _train_leaving_out(loader, sampler, model, hook: bool, left_out: int) -> None:
    """One epoch of ``loader``, batch ``left_out`` left out (no backward, no ``skip()``)."""
    for k, (xb, yb, _) in enumerate(loader):
        if k == left_out:
            continue
        loss = F.cross_entropy(model(xb), yb)
        if hook:
            loss.backward()
            sampler.step()
        else:
            sampler.step(_per_example(model, xb, yb))


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_first_batch_left_out_without_skip_is_named_at_the_epochs_end(workers, hook):
    """Left out before the epoch's first step, a batch cannot be told from the loader fetching
    ahead, so every later step's gradients went to the examples one batch before them, and the
    epoch ended stepped in part without a word. The epoch's end names it: a whole batch of the
    examples handed out was never stepped."""
    model, sampler, loader = _pair_loop(16, hook, workers)
    _train_leaving_out(loader, sampler, model, hook, left_out=0)
    with pytest.warns(UserWarning, match=r"4 of the 16 examples.*never stepped.*skip\(\)"):
        iter(sampler)
    sampler.close()


def test_an_epoch_whose_loader_dropped_its_last_partial_batch_ends_quietly():
    x, y = torch.randn(18, 3, dtype=torch.float64), torch.randint(0, 2, (18,))
    data = TensorDataset(x, y)
    model = _model()
    sampler = GraBSampler(data, balance_type="pair", batch_size=4)
    loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=4, drop_last=True)
    for xb, yb in loader:
        sampler.step(_per_example(model, xb, yb))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iter(sampler)


@pytest.mark.parametrize("workers", [0, 2])
def test_loaders_fetching_ahead_and_skip_are_no_batch_left_out(workers):
    """Batches fetched ahead by workers, a window of micro-batches fetched at once (as Trainer
    fetches an accumulation window), the epoch's ragged end and ``skip()``: all stepped
    through, the order equal to a sampler given the indices."""
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 2, (30,))
    data = TensorDataset(x, y, torch.arange(30))
    model = _model()
    sampler = GraBSampler(data, balance_type="pair", batch_size=4)
    given = GraBSampler(data, balance_type="pair")
    loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=4, num_workers=workers)
    for _ in range(2):
        order, position = list(given), 0
        batches = iter(loader)
        windows = iter(lambda it=batches: [b for _, b in zip(range(2), it, strict=False)], [])
        for window in windows:
            for k, (xb, yb, idx) in enumerate(window):  # the window fetched before its steps
                assert idx.tolist() == order[position : position + len(idx)]
                position += len(idx)
                if k == 1 and int(idx[0]) % 3 == 0:
                    sampler.skip()
                    continue
                grads = _per_example(model, xb, yb)
                sampler.step(grads)
                given.step(grads, indices=idx)
    assert list(sampler) == list(given)


# -- item 3: hook mode under gradient accumulation ------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[k].flatten(1) for k in params], dim=1)


@pytest.mark.parametrize("kind", ["mean", "pair", "recursive"])
def test_hook_mode_accumulates_backwards_until_step(kind):
    model = _model()
    x = torch.randn(16, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(2))
    hooked = GraBBatchSampler(
        range(16), model=model, batch_size=8, balance_type=kind, **own_options(kind, depth=2)
    )
    dense = GraBBatchSampler(
        range(16), batch_size=8, balance_type=kind, **own_options(kind, depth=2)
    )
    for _ in range(2):
        batches = list(hooked)
        assert list(dense) == batches
        for batch in batches:
            for half in (batch[:4], batch[4:]):  # two micro-batches, one step
                F.cross_entropy(model(x[half]), y[half]).backward()
                dense.step(_per_example(model, x[half], y[half]))
            hooked.step()
    assert list(hooked) == list(dense)
    hooked.close()


def test_hook_mode_step_twice_or_a_partial_backward_raises():
    model = _model()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    with GraBBatchSampler(range(8), model=model, batch_size=4) as sampler:
        batches = list(sampler)
        F.cross_entropy(model(x[batches[0]]), y[batches[0]]).backward()
        sampler.step()
        with pytest.raises(ValueError, match=r"no loss\.backward"):
            sampler.step()  # the same statistics again
        F.cross_entropy(model(x[batches[1][:3]]), y[batches[1][:3]]).backward()
        with pytest.raises(ValueError, match="whole yielded batch"):
            sampler.step()  # 3 of the 4 examples yielded
        sampler.skip()  # the failed batch: no decision
        assert sampler.sampler._stepped == 8
    assert not model[0]._forward_hooks  # close() removed the hooks


# -- item 4: resume at the last batch of an epoch -------------------------------------------------
def _pass_lengths(make, num_workers: int, batch_sampler: bool) -> list[int]:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = TensorDataset(torch.arange(10))

    def loader_for(sampler):
        if batch_sampler:
            return stateful.StatefulDataLoader(ds, batch_sampler=sampler, num_workers=num_workers)
        return stateful.StatefulDataLoader(
            ds, sampler=sampler, batch_size=5, num_workers=num_workers
        )

    sampler = make()
    loader = loader_for(sampler)
    state = None
    for k, _ in enumerate(loader):
        if k == 1:  # the last batch of the epoch
            state = copy.deepcopy(loader.state_dict())
    sampler = make()
    loader = loader_for(sampler)
    loader.load_state_dict(state)
    return [sum(len(idx) for (idx,) in loader) for _ in range(2)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_sampler", [False, True])
def test_resume_at_the_last_batch_matches_random_sampler(num_workers, batch_sampler):
    if batch_sampler:
        expected = _pass_lengths(
            lambda: BatchSampler(RandomSampler(range(10)), 5, False), num_workers, True
        )
        ours = _pass_lengths(lambda: GraBBatchSampler(range(10), batch_size=5), num_workers, True)
    else:
        expected = _pass_lengths(lambda: RandomSampler(range(10)), num_workers, False)
        ours = _pass_lengths(lambda: GraBSampler(range(10), balance_type="rr"), num_workers, False)
    assert expected[0] == 0  # RandomSampler: an empty pass, then the next epoch
    assert ours == expected


# -- item 5: sign balancing on NaN / Inf ----------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sign_balance_rejects_non_finite_and_changes_nothing(bad):
    sampler = GraBSampler(range(8), balance_type="sign")
    list(sampler)
    sampler.step(_grads(4))
    before = copy.deepcopy(sampler.state_dict())
    X = _grads(4, seed=1)
    X[2, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.step(X)
    after = sampler.state_dict()["live"]
    assert after["stepped"] == before["live"]["stepped"]
    assert torch.equal(after["ordering"]["acc"], before["live"]["ordering"]["acc"])
    assert after["ordering"]["mean"]["running_sum"].isfinite().all()


# -- checked states ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"depth": 3}, "depth"),
        ({"ema_decay": 0.2}, "ema_decay"),
        ({"prob_balance": True}, "probabilistic"),
        ({"drop_last": True, "num_replicas": 2, "rank": 0}, "drop_last"),
        ({"rank": 0, "num_replicas": 3}, "num_replicas"),
        ({"projection": "gaussian", "projection_dim": 2}, "projection"),
        ({"normalize": True}, "normalize"),
    ],
)
def test_load_refuses_another_configuration(change, name):
    base = {"balance_type": "recursive", "num_replicas": 2, "rank": 0}
    if name == "ema_decay":
        base["balance_type"] = "ema"
    saved = GraBSampler(range(9), **base).state_dict()
    with pytest.raises(ValueError, match=f"{name}="):
        GraBSampler(range(9), **{**base, **change}).load_state_dict(saved)


def test_another_rank_s_state_of_the_same_world_size_is_adopted():
    """Frameworks save one copy of a sampler's state (rank 0's) and every rank loads it. Every
    step() of several ranks is collective, so the ranks' states differ only in the recorded
    rank: rank 1 loading rank 0's state is rank 1 loading its own (another world size is
    refused above)."""
    base = {"balance_type": "recursive", "num_replicas": 2}
    zero, one = GraBSampler(range(9), **base, rank=0), GraBSampler(range(9), **base, rank=1)
    list(zero), list(one)
    adopted = GraBSampler(range(9), **base, rank=1)
    adopted.load_state_dict(zero.state_dict())
    own = GraBSampler(range(9), **base, rank=1)
    own.load_state_dict(one.state_dict())
    assert adopted.state_dict()["config"] == own.state_dict()["config"]
    assert list(adopted) == list(own)


def test_load_refuses_a_corrupted_order_or_position():
    sampler = GraBSampler(range(6))
    state = copy.deepcopy(sampler.state_dict())
    state["live"]["order"] = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a permutation"):
        GraBSampler(range(6)).load_state_dict(state)
    state["live"]["order"] = torch.arange(5)
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        GraBSampler(range(6)).load_state_dict(state)
    state = copy.deepcopy(sampler.state_dict())
    state["yielded"] = 7
    with pytest.raises(ValueError, match="outside"):
        GraBSampler(range(6)).load_state_dict(state)


def test_state_dict_is_o1_in_the_gradient_length():
    sampler = GraBSampler(range(6), balance_type="mean")
    list(sampler)
    sampler.step(_grads(3, d=1000))
    state = sampler.state_dict()
    # the running sum is shared with the live ordering, not copied per snapshot
    assert state["live"]["ordering"]["acc"].data_ptr() == sampler.ordering.acc.data_ptr()
    assert sampler.state_dict()["live"] is state["live"]


# -- resume property ------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["mean", "pair", "recursive", "ema", "batch", "rr", "greedy"]),
    batch_form=st.booleans(),
    probabilistic=st.booleans(),
    stop=st.integers(0, 3 * 11),
)
def test_resume_anywhere_continues_exactly(kind, batch_form, probabilistic, stop):
    n, bs, epochs = 11, 3, 3
    X = _grads(n, seed=4)
    kw = {"balance_type": kind, "prob_balance": probabilistic, "seed": 5}
    kw.update(own_options(kind, depth=2))

    def make():
        if batch_form:
            return GraBBatchSampler(range(n), batch_size=bs, **kw)
        return GraBSampler(range(n), **kw)

    def run(sampler, steps_left, skip_batches=0):
        """Yield batches and step them; return the batches seen, or stop after steps_left."""
        seen = []
        while len(seen) < epochs * 4 - skip_batches:
            it = iter(sampler)
            while True:
                batch = next(it, None) if batch_form else list(_take(it, bs))
                if not batch:
                    break
                sampler.step(X[batch])
                seen.append(batch)
                if len(seen) == steps_left:
                    return seen, True
            seen.append(None)  # epoch boundary
        return seen, False

    full, _ = run(make(), -1)
    first = make()
    head, stopped = run(first, stop)
    if not stopped:
        return
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    tail, _ = run(resumed, -1, skip_batches=len(head))
    flat_full = [b for b in full if b is not None]
    flat_rest = [b for b in head + tail if b is not None]
    assert flat_rest == flat_full[: len(flat_rest)]
    assert len(flat_rest) >= len(flat_full) - 4


def _take(it, k):
    for _ in range(k):
        value = next(it, None)
        if value is None:
            return
        yield value


# -- distributed ---------------------------------------------------------------------------------
def _disagreeing_body(rank: int, world_size: int, what: str) -> str:
    kwargs = {"seed": rank} if what == "seed" else {}
    try:
        sampler = GraBSampler(range(8), **kwargs)
        local = list(sampler)
        if what == "width":
            sampler.step(torch.randn(len(local), 3 + rank))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("what", ["seed", "width"])
def test_ranks_that_disagree_fail_loudly(what):
    messages = run_distributed(_disagreeing_body, world_size=2, payload=what)
    expected = "different configurations" if what == "seed" else "gradient widths"
    assert all(expected in m for m in messages), messages


def test_padding_duplicate_varies_by_epoch():
    sampler = GraBSampler(range(5), balance_type="fixed", num_replicas=2, rank=1, seed=3)
    extras = set()
    for epoch in range(8):
        sampler.set_epoch(epoch)
        extras.add(list(sampler)[-1])  # rank 1's last position is the padding
    assert len(extras) > 1


def test_hook_mode_keeps_no_consumed_statistics_alive():
    model = _model()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with GraBBatchSampler(range(8), model=model, batch_size=4) as sampler:
        batch = next(iter(sampler))
        F.cross_entropy(model(x), y).backward()
        ref = weakref.ref(sampler.sampler.stats.statistics())
        sampler.step()
        assert batch and ref() is not None
        model(x)  # the next step's first forward: the engine drops the consumed statistics
        gc.collect()
        assert ref() is None  # nothing in the sampler holds them (activations freed)


def test_an_epoch_with_no_step_at_all_warns():
    sampler = GraBSampler(range(6), balance_type="mean")
    list(sampler)
    with pytest.warns(UserWarning, match="no step"):
        list(sampler)  # GraB never applied in epoch 0
    quiet = GraBSampler(range(6), balance_type="rr")  # orders without gradients: no warning
    list(quiet)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(quiet)
