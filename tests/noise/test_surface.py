"""Every noise-scale estimator offers one surface: observe / estimate / close."""

from __future__ import annotations

import torch

from grabkit.noise import (
    AccumulationNoiseScale,
    DDPNoiseScale,
    GradientNoiseScaleEstimator,
    MicrobatchNoiseScale,
    PerExampleNoiseScale,
)
from grabkit.noise.estimator import NoiseEstimator


def test_every_estimator_is_a_noise_estimator():
    for cls in (AccumulationNoiseScale, DDPNoiseScale, GradientNoiseScaleEstimator,
                MicrobatchNoiseScale, PerExampleNoiseScale):  # fmt: skip
        assert issubclass(cls, NoiseEstimator), cls


def test_observe_returns_the_estimate_after_it():
    micro = MicrobatchNoiseScale(update_rate=0.5)
    assert micro.estimate is None
    for norm in (1.0, 1.4):
        micro.observe_microbatch(norm, 8)
    assert micro.observe(0.9) is not None and micro.observe(0.9) == micro.estimate
    per_example = PerExampleNoiseScale(update_rate=0.5)
    result = per_example.observe(torch.rand(16, dtype=torch.float64) + 0.5, 0.2)
    assert result == per_example.estimate
    alf = GradientNoiseScaleEstimator(update_rate=0.5)
    assert alf.estimate is None
    w = torch.randn(5, requires_grad=True, dtype=torch.float64)
    x = torch.randn(8, 5, dtype=torch.float64)
    result = alf.observe((x @ w - 1.0) ** 2, [w])
    assert result is not None and result.b_simple == alf.result().b_simple


def test_close_detaches_the_hooks():
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with AccumulationNoiseScale(model, update_rate=0.5) as gns:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            gns.end_microbatch(4)
        assert gns.observe().b_simple == gns.estimate.b_simple
    model(x).pow(2).mean().backward()  # no hook left: nothing recorded, no error
    assert gns._squares.abs().sum() == 0
