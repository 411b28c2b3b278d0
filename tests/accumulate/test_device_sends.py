"""An accumulation step sends host values to the device only through ``to_device``.

On a GPU, a tensor built from host values directly on the device (``torch.tensor(...,
device=...)``) or moved there from pageable memory (``x.to(device)``) waits for the device: a
hidden host synchronisation on every microbatch. On the CPU nothing waits, so every such move the
wrapper makes outside ``grabkit.stats.transfer`` is counted instead (tests/support/device_sends.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tests.accumulate.distributed_bodies import device_send_sites
from tests.accumulate.helpers import make_microbatches, make_model, mean_loss
from tests.support.device_sends import DeviceSends
from tests.support.distributed import run_distributed

from grabkit.accumulate import (
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperMHT,
    OptimizerWrapperSBC,
)

REPO_ROOT = str(Path(__file__).resolve().parents[2])
WRAPPERS = {
    "gnts": lambda inner: OptimizerWrapperGNTS(inner, max_batch_draws=3, norm_threshold=0.5),
    "gns": lambda inner: OptimizerWrapperGNS(inner, max_batch_draws=3),
    "mht": lambda inner: OptimizerWrapperMHT(inner, 0.8, 0.1, max_batch_draws=3),
    "sbc": lambda inner: OptimizerWrapperSBC(inner, 2, 6),
}
COUNTS = {
    "number": lambda n: n,
    "host tensor": lambda n: torch.tensor(n),  # the statistics vector path, read once
}


@pytest.mark.parametrize("count_kind", list(COUNTS))
@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_an_accumulation_step_sends_to_the_device_only_without_waiting(
    kind, count_kind, monkeypatch
):
    model = make_model()
    wrapper = WRAPPERS[kind](torch.optim.SGD(model.parameters(), lr=0.05))
    stepped = []
    for x, y in make_microbatches([2, 3, 2, 4, 3, 2, 3]):
        loss = mean_loss(model, x, y)
        loss.backward()
        sends = DeviceSends(monkeypatch)
        metric = float(loss.detach()) if kind == "mht" else None  # a host number, as users pass it
        stepped.append(wrapper.step(count=COUNTS[count_kind](len(x)), metric=metric))
        monkeypatch.undo()
        assert sends.sites == [], sends.sites
    assert any(stepped) and not all(stepped)  # windows were closed and kept open
    x, y = make_microbatches([3], seed=9)[0]
    mean_loss(model, x, y).backward()
    wrapper.step(count=COUNTS[count_kind](3), metric=0.5)
    sends = DeviceSends(monkeypatch)
    wrapper.flush()
    monkeypatch.undo()
    assert sends.sites == [], sends.sites


def test_a_step_under_a_grad_scaler_sends_to_the_device_only_without_waiting(monkeypatch):
    model = make_model()
    wrapper = OptimizerWrapperGNS(torch.optim.SGD(model.parameters(), lr=0.05), max_batch_draws=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for x, y in make_microbatches([2, 3, 2, 4]):
        scaler.scale(mean_loss(model, x, y)).backward()
        sends = DeviceSends(monkeypatch)
        scaler.step(wrapper)
        monkeypatch.undo()
        scaler.update()
        assert sends.sites == [], sends.sites


@pytest.mark.distributed
def test_a_step_under_ddp_sends_to_the_device_only_without_waiting(monkeypatch):
    """The statistics vector, the replica fingerprint and the ranks' own averaging of gradients
    DDP did not reduce (``no_sync()``) included."""
    monkeypatch.syspath_prepend(REPO_ROOT)  # spawned ranks unpickle the body by module name
    for sites in run_distributed(device_send_sites, 2):
        assert sites == [], sites


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("count_kind", ["number", "device tensor"])
@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_an_accumulation_step_synchronises_with_the_gpu_only_to_read_its_flags(kind, count_kind):
    """One sync per microbatch (the decision flag); a tensor count adds the statistics vector,
    read to check the count, as documented. A metric given as a host number adds none."""
    model = make_model().cuda()
    wrapper = WRAPPERS[kind](torch.optim.SGD(model.parameters(), lr=0.05))
    with warnings.catch_warnings(record=True):  # the first switch warns "prototype feature"
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    for x, y in make_microbatches([2, 3, 2, 4, 3, 2, 3]):
        loss = mean_loss(model, x.cuda(), y.cuda())
        loss.backward()
        metric = float(loss.detach()) if kind == "mht" else None
        count = len(x) if count_kind == "number" else torch.tensor(len(x), device="cuda")
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                wrapper.step(count=count, metric=metric)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == (1 if count_kind == "number" else 2), syncs
