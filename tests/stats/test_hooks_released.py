"""A statistics object or a hook-mode sampler dropped without ``close()`` is garbage-collected,
and collection removes its hooks: the model runs as before and a new one attaches."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

from grabkit.order import GraBSampler
from grabkit.stats import PerSampleStats, SketchedStats


def model_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)), torch.randn(5, 4)


def hook_count(model: nn.Module) -> int:
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return modules + sum(len(p._backward_hooks or {}) for p in model.parameters())


def drop_after_a_step(make, model: nn.Module, x: torch.Tensor) -> None:
    holder = make(model)
    model(x).sum().backward()  # a step recorded and read, then the object dropped unclosed
    if isinstance(holder, GraBSampler):
        iter(holder)
        holder.step()
    del holder


MAKERS = {
    "PerSampleStats": PerSampleStats,
    "SketchedStats": lambda model: SketchedStats(model, dim=16),
    "GraBSampler": lambda model: GraBSampler(range(5), model=model, batch_size=5),
    "GraBSampler sketch": lambda model: GraBSampler(
        range(5), model=model, statistics="sketch", sketch_dim=16
    ),
}


@pytest.mark.parametrize("kind", MAKERS)
def test_collection_without_close_removes_the_hooks(kind):
    model, x = model_and_batch()
    drop_after_a_step(MAKERS[kind], model, x)
    gc.collect()
    assert hook_count(model) == 0
    with PerSampleStats(model) as stats:  # attaching again is allowed
        model(x).sum().backward()
        assert stats.norms_squared().shape == (5,)


def test_a_live_object_still_blocks_a_second_attach():
    model, _ = model_and_batch()
    first = PerSampleStats(model)
    gc.collect()
    with pytest.raises(RuntimeError, match="already attached"):
        PerSampleStats(model)
    first.close()
    PerSampleStats(model).close()


def test_a_copy_of_a_measured_model_is_not_measured():
    model, x = model_and_batch()
    with PerSampleStats(model) as stats:
        model(x[:3]).sum().backward()
        norms = stats.norms_squared().clone()
        twin = copy.deepcopy(model)  # an EMA or teacher copy
        pickled = pickle.loads(pickle.dumps(model))  # torch.save(model), a worker's copy
        twin(x).sum().backward()
        assert twin[0].weight.grad is not None
        pickled(x).sum().backward()
        torch.testing.assert_close(stats.norms_squared(), norms)  # still the model's 3 examples
