"""``step_sampler``: the integrations' GraB step after a GradScaler-scaled backward divides the
scale out (the orders equal the unscaled run's, with a real ``torch.amp.GradScaler`` whose scale
changes every step) and skips an overflowing step's examples, as the scaler skips its update."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grabkit import GraBSampler
from grabkit.integrations.scaled_step import step_sampler

N, BATCH = 16, 4


def orders(scaler: torch.amp.GradScaler | None, overflow_at: int = -1) -> list[list[int]]:
    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sampler = GraBSampler(list(range(N)), model=model, batch_size=BATCH, balance_type="pair")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, step = [], 0
    for _ in range(4):
        order = list(sampler)
        seen.append(order)
        for start in range(0, N, BATCH):
            rows = torch.tensor(order[start : start + BATCH])
            loss = F.cross_entropy(model(x[rows]), y[rows])
            if step == overflow_at:
                loss = loss * float("inf")
            step += 1
            (loss if scaler is None else scaler.scale(loss)).backward()
            step_sampler(sampler, scaler)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    sampler.close()
    return seen


def test_a_changing_grad_scaler_scale_leaves_the_orders_of_the_unscaled_run() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    assert orders(scaler) == orders(None)
    assert scaler.get_scale() > 2.0**10  # it did change, every step


def test_an_overflowing_step_is_skipped_as_the_scaler_skips_it() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    seen = orders(scaler, overflow_at=5)
    assert all(sorted(order) == list(range(N)) for order in seen)
