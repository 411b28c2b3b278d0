"""On CUDA the sampler takes the CPU's decisions (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from tests.order.reference import own_options

from grabkit.order import GraBSampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "kind", ["mean", "pair", "recursive", "recursive-pair", "batch", "ema", "adaema", "sign",
             "norm", "greedy"]
)  # fmt: skip
@pytest.mark.parametrize("probabilistic", [False, True])
def test_cuda_orders_equal_cpu_orders(kind, probabilistic):
    X = torch.randn(29, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cpu = GraBSampler(
        range(29), balance_type=kind, prob_balance=probabilistic, **own_options(kind, depth=2)
    )
    gpu = GraBSampler(
        range(29), balance_type=kind, prob_balance=probabilistic, **own_options(kind, depth=2)
    )
    Xc = X.cuda()
    for _ in range(3):
        order = list(cpu)
        assert list(gpu) == order
        for start in range(0, 29, 6):
            cpu.step(X[order[start : start + 6]])
            gpu.step(Xc[order[start : start + 6]])
    assert list(cpu) == list(gpu)
    state = gpu.state_dict()
    GraBSampler(
        range(29), balance_type=kind, prob_balance=probabilistic, **own_options(kind, depth=2)
    ).load_state_dict(state)


@pytest.mark.parametrize("projection", ["gaussian", "sparse", "kronecker"])
def test_cuda_projection_and_device_option(projection):
    X = torch.randn(16, 500)
    sampler = GraBSampler(range(16), projection=projection, projection_dim=32, device="cuda")
    for _ in range(2):
        order = list(sampler)
        for start in range(0, 16, 4):
            sampler.step(X[order[start : start + 4]])
        assert sorted(sampler.order.tolist()) == list(range(16))
