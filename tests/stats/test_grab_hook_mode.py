"""GraB in an ordinary training loop: hook statistics make the torch.func path's decisions.

One model is trained with the user's own loop (forward, ``loss.backward()``, ``sampler.step()``,
``optimizer.step()``) and a hook-mode sampler; a second sampler is stepped on the same batches
with torch.func per-example gradients (Dropout masks of the same forward fixed in them). The two
must produce the same order every epoch, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import grabkit.stats.step as step_module
from grabkit.order import GraBSampler

pytestmark = pytest.mark.usefixtures("float64")

N, BATCH, EPOCHS = 24, 6, 3


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def model_with_dropout() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


@pytest.mark.parametrize("signed_sums_from_total", [False, True])
@pytest.mark.parametrize(
    ("balance_type", "optimizer"), [("mean", torch.optim.Adam), ("pair", torch.optim.SGD)]
)
def test_hook_mode_orders_equal_torch_func_orders(
    balance_type, optimizer, signed_sums_from_total, reference_tools, monkeypatch
):
    if signed_sums_from_total:  # every Linear weight takes its signed sums from the batch total
        monkeypatch.setattr(step_module, "_TWO_VALUED_MIN_ENTRIES", 1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = model_with_dropout()
    params = {n: p for n, p in model.named_parameters()}
    hooked = GraBSampler(dataset, model=model, balance_type=balance_type, loss_reduction="mean")
    dense = GraBSampler(dataset, params, balance_type=balance_type)
    opt = optimizer(model.parameters(), lr=0.05)
    orders = []
    for _ in range(EPOCHS):
        order = list(iter(hooked))
        assert order == list(iter(dense))
        orders.append(order)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            masks, handles = reference_tools.record_dropout_masks(model)
            loss = per_example_loss(model(x[idx]), y[idx]).mean()
            opt.zero_grad()
            loss.backward()
            for handle in handles:
                handle.remove()
            hooked.step()
            reference = reference_tools.per_sample(model, per_example_loss, x[idx], y[idx], masks)
            dense.step(reference)
            opt.step()
    assert list(iter(hooked)) == list(iter(dense))
    assert orders[1] != orders[2] or orders[0] != orders[1]  # the orders did change
    hooked.stats.close()
