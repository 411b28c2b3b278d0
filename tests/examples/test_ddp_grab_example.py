"""``examples/ddp_grab.py`` under torchrun, two gloo ranks: the ranks agree on every order, each
order is a permutation, GraB changes it, and the ranks split the next epoch without overlap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
N = 512  # the example's dataset size


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_ranks_share_every_order(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(REPO_ROOT / "examples" / "ddp_grab.py"), "--epochs=3", f"--out={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starts with" in done.stdout
    ranks = [torch.load(tmp_path / f"orders-{r}.pt", weights_only=True) for r in range(2)]
    for a, b in zip(ranks[0]["orders"], ranks[1]["orders"], strict=True):
        assert torch.equal(a, b)  # every rank decided as one
        assert sorted(a.tolist()) == list(range(N))
    first, *later = ranks[0]["orders"]
    assert all(not torch.equal(first, order) for order in later)
    local = [set(r["local"]) for r in ranks]
    assert not local[0] & local[1] and local[0] | local[1] == set(range(N))
