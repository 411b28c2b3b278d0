"""Distributed GraB: ranks decide together exactly as one process does on the global batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.support.distributed import run_distributed

from grabkit.order import GraBSampler

N, D, LOCAL_BATCH, EPOCHS = 21, 5, 3, 3
CONFIGS = [
    {"balance_type": "mean"},
    {"balance_type": "pair", "prob_balance": True},
    {"balance_type": "recursive", "depth": 2},
    {"balance_type": "mean", "drop_last": True},
    {"balance_type": "rr"},
]


def gradients() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def rank_body(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    X = gradients()
    results = []
    for config in configs:
        sampler = GraBSampler(range(N), seed=9, **config)  # replicas and rank from the group
        yielded, orders = [], []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            local = list(sampler)
            yielded.append(local)
            for start in range(0, len(local), LOCAL_BATCH):
                sampler.step(X[local[start : start + LOCAL_BATCH]])
            orders.append(sampler.order.tolist())
        results.append({"yielded": yielded, "orders": orders, "len": len(sampler)})
    return results


def single_process(config: dict, world_size: int) -> list[list[int]]:
    """One process stepping the concatenated rank batches: global batches of W * LOCAL_BATCH."""
    X = gradients()
    config = dict(config)
    drop_last = config.pop("drop_last", False)
    sampler = GraBSampler(range(N), seed=9, **config)
    usable = (N // world_size) * world_size if drop_last else N
    orders = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)[:usable]
        for start in range(0, usable, world_size * LOCAL_BATCH):
            sampler.step(X[order[start : start + world_size * LOCAL_BATCH]])
        orders.append(sampler.order.tolist())
    return orders


@pytest.mark.distributed
def test_two_ranks_decide_like_one_process_on_the_global_batch(monkeypatch):
    # spawned ranks unpickle rank_body by module name: let them import this test package
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    per_rank = run_distributed(rank_body, world_size=2, payload=CONFIGS)
    for i, config in enumerate(CONFIGS):
        rank0, rank1 = per_rank[0][i], per_rank[1][i]
        assert rank0["orders"] == rank1["orders"], config
        assert rank0["orders"] == single_process(config, 2), config
        expected_len = N // 2 if config.get("drop_last") else (N + 1) // 2
        assert rank0["len"] == rank1["len"] == expected_len
        for epoch in range(EPOCHS):
            together = rank0["yielded"][epoch] + rank1["yielded"][epoch]
            if config.get("drop_last"):
                assert len(set(together)) == len(together) == N - 1
            else:
                assert set(together) == set(range(N)) and len(together) == N + 1


def parts_body(rank: int, world_size: int, payload: None) -> dict:
    """The same pair ordering with normalised rows, built from its parts (the exchange appended
    after Normalize) and from keywords (the exchange before it)."""
    from grabkit.order import Normalize, PairBalance

    X = gradients() * torch.arange(1, N + 1, dtype=torch.float64)[:, None]  # unequal norms
    by_parts = GraBSampler(range(N), PairBalance(N, seed=9), transforms=[Normalize()])
    by_keywords = GraBSampler(range(N), balance_type="pair", seed=9, normalize=True)
    orders = {"parts": [], "keywords": []}
    for epoch in range(EPOCHS):
        for name, sampler in (("parts", by_parts), ("keywords", by_keywords)):
            sampler.set_epoch(epoch)
            local = list(sampler)
            for start in range(0, len(local), LOCAL_BATCH):
                sampler.step(X[local[start : start + LOCAL_BATCH]])
            orders[name].append(sampler.order.tolist())
    return orders


@pytest.mark.distributed
def test_the_exchange_appended_to_a_chain_of_parts_decides_as_the_keyword_chain(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    per_rank = run_distributed(parts_body, world_size=2, payload=None)
    for orders in per_rank:
        assert orders["parts"] == orders["keywords"] == per_rank[0]["keywords"]
