"""GraB under DistributedDataParallel, launched with torchrun (CPU, gloo):

    torchrun --standalone --nproc_per_node=2 examples/ddp_grab.py

Every rank reads a (B, k) sketch of its own examples' gradients from layer hooks, the ranks
all-gather the sketches (W * B * k numbers a step, whatever the model's size), and every rank
makes the decisions one process would make on the global batch: the next epoch's order is the
same on every rank, and the ranks split it as ``DistributedSampler`` does. ``--out DIR`` writes
each rank's orders to ``DIR/orders-RANK.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from grabkit import GraBSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write each rank's orders here")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(512, 20, generator=generator)
    y = (x[:, :5].sum(1) > 0).long()
    dataset = TensorDataset(x, y)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)))
    # num_replicas and rank come from the process group; the hooks go on DDP's inner module
    sampler = GraBSampler(dataset, model=model, balance_type="pair", statistics="sketch",
                          sketch_dim=256, batch_size=16)  # fmt: skip
    loader = DataLoader(dataset, sampler=sampler, batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    orders = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            sampler.step()  # every rank balances the global batch from the gathered sketches
            optimizer.step()
        orders.append(sampler.order.clone())  # the global order this epoch was visited in
    local = list(sampler)  # this rank's share of the next epoch, ordered by this run's decisions
    orders.append(sampler.order.clone())
    sampler.close()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"orders": orders, "local": local}, args.out / f"orders-{rank}.pt")
    if rank == 0:
        print(f"epoch {args.epochs} starts with {sampler.order[:8].tolist()} on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
