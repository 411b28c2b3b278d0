"""DDPNoiseScale in 2 and 4 gloo processes equals the single-process computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.noise.ddp_bodies import alf_resume_per_rank, train_and_measure
from tests.noise.helpers import digits, make_model, per_example_loss
from tests.support.distributed import run_distributed

from grabkit.noise import DDPNoiseScale, MicrobatchNoiseScale

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def _single_process_reference(payload: dict) -> list[dict]:
    """The same SGD steps in one process: each rank's shard is one microbatch."""
    x, y = payload["x"], payload["y"]
    model = make_model(payload["seed"])
    params = [p for _, p in model.named_parameters()]
    est = MicrobatchNoiseScale(
        update_rate=payload["update_rate"], block_names=[n for n, _ in model.named_parameters()]
    )
    out = []
    for step in range(x.shape[0]):
        shard_grads = []
        for rank in range(x.shape[1]):
            loss = per_example_loss(model, x[step, rank], y[step, rank]).mean()
            grads = torch.autograd.grad(loss, params)
            shard_grads.append(grads)
            est.observe_microbatch(torch.stack([(g * g).sum() for g in grads]), x.shape[2])
        mean = [torch.stack(gs).mean(0) for gs in zip(*shard_grads, strict=True)]
        result = est.observe_step(torch.stack([(g * g).sum() for g in mean]))
        out.append(result)
        with torch.no_grad():
            for p, g in zip(params, mean, strict=True):
                p -= payload["lr"] * g
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "microbatches"), [(2, 2), (4, 1)])
def test_ddp_estimates_equal_the_single_process_computation(world_size, microbatches, monkeypatch):
    monkeypatch.syspath_prepend(REPO_ROOT)  # spawned ranks import the body by module name
    x, y = digits()
    steps, local = 3, 8
    gen = torch.Generator().manual_seed(world_size)
    index = torch.randint(x.shape[0], (steps, world_size, local), generator=gen)
    payload = {
        "x": x[index],
        "y": y[index],
        "seed": 3,
        "lr": 0.5,
        "update_rate": 0.5,
        "microbatches": microbatches,
    }
    per_rank = run_distributed(train_and_measure, world_size, payload)
    reference = _single_process_reference(payload)
    for rank_results in per_rank:
        assert "synchronised gradients 2 times" in rank_results[-1]["double_sync_error"]
        for got, want in zip(rank_results[:-1], reference, strict=True):
            assert got["grad_norm_sq"] == pytest.approx(want.block_grad_norm_sq.tolist(), rel=1e-9)
            assert got["trace_sigma"] == pytest.approx(want.block_trace_sigma.tolist(), rel=1e-9)
            assert got["b_simple"] == pytest.approx(want.b_simple, rel=1e-9)
            assert got["interval"] == pytest.approx(want.interval, rel=1e-6)


def test_ddp_estimator_rejects_a_plain_module():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        DDPNoiseScale(torch.nn.Linear(2, 2))


@pytest.mark.distributed
def test_alf_estimator_resumes_per_rank_and_refuses_another_ranks_state(monkeypatch):
    """Each rank's ALF estimator measures its own batches: its state is that rank's. Resumed
    from its own state every rank continues its uninterrupted estimates bitwise; rank 0's state
    (what a checkpoint only rank 0 writes holds) is refused on rank 1, naming both ranks."""
    monkeypatch.syspath_prepend(REPO_ROOT)
    x, y = digits()
    index = torch.randint(x.shape[0], (5, 2, 8), generator=torch.Generator().manual_seed(5))
    payload = {"x": x[index], "y": y[index], "seed": 3, "lr": 0.5, "update_rate": 0.3, "cut": 3}
    per_rank = run_distributed(alf_resume_per_rank, 2, payload)
    assert per_rank[0]["whole"] != per_rank[1]["whole"]  # the ranks' estimates differ
    for got in per_rank:
        assert got["resumed"] == got["whole"]
        assert got["same_result"]
    assert per_rank[0]["refused"] is None
    message = per_rank[1]["refused"]
    assert message is not None
    assert "rank 0" in message and "rank 1" in message and "own state" in message
