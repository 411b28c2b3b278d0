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


@pytest.mark.parametrize("statistics", ["exact", "sketch"])
def test_an_input_gradient_forward_before_the_batch_is_not_balanced(statistics, reference_tools):
    """FGSM-style adversarial training: a clean forward whose gradient goes to the input only
    (``torch.autograd.grad``), then the real forward and backward. The loader fetched the whole
    epoch ahead, so a sampler counting the clean pass as a micro-batch would not notice: it
    would credit the clean statistics to this batch and this batch's to the next one."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    options = {"statistics": "sketch", "sketch_dim": 16} if statistics == "sketch" else {}
    hooked = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH, **options)
    given = GraBSampler(range(N), balance_type="pair")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(EPOCHS):
        order = list(hooked)  # fetched ahead: every index of the epoch handed out
        assert order == list(given)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            clean = x[idx].clone().requires_grad_()
            (input_grad,) = torch.autograd.grad(F.cross_entropy(model(clean), y[idx]), clean)
            adversarial = x[idx] + 0.1 * input_grad.sign()
            opt.zero_grad()
            per_example_loss(model(adversarial), y[idx]).mean().backward()
            hooked.step()
            reference = reference_tools.per_sample(model, per_example_loss, adversarial, y[idx])
            if statistics == "sketch":
                reference = hooked.stats.sketch.apply_dense(reference)
            given.step(reference)
            opt.step()
    assert list(hooked) == list(given)
    hooked.close()
