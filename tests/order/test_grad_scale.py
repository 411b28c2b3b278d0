"""Hook-mode GraB under a loss scale (``torch.amp.GradScaler``): the hooks see the gradients of
the scaled loss, whose scale changes between steps (growth, back-off after an overflow).
``step(grad_scale=...)`` divides it out, so the orders equal those of the unscaled run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit import GraBSampler

N, BATCH = 16, 4
SCALES = [1024.0, 1024.0, 2048.0, 512.0, 4096.0]


def orders(scales: list[float], pass_scale, balance: str, **options) -> list[list[int]]:
    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sampler = GraBSampler(
        list(range(N)), model=model, batch_size=BATCH, balance_type=balance, **options
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, step = [], 0
    for _ in range(4):
        order = list(sampler)
        seen.append(order)
        for start in range(0, N, BATCH):
            rows = torch.tensor(order[start : start + BATCH])
            scale = scales[step % len(scales)]
            step += 1
            (F.cross_entropy(model(x[rows]), y[rows]) * scale).backward()
            if pass_scale is None:
                sampler.step()
            else:
                sampler.step(grad_scale=pass_scale(scale))
            for p in model.parameters():
                p.grad /= scale
            opt.step()
            opt.zero_grad()
    sampler.close()
    return seen


class ScalerLike:
    """What ``torch.amp.GradScaler`` offers the sampler: ``get_scale()``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


@pytest.mark.parametrize("balance", ["mean", "pair"])
@pytest.mark.parametrize("statistics", ["exact", "sketch"])
@pytest.mark.parametrize("given", [float, ScalerLike], ids=["float", "scaler"])
def test_a_changing_loss_scale_divided_out_gives_the_unscaled_orders(
    balance: str, statistics: str, given
) -> None:
    options = {"statistics": statistics} | ({"sketch_dim": 16} if statistics == "sketch" else {})
    plain = orders([1.0], None, balance, **options)
    assert orders(SCALES, given, balance, **options) == plain


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_a_loss_scale_that_is_not_a_positive_number_is_refused(bad: float) -> None:
    model = nn.Linear(5, 3)
    sampler = GraBSampler(list(range(8)), model=model, batch_size=4)
    list(sampler)
    F.cross_entropy(model(torch.randn(4, 5)), torch.randint(0, 3, (4,))).backward()
    with pytest.raises(ValueError, match="grad_scale"):
        sampler.step(grad_scale=bad)
    sampler.close()


def test_one_scale_for_microbatches_an_accumulation_wrapper_folded_is_refused() -> None:
    """Under an AdaptiveAccumulationWrapper the GradScaler updates after every microbatch, so
    one scale at a window's step() cannot be that of every microbatch in it: refused, naming
    the fix (a step() after each microbatch's backward, which reads that microbatch's scale)."""
    from grabkit import AdaptiveAccumulationWrapper, NormTest

    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    wrapper = AdaptiveAccumulationWrapper(
        torch.optim.SGD(model.parameters(), lr=0.05), NormTest(1e-6), max_batch_draws=2
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH)
    order = list(sampler)
    for start in (0, BATCH):
        rows = order[start : start + BATCH]
        scaler.scale(F.cross_entropy(model(x[rows]), y[rows])).backward()
        scaler.step(wrapper)
        scaler.update()  # 8, then 16: the window's microbatches have different scales
    with pytest.raises(ValueError, match=r"grad_scale.*after each microbatch"):
        sampler.step(grad_scale=scaler)
    sampler.close()


def _amp_loop(
    read_after_update: bool, statistics: str = "exact", enabled: bool = True
) -> list[list[int]]:
    """The AMP recipe (scale, backward, scaler.step, scaler.update) on the CPU with a scale
    that doubles after every step (growth_interval=1; ``enabled=False``: no scaling), the
    sampler stepped with the scaler before ``scaler.step`` or after ``scaler.update()``."""
    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    options = {"statistics": statistics} | ({"sketch_dim": 16} if statistics == "sketch" else {})
    sampler = GraBSampler(list(range(N)), model=model, batch_size=BATCH, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1, enabled=enabled)
    seen = []
    for _ in range(2):
        order = list(sampler)
        seen.append(order)
        for start in range(0, N, BATCH):
            rows = torch.tensor(order[start : start + BATCH])
            scaler.scale(F.cross_entropy(model(x[rows]), y[rows])).backward()
            if not read_after_update:
                sampler.step(grad_scale=scaler)
            scaler.step(opt)
            scaler.update()
            if read_after_update:
                sampler.step(grad_scale=scaler)
            opt.zero_grad()
    sampler.close()
    return seen


@pytest.mark.parametrize("statistics", ["exact", "sketch"])
def test_a_scaler_read_after_its_update_is_refused(statistics: str) -> None:
    """``sampler.step(grad_scale=scaler)`` after ``scaler.update()`` reads the next step's scale
    (here twice the loss's): the update would be divided out of the examples' gradients as if
    the loss had been scaled by it (half their size on every growth step, silently). The
    optimizer has stepped since the backward and the scaler holds no step of it: refused,
    naming the order; read before ``scaler.update()``, the orders are those of the loop with
    no scaling at all."""
    with pytest.raises(ValueError, match=r"scaler\.update\(\)"):
        _amp_loop(read_after_update=True, statistics=statistics)
    unscaled = _amp_loop(read_after_update=False, statistics=statistics, enabled=False)
    assert _amp_loop(read_after_update=False, statistics=statistics) == unscaled
