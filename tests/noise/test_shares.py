"""``AccumulationNoiseScale.end_microbatch(count, share=...)``: steps whose microbatch losses are
not scaled by their count's part of the step.

accelerate's ``accumulate()`` divides every loss by ``gradient_accumulation_steps``, also in the
window the end of the loader cuts short: a window of 2 microbatches out of 4 holds half their
mean, which an estimator assuming count shares reads as a mean gradient at half its size (|G|^2
and tr(Sigma) of that step a quarter of their values, folded into the averages without a word).
With ``share=`` the step is measured as the weighted mean it is. References: the same loop with
each loss scaled by its count's share, and the two-batch identities evaluated by hand on
per-microbatch ``torch.autograd.grad`` gradients in float64.
"""

from __future__ import annotations

import pytest
import torch

from grabkit.noise import AccumulationNoiseScale

N_BATCHES, BATCH, ACCUMULATE = 10, 4, 4


def _rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=gen
    )


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def _pair(result) -> tuple[float, float]:
    return result.grad_norm_sq, result.trace_sigma


def _count_share_loop() -> list[tuple[float, float]]:
    """The reference: every window's losses scaled by their count's share of the window."""
    model, (x, y) = _net(), _rows(N_BATCHES * BATCH)
    gns = AccumulationNoiseScale(model, update_rate=1.0)
    estimates = []
    for start in range(0, N_BATCHES, ACCUMULATE):
        window = range(start, min(start + ACCUMULATE, N_BATCHES))
        for b in window:
            part = slice(b * BATCH, (b + 1) * BATCH)
            (_loss(model, x[part], y[part]) / len(window)).backward()
            gns.end_microbatch(BATCH)
        estimates.append(_pair(gns.end_step()))
        model.zero_grad()
    return estimates


@pytest.fixture
def fresh_accelerator_state():
    accelerate_state = pytest.importorskip("accelerate.state")
    yield
    accelerate_state.AcceleratorState._reset_state(True)
    accelerate_state.GradientState._reset_state()


def _accelerate_loop(share: bool) -> list[tuple[float, float]]:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, (x, y) = _net(), _rows(N_BATCHES * BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gns = AccumulationNoiseScale(model, update_rate=1.0)
    estimates = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, xb, yb))  # divided by ACCUMULATE, every window
            if share:
                gns.end_microbatch(len(yb), share=1 / accelerator.gradient_accumulation_steps)
            else:
                gns.end_microbatch(len(yb))
            if accelerator.sync_gradients:
                estimates.append(_pair(gns.end_step()))
            optimizer.step()
            optimizer.zero_grad()
    return estimates


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_accelerates_window_cut_short_by_the_loader_is_measured_with_its_shares():
    reference = _count_share_loop()
    assert len(reference) == 3  # windows of 4, 4 and 2 microbatches
    shared = _accelerate_loop(share=True)
    for got, want in zip(shared, reference, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    # without the shares the short window reads as a mean at half its size: a quarter of each
    unshared = _accelerate_loop(share=False)
    for got, want in zip(unshared[:2], reference[:2], strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert unshared[2] == pytest.approx((reference[2][0] / 4, reference[2][1] / 4), rel=1e-12)


def _flat_grad(model, x, y) -> torch.Tensor:
    grads = torch.autograd.grad(_loss(model, x, y), list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def test_equal_shares_of_unequal_microbatches_match_the_identities_by_hand():
    """Each microbatch's mean loss divided by the K microbatches (Trainer's and Lightning's
    accumulation), sizes 5, 3 and 8: weights 1 / K, not n_k / B."""
    model, (x, y) = _net(), _rows(16)
    parts = [slice(0, 5), slice(5, 8), slice(8, 16)]
    gns = AccumulationNoiseScale(model, update_rate=1.0)
    for part in parts:
        (_loss(model, x[part], y[part]) / len(parts)).backward()
        gns.end_microbatch(part.stop - part.start, share=1 / len(parts))
    got = _pair(gns.end_step())

    grads = [_flat_grad(model, x[p], y[p]) for p in parts]
    sizes = [float(p.stop - p.start) for p in parts]
    a = 1.0 / len(parts)
    small = sum(a * float(g.dot(g)) for g in grads)
    b_small = 1.0 / sum(a / n for n in sizes)
    mean = sum(a * g for g in grads)
    big, b_big = float(mean.dot(mean)), 1.0 / sum(a * a / n for n in sizes)
    grad_norm_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    assert got == pytest.approx((grad_norm_sq, trace), rel=1e-10)


def test_shares_are_given_for_every_microbatch_of_a_step_or_for_none():
    model, (x, y) = _net(), _rows(8)
    gns = AccumulationNoiseScale(model)
    _loss(model, x[:4], y[:4]).backward()
    gns.end_microbatch(4, share=0.5)
    _loss(model, x[4:], y[4:]).backward()
    with pytest.raises(ValueError, match="share= for every microbatch of the step or for none"):
        gns.end_microbatch(4)
    with pytest.raises(ValueError, match="share"):
        gns.end_microbatch(4, share=0.0)


def test_a_checkpoint_between_shared_microbatches_resumes_to_the_same_estimate(tmp_path):
    model, (x, y) = _net(), _rows(12)
    parts = [slice(0, 4), slice(4, 8), slice(8, 12)]

    def microbatch(gns, part) -> None:
        (_loss(model, x[part], y[part]) / 4).backward()
        gns.end_microbatch(4, share=0.25)

    whole = AccumulationNoiseScale(model, update_rate=1.0)
    for part in parts:
        microbatch(whole, part)
    want = _pair(whole.end_step())
    whole.close()
    model.zero_grad()

    first = AccumulationNoiseScale(model, update_rate=1.0)
    microbatch(first, parts[0])
    torch.save(first.state_dict(), tmp_path / "gns.pt")
    first.close()
    resumed = AccumulationNoiseScale(model, update_rate=1.0)
    resumed.load_state_dict(torch.load(tmp_path / "gns.pt", weights_only=True))
    for part in parts[1:]:
        microbatch(resumed, part)
    assert _pair(resumed.end_step()) == pytest.approx(want, rel=1e-12)
