"""Backwards whose gradients were reset (``zero_grad``) before any optimizer step trained
nothing, so they are no micro-batch of the sampler's step: a GAN generator's step through the
discriminator, an FGSM ``loss.backward()`` taken for the input gradient before the adversarial
one. Kept with the step's own backward, their rows went to the next yielded examples (the
epoch's order was credited with the wrong gradients and ran out a batch early; with a loader
fetching ahead, or the sampler's order driven by hand, without a word). Hook mode refuses them
at ``step()``, naming the fix; a backward whose gradients an optimizer step used stays a
micro-batch of the next ``step()``, as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit import GraBSampler

N, B, Z = 16, 4, 3


def gan(freeze: bool, **sampler_options) -> None:
    """The DCGAN loop (the discriminator's gradients zeroed before its step), GraB on the
    discriminator's real examples, driven by the sampler's order."""
    torch.manual_seed(0)
    real = torch.randn(N, 5)
    G = nn.Sequential(nn.Linear(Z, 8), nn.Tanh(), nn.Linear(8, 5))
    D = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_d = torch.optim.SGD(D.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.01)
    sampler = GraBSampler(range(N), model=D, balance_type="pair", batch_size=B, **sampler_options)
    for _ in range(2):
        order = list(sampler)
        for start in range(0, N, B):
            fake = G(torch.randn(B, Z))
            D.zero_grad()
            D_real = D(real[order[start : start + B]])
            loss_d = F.softplus(-D_real).mean() + sampler.stats.batch_term(
                F.softplus(D(fake.detach())).mean()
            )
            loss_d.backward()
            sampler.step()
            opt_d.step()
            D.requires_grad_(not freeze)
            G.zero_grad()
            F.softplus(-D(fake)).mean().backward()  # reaches D's parameters unless frozen
            opt_g.step()
            D.requires_grad_(True)
    sampler.close()


@pytest.mark.parametrize("options", [{}, {"statistics": "sketch", "sketch_dim": 32}])
def test_a_generator_step_through_the_discriminator_is_refused(options):
    with pytest.raises(ValueError, match=r"reset.*before any optimizer step.*requires_grad_"):
        gan(freeze=False, **options)


def test_the_gan_loop_with_the_discriminator_frozen_for_the_generator_step_runs():
    gan(freeze=True)


def classifier() -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """Data (x, y), a small classifier and its SGD optimizer."""
    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 2, (N,))
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    return x, y, model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_an_fgsm_backward_before_the_adversarial_one_is_refused():
    x, y, model, opt = classifier()
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=B)
    order = list(sampler)
    idx = order[:B]
    xb = x[idx].clone().requires_grad_(True)
    F.cross_entropy(model(xb), y[idx]).backward()  # for xb.grad; the parameters' too
    adversarial = (xb + 0.1 * xb.grad.sign()).detach()
    opt.zero_grad()
    F.cross_entropy(model(adversarial), y[idx]).backward()
    with pytest.raises(ValueError, match=r"torch\.autograd\.grad"):
        sampler.step()
    sampler.close()


def test_a_backward_an_optimizer_step_used_stays_a_micro_batch_of_the_next_step():
    """A loop that forgot one ``step()``: both batches balanced at the next, in order."""
    x, y, model, opt = classifier()
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=B)
    order = list(sampler)
    for start in (0, B):
        idx = order[start : start + B]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    sampler.step()
    assert sampler.state_dict()["live"]["stepped"] == 2 * B
    sampler.close()


def test_a_step_after_a_fused_optimizer_step_and_zero_grad_is_balanced():
    """A fused optimizer updates the parameters without a version bump, so its step cannot be
    told from none; a loop that steps the sampler after ``zero_grad`` still balances every
    batch, since only a backward followed by another before ``step()`` is asked."""
    x, y, model, _ = classifier()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=B)
    for _ in range(2):
        order = list(sampler)
        for start in range(0, N, B):
            idx = order[start : start + B]
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            sampler.step()
        assert sampler.state_dict()["live"]["stepped"] == N
    sampler.close()


def test_each_backward_reset_unused_is_counted_once():
    x, y, model, opt = classifier()
    sampler = GraBSampler(range(N), model=model, balance_type="pair", batch_size=B)
    idx = list(sampler)[:B]
    for _ in range(3):  # three backwards whose gradients nothing used
        F.cross_entropy(model(x[idx].clone()), y[idx]).backward()
        opt.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    with pytest.raises(ValueError, match=r"^hook mode: 3 backward\(s\)"):
        sampler.step()
    sampler.close()


def test_microbatches_an_accumulation_wrapper_folded_are_balanced_at_its_step():
    """AdaptiveAccumulationWrapper folds each microbatch's .grad away (the parameters unchanged
    until its window's step), which is no reset: a sampler stepped once per window balances
    every microbatch of it, as one stepped after each; a microbatch the wrapper drops unused
    (zero_grad after its backward) is still refused."""
    from grabkit import AdaptiveAccumulationWrapper, NormTest

    orders = {}
    for per_window in (False, True):
        x, y, model, _ = classifier()
        opt = AdaptiveAccumulationWrapper(
            torch.optim.SGD(model.parameters(), lr=0.1), NormTest(1e-6), max_batch_draws=2
        )
        sampler = GraBSampler(
            range(N), model=model, balance_type="pair", batch_size=B // 2, record_orders=True
        )
        for _ in range(3):
            order = list(sampler)
            for start in range(0, N, B // 2):
                idx = order[start : start + B // 2]
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                stepped = opt.step(count=len(idx))
                if stepped or not per_window:
                    sampler.step()
        orders[per_window] = [*sampler.orders_history, list(sampler)]
        F.cross_entropy(model(x[:2]), y[:2]).backward()
        opt.zero_grad()  # the wrapper drops this microbatch: its gradient trained nothing
        F.cross_entropy(model(x[2:4]), y[2:4]).backward()
        with pytest.raises(ValueError, match=r"1 backward\(s\).*reset"):
            sampler.step()
        sampler.close()
    assert orders[True] == orders[False]
