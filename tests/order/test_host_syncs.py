"""One host synchronisation per exact hook step: the products go to the host once, and the signed
update reads its +1 / -1 rows from the host decision instead of reading the weights back.

On the CPU every read of a floating-point (or boolean) tensor's values by the host is counted
(``numpy``, ``item``, ``tolist``, ``bool``, ``float``): on a device each is a synchronisation.
On a GPU ``torch.cuda.set_sync_debug_mode`` counts the real ones. A send to the device is a
sync too unless it goes from pinned memory without blocking (``transfer.to_device``): on the CPU
every explicit move to a device made elsewhere is counted.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tests.support.device_sends import DeviceSends
from torch import nn

from grabkit import GraBSampler
from grabkit.stats import step as step_module
from grabkit.stats import transfer

_READS = ("numpy", "item", "tolist", "__bool__", "__float__")


class HostReads:
    """Counts host reads of floating-point and boolean tensors, by method, except the reads of
    tensors the host made itself (``grabkit.stats.transfer.host_values``: no sync anywhere)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.on_host = False
        for name in _READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))
        uncounted = self._uncounted(transfer.host_values)
        monkeypatch.setattr(step_module, "host_values", uncounted, raising=False)

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            if not self.on_host and (tensor.is_floating_point() or tensor.dtype == torch.bool):
                self.calls.append(name)
            return original(tensor, *args, **kwargs)

        return read

    def _uncounted(self, host_values):
        def read(tensor):
            self.on_host = True
            try:
                return host_values(tensor)
            finally:
                self.on_host = False

        return read


def _setup(device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).to(device)
    x = torch.randn(48, 6, device=device)
    y = torch.randint(0, 3, (48,), device=device)
    return model, x, y


#: the hook-mode steps whose GPU synchronisations are counted: exact (the second epoch balances
#: against a stale mean), the identity check on every step, sketched
HOOK_STEPS = {
    "mean": {"balance_type": "mean"},
    "pair": {"balance_type": "pair"},
    "mean-checked": {"balance_type": "mean", "stats_options": {"check_identity": "always"}},
    "sketch-pair": {"balance_type": "pair", "statistics": "sketch", "sketch_dim": 64},
}


@pytest.mark.parametrize("kind", list(HOOK_STEPS))
def test_a_hook_step_reads_the_device_once(kind, monkeypatch):
    # every Linear weight takes its signed sum from the batch gradient: the path that used to
    # send the +-1 weights to the device and read them back; the identity check's numbers and
    # the sketches' products share the one read
    monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
    model, x, y = _setup()
    with GraBSampler(range(48), model=model, batch_size=8, **HOOK_STEPS[kind]) as sampler:
        for epoch in range(2):  # the second epoch balances against a stale mean too
            order = list(sampler)
            for start in range(0, 48, 8):
                idx = order[start : start + 8]
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                reads = HostReads(monkeypatch)
                sampler.step()
                monkeypatch.undo()
                monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
                assert reads.calls == ["numpy"], (kind, epoch, start, reads.calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", list(HOOK_STEPS))
def test_a_hook_step_synchronises_with_the_gpu_once(kind, monkeypatch):
    monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
    model, x, y = _setup("cuda")
    with warnings.catch_warnings(record=True):  # the first switch warns "prototype feature"
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    with GraBSampler(range(48), model=model, batch_size=8, **HOOK_STEPS[kind]) as sampler:
        for _ in range(2):
            order = list(sampler)
            for start in range(0, 48, 8):
                idx = torch.tensor(order[start : start + 8], device="cuda")
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        sampler.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("kind", ["mean", "pair"])
def test_a_loss_scale_divided_out_adds_no_host_read(kind, monkeypatch):
    # step(grad_scale=...) scales the weights on the device and their host copy on the host:
    # the signed-sum shortcut keeps reading the host decision
    monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
    model, x, y = _setup()
    with GraBSampler(range(48), model=model, balance_type=kind, batch_size=8) as sampler:
        for epoch in range(2):
            order = list(sampler)
            for start in range(0, 48, 8):
                idx = order[start : start + 8]
                model.zero_grad()
                (F.cross_entropy(model(x[idx]), y[idx]) * 1024.0).backward()
                reads = HostReads(monkeypatch)
                sampler.step(grad_scale=1024.0)
                monkeypatch.undo()
                monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
                assert reads.calls == ["numpy"], (kind, epoch, start, reads.calls)


@pytest.mark.parametrize("kind", list(HOOK_STEPS))
def test_a_hook_step_sends_to_the_device_only_without_waiting(kind, monkeypatch):
    # on the CPU nothing waits; what is counted is each send that would wait on a GPU
    monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
    model, x, y = _setup()
    with GraBSampler(range(48), model=model, batch_size=8, **HOOK_STEPS[kind]) as sampler:
        for _ in range(2):
            order = list(sampler)
            for start in range(0, 48, 8):
                idx = order[start : start + 8]
                model.zero_grad()
                sends = DeviceSends(monkeypatch)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                sampler.step()
                monkeypatch.undo()
                monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
                assert sends.sites == [], sends.sites
