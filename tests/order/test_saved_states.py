"""States saved by grabkit 0.1.0 (before the sampler was split into parts) still load, and the
resumed samplers make the orders the old ones made.

``data/states-0.1.0.pt`` holds, per ordering, a state taken mid-epoch and the orders the old
sampler went on to make from it (written by the 0.1.0 code with the loop in ``_continue``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grabkit import GraBSampler

SAVED = torch.load(Path(__file__).parent / "data" / "states-0.1.0.pt", weights_only=True)


def _continue(sampler: GraBSampler, X: torch.Tensor) -> list[list[int]]:
    n, live = len(X), sampler.state_dict()["live"]
    order, stepped = live["order"].tolist(), live["stepped"]
    for start in range(stepped, n, 3):  # the yielded, unstepped rest of the epoch
        sampler.step(X[order[start : start + 3]])
    assert list(sampler) == []  # the whole epoch had been yielded: an empty pass
    orders = []
    for _ in range(2):
        order = list(sampler)
        orders.append(order)
        for start in range(0, n, 4):
            sampler.step(X[order[start : start + 4]])
    return [*orders, list(sampler)]


@pytest.mark.parametrize("case", sorted(SAVED["cases"]))
def test_a_state_saved_before_the_split_resumes_to_the_same_orders(case):
    saved = SAVED["cases"][case]
    kind, form = case.rsplit("-", 1)
    sampler = GraBSampler(
        range(SAVED["n"]), balance_type=kind, seed=3, prob_balance=form == "prob",
        record_orders=True, **saved["options"],
    )  # fmt: skip
    sampler.load_state_dict(saved["state"])
    assert _continue(sampler, SAVED["X"]) == saved["orders"]
