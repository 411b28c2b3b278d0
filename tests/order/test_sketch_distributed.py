"""Distributed hook-mode GraB with sketches, under ``DistributedDataParallel`` (gloo ranks).

Every rank sketches its local batch from the hooks on DDP's inner module, the ranks all-gather
the (B, k) sketches, and every rank decides as one process does on the global batch: the orders
must equal a one-process run on the same global batches (same model, same maps), on every rank,
with every example visited once per epoch, also across a mid-epoch resume of every rank from
rank 0's ``state_dict`` (frameworks save that one: Lightning's checkpoint holds rank 0's
``StatefulDataLoader`` snapshot, the sampler's state in it) and with micro-batches accumulated
under ``no_sync``.
"""

from __future__ import annotations

import io
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.support.distributed import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from grabkit.order import GraBSampler

N, LOCAL, EPOCHS, K, SEED = 48, 4, 3, 64, 7
CONFIGS = [
    {"balance_type": "pair"},
    {"balance_type": "sign"},
    {"balance_type": "mean", "accumulate": True},
]
SNAPSHOT = (1, 1)  # (epoch, steps taken in it) at which config 0 saves rank 0's state


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (N,), generator=gen)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def train(model, sampler, opt, batch, accumulate, first_epoch=0, snapshot_at=None):
    """Epochs ``first_epoch``..EPOCHS-1: (orders after each, yielded per epoch, snapshot)."""
    x, y = data()
    net = model.module if isinstance(model, DistributedDataParallel) else model
    orders, yielded, snapshot = [], [], None
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        it, seen, steps = iter(sampler), [], 0
        while idx := list(islice(it, batch)):
            seen += idx
            opt.zero_grad()
            parts = [idx[: len(idx) // 2], idx[len(idx) // 2 :]] if accumulate else [idx]
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                no_sync = getattr(model, "no_sync", None)
                if no_sync is not None and not last:
                    with no_sync():
                        (F.cross_entropy(model(x[part]), y[part]) / len(parts)).backward()
                else:
                    (F.cross_entropy(model(x[part]), y[part]) / len(parts)).backward()
            sampler.step()
            opt.step()
            steps += 1
            if snapshot_at == (epoch, steps):
                buffer = io.BytesIO()
                torch.save({"sampler": sampler.state_dict(), "model": net.state_dict()}, buffer)
                snapshot = buffer.getvalue()
        orders.append(sampler.order.tolist())
        yielded.append(seen)
    return orders, yielded, snapshot


def sampler_for(model: nn.Module, config: dict, **extra) -> GraBSampler:
    options = {k: v for k, v in config.items() if k != "accumulate"}
    options = {"statistics": "sketch", "sketch_dim": K, "seed": SEED, **options, **extra}
    return GraBSampler(range(N), model=model, **options)


def rank_body(rank: int, world_size: int, payload: None) -> dict:
    results = []
    for i, config in enumerate(CONFIGS):
        model = DistributedDataParallel(make_model())
        sampler = sampler_for(model, config)  # rank and replicas from the process group
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        accumulate = bool(config.get("accumulate"))
        orders, yielded, snapshot = train(
            model, sampler, opt, LOCAL, accumulate, snapshot_at=SNAPSHOT if i == 0 else None
        )
        sampler.close()
        entry = {"orders": orders, "yielded": yielded}
        if snapshot is not None:  # resume every rank from rank 0's state, finish the run
            shared = [snapshot]
            dist.broadcast_object_list(shared, src=0)
            saved = torch.load(io.BytesIO(shared[0]), weights_only=True)
            net = make_model()
            net.load_state_dict(saved["model"])
            model = DistributedDataParallel(net)
            resumed = sampler_for(model, config)
            resumed.load_state_dict(saved["sampler"])
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            entry["resumed"] = train(model, resumed, opt, LOCAL, False, first_epoch=SNAPSHOT[0])[0]
            resumed.close()
        results.append(entry)
    # the set-up check: a rank built with another sketch width is refused on every rank
    odd = sampler_for(make_model(), CONFIGS[0], sketch_dim=K if rank else 4 * K)
    try:
        iter(odd)
        refused = ""
    except ValueError as error:
        refused = str(error)
    odd.close()
    return {"results": results, "refused": refused}


def single_process(config: dict, world_size: int) -> list[list[int]]:
    """One process, the same model and maps, stepping global batches of W * LOCAL examples."""
    model = make_model()
    sampler = sampler_for(model, config, num_replicas=1, rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    orders = train(model, sampler, opt, world_size * LOCAL, bool(config.get("accumulate")))[0]
    sampler.close()
    return orders


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_ranks_decide_like_one_process_on_the_global_batch(world_size, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    per_rank = run_distributed(rank_body, world_size=world_size, timeout=300)
    for i, config in enumerate(CONFIGS):
        runs = [rank["results"][i] for rank in per_rank]
        expected = single_process(config, world_size)
        assert len({tuple(order) for order in expected}) > 1  # the gradients moved the orders
        for run in runs:
            assert run["orders"] == expected, (config, world_size)
        for epoch in range(EPOCHS):
            together = [index for run in runs for index in run["yielded"][epoch]]
            assert sorted(together) == list(range(N))  # every example once per epoch
        if i == 0:
            for run in runs:
                assert run["resumed"] == expected[SNAPSHOT[0] :]
    for rank in per_rank:
        assert "different configurations" in rank["refused"]
