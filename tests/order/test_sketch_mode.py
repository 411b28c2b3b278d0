"""``GraBSampler(model=..., statistics="sketch")``: hook-mode GraB on (B, k) sketches.

Every ordering (those that need coordinates too) must decide exactly as the dense path does when
it is handed the same sketches: the explicit map applied to per-example autograd gradients.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.order import GraBSampler

N, BATCH, EPOCHS, K = 24, 6, 3, 16


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = make_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (N,), generator=gen)


def per_example_gradients(hooked: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, d) by ``torch.autograd.grad`` per example, on an unhooked copy of ``hooked``."""
    model = make_model()
    model.load_state_dict(hooked.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    "balance_type",
    ["mean", "pair", "recursive", "sign", "norm", "batch", "ema", "greedy"],
)
def test_sketch_mode_decides_as_dense_path_on_the_same_sketches(balance_type):
    model, x, y = model_and_data()
    hooked = GraBSampler(
        range(N), model=model, balance_type=balance_type, statistics="sketch", sketch_dim=K,
        batch_size=BATCH, seed=2,
    )  # fmt: skip
    dense = GraBSampler(range(N), balance_type=balance_type, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    orders = []
    for _ in range(EPOCHS):
        order = list(hooked)
        assert order == list(dense)
        orders.append(order)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            reference = per_example_gradients(model, x[idx], y[idx])
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            hooked.step()
            dense.step(hooked.stats.sketch.apply_dense(reference))
            opt.step()
    assert list(hooked) == list(dense)
    if balance_type not in ("norm",):
        assert len({tuple(o) for o in orders}) > 1  # the orders did change
    hooked.close()


def test_ntk_eigen_runs_on_sketches():
    """The NTK family reads coordinates: on sketches it orders by the sketches' kernel (its
    eigenvectors' signs are not stable under rounding, so no order-for-order comparison)."""
    model, x, y = model_and_data()
    sampler = GraBSampler(range(N), model=model, balance_type="ntk-eigen", statistics="sketch",
                          sketch_dim=K)  # fmt: skip
    for _ in range(2):
        order = list(sampler)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sampler.step()
    assert sorted(list(sampler)) == list(range(N))
    sampler.close()


def test_gradient_accumulation_balances_every_micro_batch():
    model, x, y = model_and_data()
    whole = GraBSampler(range(N), model=model, statistics="sketch", sketch_dim=K, seed=1)
    order = list(whole)
    for start in range(0, N, BATCH):
        idx = torch.tensor(order[start : start + BATCH])
        for part in idx.chunk(2):
            F.cross_entropy(model(x[part]), y[part]).backward()
        whole.step()
    whole.close()
    model2, _, _ = model_and_data()
    single = GraBSampler(range(N), model=model2, statistics="sketch", sketch_dim=K, seed=1)
    assert list(single) == order
    for start in range(0, N, BATCH // 2):
        idx = torch.tensor(order[start : start + BATCH // 2])
        F.cross_entropy(model2(x[idx]), y[idx]).backward()
        single.step()
    assert list(whole) == list(single)
    single.close()


def test_mid_epoch_resume_is_exact_and_configuration_is_checked():
    model, x, y = model_and_data()  # no optimizer step: the model stays as it is

    def run(sampler: GraBSampler, batches: int) -> list[int]:
        seen = []
        for _ in range(batches):
            idx = torch.tensor([next(sampler_iter[sampler]) for _ in range(BATCH)])
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sampler.step()
            seen += idx.tolist()
        return seen

    make = dict(model=model, balance_type="pair", statistics="sketch", sketch_dim=K, seed=3)
    first = GraBSampler(range(N), **make)
    sampler_iter = {first: iter(first)}
    run(first, 2)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    rest = run(first, 2)
    expected = list(first)
    first.close()
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state["config"]["statistics"] == "sketch" and state["config"]["sketch_dim"] == K
    resumed = GraBSampler(range(N), **make)
    resumed.load_state_dict(state)
    sampler_iter[resumed] = iter(resumed)
    assert run(resumed, 2) == rest
    assert list(resumed) == expected
    resumed.close()
    for other in ({"sketch_dim": 64}, {"statistics": "exact", "sketch_dim": None}):
        mismatched = GraBSampler(range(N), **{**make, **other})
        with pytest.raises(ValueError, match="another configuration"):
            mismatched.load_state_dict(state)
        mismatched.close()


def test_misuse_is_explained():
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match='statistics="sketch"'):
        GraBSampler(range(N), model=model, balance_type="sign")
    with pytest.raises(ValueError, match='statistics="sketch"'):
        GraBSampler(range(N), model=model, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="sketch_dim"):
        GraBSampler(range(N), model=model, sketch_dim=16)
    with pytest.raises(ValueError, match="needs model="):
        GraBSampler(range(N), statistics="sketch")
    with pytest.raises(ValueError, match="already a random projection"):
        GraBSampler(range(N), model=model, statistics="sketch", projection="gaussian")
    with pytest.raises(ValueError, match="`statistics`"):
        GraBSampler(range(N), model=model, statistics="approximate")
    with pytest.raises(ValueError, match="sketch_dim"):
        GraBSampler(range(N), model=model, statistics="sketch", sketch_dim=1021)
    sampler = GraBSampler(range(N), model=model, balance_type="adamean", statistics="sketch")
    list(sampler)
    with pytest.raises(ValueError, match="cannot take per-example gradients"):
        sampler.step(torch.randn(4, sum(p.numel() for p in model.parameters())))
    with pytest.raises(TypeError, match="update_v"):
        sampler.update_v(torch.ones(sum(p.numel() for p in model.parameters())))
    sampler.close()
