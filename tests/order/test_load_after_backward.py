"""A hook-mode sampler loaded with a state after backwards that were never stepped (a framework's
trial fits, as Lightning's ``Tuner`` runs, restore a checkpoint after them): the loaded state is
the whole truth, and those backwards' statistics, the last one not yet taken included, are not
credited to the examples of the next step."""

from __future__ import annotations

import copy

import torch

from grabkit.order import GraBSampler


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = torch.randn(16, 5), torch.randint(0, 2, (16,))
    return model, x, y


def _run(stale_backward: bool) -> list[list[int]]:
    model, x, y = _setup()
    sampler = GraBSampler(range(16), model=model, seed=0, record_orders=True)
    fresh = copy.deepcopy(sampler.state_dict())
    if stale_backward:  # a trial: drawn from and backpropagated, never stepped
        trial = list(sampler)[:4]
        torch.nn.functional.cross_entropy(model(x[trial]), y[trial]).backward()
        sampler.load_state_dict(fresh)
    model.zero_grad()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, 16, 4):
            batch = order[start : start + 4]
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            sampler.step()
            model.zero_grad()
    return sampler.orders_history


def test_statistics_of_backwards_before_a_load_are_dropped():
    assert _run(stale_backward=True) == _run(stale_backward=False)
