"""``AccumulationNoiseScale`` on a model changed after the estimator was built: a replaced layer
or weight would receive gradients its hooks never see (left out of |G|^2 and tr(Sigma) without a
word), so the next microbatch's close is refused, naming the parameters; a module built
elsewhere in the meantime changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grabkit.noise import AccumulationNoiseScale


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def microbatch(net: nn.Module, estimator: AccumulationNoiseScale, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    (nn.functional.cross_entropy(net(x), y) / 2).backward()
    estimator.end_microbatch(5)


def step(net: nn.Module, estimator: AccumulationNoiseScale, seed: int):
    microbatch(net, estimator, seed)
    microbatch(net, estimator, seed + 1)
    result = estimator.end_step()
    net.zero_grad(set_to_none=True)
    return result


CHANGES = {
    "a replaced layer": lambda net: net.__setitem__(2, nn.Linear(6, 3).double()),
    "a replaced weight": lambda net: setattr(
        net[0], "weight", nn.Parameter(net[0].weight.detach().clone())
    ),
    "load_state_dict(assign=True)": lambda net: net.load_state_dict(
        {k: v.clone() for k, v in net.state_dict().items()}, assign=True
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_parameters_replaced_after_building_are_refused_naming_them(change):
    net = model()
    estimator = AccumulationNoiseScale(net, update_rate=0.5)
    step(net, estimator, 0)
    CHANGES[change](net)
    with pytest.raises(ValueError, match=r"got parameters after the estimator was built \('"):
        microbatch(net, estimator, 2)


def test_a_module_built_elsewhere_changes_nothing():
    net, other = model(), model()
    estimator = AccumulationNoiseScale(net, update_rate=0.5)
    reference = AccumulationNoiseScale(other, update_rate=0.5)
    step(net, estimator, 0)
    step(other, reference, 0)
    nn.Linear(3, 3)  # registrations elsewhere in the process
    assert step(net, estimator, 2).as_dict() == step(other, reference, 2).as_dict()
