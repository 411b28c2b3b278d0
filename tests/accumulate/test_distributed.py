"""Under torch.distributed every decision is agreed by all ranks; DDP equals one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.accumulate.distributed_bodies import body, build, unequal_counts_refusal
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss
from tests.support.distributed import run_distributed

from grabkit.accumulate import AdaptiveAccumulationWrapper, NormThreshold

pytestmark = pytest.mark.distributed

REPO_ROOT = str(Path(__file__).resolve().parents[2])
DDP_SIZES = [4, 6, 2, 8, 4, 6, 2, 4, 8, 2]


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """Spawned ranks unpickle the body by module name: they need the repository on sys.path."""
    if REPO_ROOT not in sys.path:
        monkeypatch.syspath_prepend(REPO_ROOT)


def sharded_payload():
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(8, generator=gen, dtype=torch.float64) for _ in range(3)]


def single_process_gns_reference():
    model = make_model(0)
    wrapper = build("gns", model.parameters(), noise_multiplier=0.3)
    decisions = []
    for x, y in make_microbatches(DDP_SIZES, seed=11):
        mean_loss(model, x, y).backward()
        decisions.append(wrapper.step(count=len(x)))
    return decisions, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_agree_and_ddp_equals_one_process(world_size):
    grads = sharded_payload()
    payload = {"sharded_grads": grads, "ddp_sizes": DDP_SIZES if world_size == 2 else None}
    results = run_distributed(body, world_size, payload)

    for kind, decisions in results[0]["adversarial"].items():
        assert any(decisions), kind
        for other in results[1:]:
            assert other["adversarial"][kind] == decisions, f"{kind}: ranks disagree"

    events = results[0]["disagreement"]
    assert events[2] == "nonfinite_skipped" and events[4] == "RuntimeError"
    assert events[6] == "ValueError" and events[-1] == "True"
    assert all(r["disagreement"] == events for r in results), "ranks disagree"

    full_norm = float((sum(grads) / len(grads)).norm())
    for r in results:
        assert r["sharded"]["norm"] == pytest.approx(full_norm, rel=1e-12)

    if world_size == 2:
        decisions, params = single_process_gns_reference()
        assert 1 < sum(decisions) < len(decisions)
        for r in results:
            assert r["ddp"]["decisions"] == decisions
            for got, want in zip(r["ddp"]["params"], params, strict=True):
                torch.testing.assert_close(torch.tensor(got, dtype=want.dtype), want)
        # ranks counting different weights: DDP's equal-weight average may misweight the
        # window (it depends on how each rank's loss was normalised): said once, on every rank
        for r in results:
            assert r["unequal_counts"] == [False, True, False, False]


def test_ranks_counting_different_weights_are_refused_before_anything_is_applied():
    """``unequal_counts="raise"``: the microbatch that would close the first window is refused
    on every rank (naming what, where and the fix), leaving the parameters, the window and the
    counters as they were: the run then equals one process without that microbatch."""
    sizes = [4, 4, 4, 4, 4]
    ranks = run_distributed(unequal_counts_refusal, 2, sizes)
    model = make_model(0)
    wrapper = AdaptiveAccumulationWrapper(
        torch.optim.SGD(model.parameters(), lr=0.05), NormThreshold(0.0), max_batch_draws=2
    )
    stepped = []
    for i, (x, y) in enumerate(make_microbatches(sizes, seed=5)):
        if i != 1:
            mean_loss(model, x, y).backward()
            stepped.append(wrapper.step(count=len(x)))
    assert stepped == [False, True, False, True]
    for rank in ranks:
        message = rank["message"]
        assert message is not None and rank["unchanged"]
        assert message.startswith("AdaptiveAccumulationWrapper(unequal_counts='raise')")
        assert "counted different weights" in message and "DistributedSampler" in message
        assert rank["stepped"] == stepped
        for got, want in zip(rank["params"], model.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=want.dtype), want.detach())
