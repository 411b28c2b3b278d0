"""Estimator states saved before the state declarations (grabkit 0.1.0) load and resume to the
same estimates.

``data/states-0.1.0.pt`` holds, per estimator, a state taken part-way through a fixed run
(``tests/resume_cases.py``; the accumulation case below) and what the uninterrupted run produced
after that point, written by the earlier code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.resume_cases import cases

from grabkit.noise import AccumulationNoiseScale

SAVED = torch.load(Path(__file__).parent / "data" / "states-0.1.0.pt", weights_only=True)


@pytest.mark.parametrize("name", ["microbatch-noise", "per-example-noise", "alf-noise"])
def test_an_estimator_state_saved_before_resumes_to_the_same_estimates(name):
    case, saved = cases()[name], SAVED[name]
    estimator = case.make()
    estimator.load_state_dict(saved["state"])
    assert case.run(estimator, saved["cut"], case.events) == saved["tail"]


def _accumulation_run(estimator, model, start: int, stop: int) -> list:
    """Events: two microbatches then the step, repeated (as the saved run)."""
    results = []
    for event in range(start, stop):
        g = torch.Generator().manual_seed(200 + event)
        if event % 3 == 2:
            result = estimator.end_step()
            results.append(None if result is None else result.b_simple)
            model.zero_grad()
        else:
            x = torch.randn(6, 4, generator=g, dtype=torch.float64)
            (model(x).pow(2).mean() / 2).backward()
            estimator.end_microbatch(6)
    return results


def test_an_accumulation_state_saved_mid_step_before_resumes_to_the_same_estimates():
    saved = SAVED["accumulation-noise"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    with AccumulationNoiseScale(model, update_rate=0.3) as estimator:
        estimator.load_state_dict(saved["state"])
        for p, grad in zip(model.parameters(), saved["grads"], strict=True):
            p.grad = grad.clone()  # the model's accumulated gradient is saved beside it
        assert _accumulation_run(estimator, model, saved["cut"], 18) == saved["tail"]
