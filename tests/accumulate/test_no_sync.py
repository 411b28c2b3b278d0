"""Adaptive wrappers under DDP ``no_sync()`` accumulation (by hand or through accelerate's
``accumulate()``): the wrapper finds the microbatch gradients unreduced and averages them over the
ranks itself, so decisions and updates equal one process on the global microbatches."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tests.accumulate.distributed_bodies import KINDS, build
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss
from tests.accumulate.no_sync_bodies import SYNC_EVERY, body
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.distributed

REPO_ROOT = str(Path(__file__).resolve().parents[2])
SIZES = [4, 6, 2, 8, 4, 6, 2, 4, 8, 2, 6, 4]
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """Spawned ranks unpickle the body by module name: they need the repository on sys.path."""
    if REPO_ROOT not in sys.path:
        monkeypatch.syspath_prepend(REPO_ROOT)


def one_process(kind: str, loss_scale: float = 1.0, **options) -> tuple[list[bool], list]:
    """The wrapper on the global microbatches in one process: the reference."""
    model = make_model(0)
    wrapper = build(kind, model.parameters(), **options)
    decisions = []
    for x, y in make_microbatches(SIZES, seed=11):
        loss = mean_loss(model, x, y)
        (loss * loss_scale).backward()
        if kind == "mht":
            decisions.append(wrapper.step(loss.detach(), count=len(x)))
        else:
            decisions.append(wrapper.step(count=len(x)))
    wrapper.flush()
    return decisions, [p.detach().reshape(-1) for p in model.parameters()]


def assert_same_run(got: dict, decisions: list[bool], params: list[torch.Tensor], what: str):
    assert got["decisions"] == decisions, f"{what}: decisions differ from one process"
    for value, want in zip(got["params"], params, strict=True):
        torch.testing.assert_close(
            torch.tensor(value, dtype=want.dtype), want, rtol=1e-10, atol=1e-12, msg=what
        )


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    payload = {"sizes": SIZES, "accelerate": HAS_ACCELERATE}
    return run_distributed(body, 2, payload, timeout=300)


@pytest.mark.parametrize("kind", KINDS)
def test_no_sync_microbatches_give_the_one_process_run(ranks, kind):
    decisions, params = one_process(kind)
    assert 1 < sum(decisions) < len(decisions) or kind == "sbc"
    for rank, result in enumerate(ranks):
        assert_same_run(result["ddp"][kind], decisions, params, f"{kind}, rank {rank}")
        assert result["ddp"][kind]["warned"] == 1  # once, naming no_sync


def test_grad_scaled_unsynced_microbatches_give_the_one_process_run(ranks):
    decisions, params = one_process("gnts")  # the scales are powers of two: exact
    assert 1 < sum(decisions) < len(decisions)
    for rank, result in enumerate(ranks):
        assert_same_run(result["scaled"], decisions, params, f"GradScaler, rank {rank}")


def test_a_noise_scale_following_the_wrapper_is_the_same_under_no_sync(ranks):
    for result in ranks:
        synced, local = result["observed"]
        assert synced[2] == local[2] >= 2  # windows observed
        assert local[:2] == pytest.approx(synced[:2], rel=1e-9)
    assert ranks[0]["observed"] == ranks[1]["observed"]


def test_fully_shard_without_gradient_sync_is_refused_on_every_rank(ranks):
    for result in ranks:
        assert "set_requires_gradient_sync(False)" in result["fully_shard"]
        assert "on 2 of 2 ranks" in result["fully_shard"]


@pytest.mark.skipif(not HAS_ACCELERATE, reason="needs accelerate")
def test_accelerate_accumulate_gives_the_one_process_run(ranks):
    # accelerator.backward divides every loss by gradient_accumulation_steps
    decisions, params = one_process("gns", 1.0 / SYNC_EVERY, noise_multiplier=0.3)
    assert 1 < sum(decisions) < len(decisions)
    for rank, result in enumerate(ranks):
        assert_same_run(result["accelerate"], decisions, params, f"accelerate, rank {rank}")
