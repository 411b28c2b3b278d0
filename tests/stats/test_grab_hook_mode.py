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


def data_and_mlp() -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """N examples (5 features, 3 classes) and a small MLP, seeded alike in every test."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    torch.manual_seed(0)
    return x, y, nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def sketch_options(statistics: str) -> dict:
    return {"statistics": "sketch", "sketch_dim": 16} if statistics == "sketch" else {}


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
    x, y, model = data_and_mlp()
    options = sketch_options(statistics)
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


# -- one batch differentiated twice in one step: SAM, LBFGS, a second pass on the same tensor ----
def sam_backwards(model, xb, yb):
    """SAM's ascent backward at w, then its descent backward at w + e (weights restored)."""
    F.cross_entropy(model(xb), yb).backward()
    with torch.no_grad():
        steps = [0.05 * p.grad / p.grad.norm() for p in model.parameters()]
        for p, e in zip(model.parameters(), steps, strict=True):
            p.add_(e)
    model.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    with torch.no_grad():
        for p, e in zip(model.parameters(), steps, strict=True):
            p.sub_(e)


def lbfgs_backwards(model, xb, yb):
    """LBFGS evaluates its closure (forward and backward) several times per step."""
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        return loss

    opt.step(closure)


def two_loss_terms_backwards(model, xb, yb):
    """A loss of two terms, each with its own forward and backward into ``.grad``."""
    F.cross_entropy(model(xb), yb).backward()
    (0.1 * model(xb).square().mean()).backward()


def views_of_the_batch_backwards(model, xb, yb):
    """A loss computed in two passes over views of the same rows."""
    F.cross_entropy(model(xb[:, :5]), yb).backward()
    F.cross_entropy(model(xb[:, :5]), yb).backward()


@pytest.mark.parametrize("statistics", ["exact", "sketch"])
@pytest.mark.parametrize(
    "backwards",
    [sam_backwards, lbfgs_backwards, two_loss_terms_backwards, views_of_the_batch_backwards],
)
def test_two_backwards_over_the_same_input_in_one_step_are_refused(backwards, statistics):
    """The loader fetched the epoch ahead, so the count of examples does not tell: silently
    wrong on the old code (the second backward's statistics credited to the next batch's
    examples, every batch after them shifted, until the epoch ran out of examples)."""
    x, y, model = data_and_mlp()
    options = sketch_options(statistics)
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH, **options)
    order = list(sampler)  # fetched ahead: every index of the epoch handed out
    idx = torch.tensor(order[:BATCH])
    xb = x[idx] if backwards is not views_of_the_batch_backwards else torch.cat([x[idx]] * 2, 1)
    with pytest.raises(ValueError, match="same input"):
        backwards(model, xb, y[idx])
        sampler.step()
    sampler.skip()  # the way out for that batch
    sampler.close()


def test_sam_with_its_ascent_gradient_from_autograd_grad_balances_the_descent(reference_tools):
    """The fix the refusal names: the ascent gradient by ``torch.autograd.grad`` (not counted),
    the descent by ``backward()``: GraB balances each example's descent gradient."""
    x, y, model = data_and_mlp()
    params = list(model.parameters())
    hooked = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH)
    given = GraBSampler(range(N), balance_type="pair")
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):
        order = list(hooked)
        assert order == list(given)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            ascent = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
            steps = [0.05 * g / g.norm() for g in ascent]
            with torch.no_grad():
                for p, e in zip(params, steps, strict=True):
                    p.add_(e)
            opt.zero_grad()
            per_example_loss(model(x[idx]), y[idx]).mean().backward()
            hooked.step()
            given.step(reference_tools.per_sample(model, per_example_loss, x[idx], y[idx]))
            with torch.no_grad():
                for p, e in zip(params, steps, strict=True):
                    p.sub_(e)
            opt.step()
    assert list(hooked) == list(given)
    hooked.close()


def test_accumulation_over_chunks_of_one_tensor_is_no_second_pass(reference_tools):
    """Micro-batches that are views of one tensor hold other rows: each its own examples."""
    x, y, model = data_and_mlp()
    hooked = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH // 2)
    given = GraBSampler(range(N), balance_type="pair")
    order = list(hooked)
    assert order == list(given)
    for start in range(0, N, BATCH):
        idx = torch.tensor(order[start : start + BATCH])
        xb, yb = x[idx], y[idx]
        for part in range(2):
            rows = slice(part * BATCH // 2, (part + 1) * BATCH // 2)
            (per_example_loss(model(xb[rows]), yb[rows]).sum() / BATCH).backward()
            given.step(reference_tools.per_sample(model, per_example_loss, xb[rows], yb[rows]) / 2)
        hooked.step()
    assert list(hooked) == list(given)
    hooked.close()


def test_a_token_mean_loss_balanced_with_its_count_as_grad_scale():
    """A token-level mean over a padded batch is B / n_tokens times the mean of the examples'
    token sums, a factor that changes from batch to batch; ``step(grad_scale=B / n_tokens)``
    balances every batch's token sums on one scale (as a sampler given them would)."""
    gen = torch.Generator().manual_seed(1)
    T = 4
    x, y = torch.randn(N, T, 5, generator=gen), torch.randint(0, 3, (N, T), generator=gen)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (N, 1), generator=gen)).double()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def token_sums(out, target, m):
        return (F.cross_entropy(out.transpose(1, 2), target, reduction="none") * m).sum(1)

    hooked = GraBSampler(range(N), model=model, balance_type="pair", batch_size=BATCH)
    given = GraBSampler(range(N), balance_type="pair")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        order = list(hooked)
        assert order == list(given)
        for start in range(0, N, BATCH):
            idx = torch.tensor(order[start : start + BATCH])
            n_tokens = mask[idx].sum()
            opt.zero_grad()
            (token_sums(model(x[idx]), y[idx], mask[idx]).sum() / n_tokens).backward()
            hooked.step(grad_scale=float(BATCH / n_tokens))
            sums = token_sums(model(x[idx]), y[idx], mask[idx])
            params = list(model.parameters())
            reference = [torch.autograd.grad(s, params, retain_graph=True) for s in sums]
            given.step(torch.stack([torch.cat([g.reshape(-1) for g in r]) for r in reference]))
            opt.step()
    assert list(hooked) == list(given)
    hooked.close()
