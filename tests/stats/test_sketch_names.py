"""Sketch maps after a rename: wrappers that rename parameters (``torch.compile``'s
``_orig_mod.``, DDP's ``module.``, FSDP's ``_fsdp_wrapped_module.``, checkpoint wrappers'
``_checkpoint_wrapped_module.``) draw the plain model's maps, and a sampler state of other maps
is refused. References: the plain model's sketches, and an uninterrupted plain run."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from tests.support.distributed import run_distributed
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from grabkit.order import GraBSampler
from grabkit.stats import SketchedStats
from grabkit.stats.names import canonical_parameter_names

N, BATCH, K = 24, 6, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (N,), generator=gen)


def wrapped(kind: str, model: Net) -> nn.Module:
    if kind == "compiled":
        return torch.compile(model, backend="eager")
    if kind == "compiled submodule":
        model.block = torch.compile(model.block, backend="eager")
        return model
    if kind == "checkpoint wrapper":
        model.block = checkpoint_wrapper(model.block)
        return model
    if kind == "data parallel":  # on the CPU a pass-through that prefixes "module."
        return nn.DataParallel(model)
    return torch.compile(checkpoint_wrapper(model), backend="eager")  # nested


KINDS = ["compiled", "compiled submodule", "checkpoint wrapper", "data parallel", "nested"]


@pytest.mark.parametrize("kind", KINDS)
def test_canonical_names_look_through_wrappers(kind):
    plain = [name for name, _ in net().named_parameters()]
    model = wrapped(kind, net())
    names = canonical_parameter_names(model)
    assert list(names.values()) == plain
    assert list(names) != plain  # the wrapper did rename them


def test_a_module_attribute_named_module_is_kept():
    holder = nn.Module()
    holder.module = nn.Linear(2, 2)
    assert list(canonical_parameter_names(holder).values()) == ["module.weight", "module.bias"]


def sketches_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, str]:
    with SketchedStats(model, dim=K, seed=3) as stats:
        F.cross_entropy(model(x), y).backward()
        return stats.sketches().clone(), stats.sketch.fingerprint


@pytest.mark.parametrize("kind", KINDS)
def test_wrapped_models_draw_the_plain_models_maps(kind):
    x, y = data()
    expected, fingerprint = sketches_of(net(), x, y)
    actual, wrapped_fingerprint = sketches_of(wrapped(kind, net()), x, y)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert wrapped_fingerprint == fingerprint


def test_maps_stay_canonical_after_the_trainable_set_changes():
    # a layer frozen after the first step: the maps drawn for the new set are still those of
    # the canonical names, so the wrapped model's sketches stay the plain model's
    x, y = data()
    results = []
    for model in (net(), wrapped("checkpoint wrapper", net())):
        with SketchedStats(model, dim=K, seed=3) as stats:
            F.cross_entropy(model(x), y).backward()
            stats.sketches()
            for p in [p for n, p in model.named_parameters() if "inp." in n]:
                p.requires_grad_(False)
            F.cross_entropy(model(x), y).backward()
            results.append(stats.sketches().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-12)


def run_sampler(sampler: GraBSampler, model: nn.Module, batches: int) -> None:
    """Step ``sampler`` on ``batches`` batches drawn lazily from it (the rest of an interrupted
    epoch first), with no training, so that two runs see the same gradients."""
    x, y = data()
    while True:
        drawn = iter(sampler)
        while batch := list(itertools.islice(drawn, BATCH)):
            idx = torch.tensor(batch)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sampler.step()
            batches -= 1
            if not batches:
                return


def sketch_sampler(model: nn.Module, **options) -> GraBSampler:
    return GraBSampler(
        range(N), model=model, balance_type="pair", statistics="sketch", sketch_dim=K,
        batch_size=BATCH, seed=2, record_orders=True, **options,
    )  # fmt: skip


def test_state_saved_compiled_resumes_uncompiled_as_the_uninterrupted_run():
    plain = net()
    uninterrupted = sketch_sampler(plain)
    run_sampler(uninterrupted, plain, batches=10)
    list(uninterrupted)
    uninterrupted.close()

    compiled = torch.compile(net(), backend="eager")
    first = sketch_sampler(compiled)
    run_sampler(first, compiled, batches=6)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model = net()
    resumed = sketch_sampler(model)
    resumed.load_state_dict(state)
    run_sampler(resumed, model, batches=4)
    list(resumed)
    resumed.close()
    assert resumed.orders_history == uninterrupted.orders_history
    assert len({tuple(o) for o in uninterrupted.orders_history}) > 2  # the orders did change


class Renamed(Net):
    """Net with its first layer under another name: other maps."""

    def __init__(self) -> None:
        super().__init__()
        self.first = self.inp
        del self.inp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.first(x)))


def test_state_of_other_maps_is_refused():
    saved = sketch_sampler(net())
    state = saved.state_dict()
    saved.close()
    other = sketch_sampler(Renamed().double())
    with pytest.raises(ValueError, match=r"other random maps.*looked through"):
        other.load_state_dict(state)
    other.close()
    old = {**state, "config": {k: v for k, v in state["config"].items() if "fingerprint" not in k}}
    again = sketch_sampler(net())
    with pytest.raises(ValueError, match="records no fingerprint"):
        again.load_state_dict(old)
    again.close()


def _ddp_sketches(rank: int, world_size: int, payload) -> dict:
    x, y = data()
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    out = {}
    for kind in ("plain", "ddp", "ddp compiled"):
        model = net()
        if kind != "plain":
            inner = torch.compile(model, backend="eager") if kind == "ddp compiled" else model
            model = DistributedDataParallel(inner)
        sketch, fingerprint = sketches_of(model, x[local], y[local])
        out[kind] = (sketch.tolist(), fingerprint)
    return out


@pytest.mark.slow
def test_ddp_wrapped_models_draw_the_plain_models_maps():
    for result in run_distributed(_ddp_sketches, world_size=2):
        assert result["ddp"] == result["plain"]
        assert result["ddp compiled"][1] == result["plain"][1]
        torch.testing.assert_close(
            torch.tensor(result["ddp compiled"][0]), torch.tensor(result["plain"][0])
        )


@pytest.mark.slow
def test_inductor_compiled_model_draws_the_plain_models_maps():
    x, y = data()
    expected, fingerprint = sketches_of(net(), x, y)
    actual, compiled_fingerprint = sketches_of(torch.compile(net()), x, y)
    torch.testing.assert_close(actual, expected)
    assert compiled_fingerprint == fingerprint
