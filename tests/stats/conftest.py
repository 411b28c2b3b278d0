"""Slow, obvious references for the statistics engine: torch.func per-example gradients.

Tests get them through fixtures (``per_sample_reference``, ``assert_matches_reference``) so no
test module imports another.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from grabkit.stats import PerSampleStats

RELATIVE_TOLERANCE = 1e-6


class FixedMask(nn.Module):
    """Stands in for ``nn.Dropout`` in the reference: multiplies by a recorded (scaled) mask."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


def record_dropout_masks(model: nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks that record each Dropout's scaled mask (output / input) of the next call.

    Inputs to Dropout must be nonzero almost surely (e.g. after tanh) for the ratio to be the mask.
    """
    masks: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):

            def hook(mod, args, out, name=name):
                masks[name] = (out / args[0]).detach()

            handles.append(module.register_forward_hook(hook))
    return masks, handles


def per_sample_reference(
    model: nn.Module,
    per_example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    dropout_masks: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, d) gradients of each example's own loss, trainable params in named_parameters order.

    ``per_example_loss(out, y)`` returns (B,) losses; example i's term is evaluated on a batch
    of one. Dropout modules named in ``dropout_masks`` are replaced by their recorded masks.
    """
    reference = copy.deepcopy(model)
    batched: dict[str, torch.Tensor] = {}
    for name, mask in (dropout_masks or {}).items():
        parent_name, _, child = name.rpartition(".")
        parent = reference.get_submodule(parent_name) if parent_name else reference
        setattr(parent, child, FixedMask())
        batched[f"{name}.mask"] = mask.unsqueeze(1)  # (B, 1, ...): one example per vmap slice
    trainable = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in reference.named_parameters() if not p.requires_grad}
    buffers = {n: b for n, b in reference.named_buffers() if n not in batched}

    def loss_of_one(params, x, y, masks):
        state = {**params, **fixed, **buffers, **masks}
        out = functional_call(reference, state, (x.unsqueeze(0),))
        return per_example_loss(out, y.unsqueeze(0))[0]

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0, 0))(trainable, inputs, targets, batched)
    return torch.cat([g.reshape(inputs.shape[0], -1) for g in grads.values()], dim=1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual.to(expected.dtype) - expected).abs().max() / scale)


def assert_matches_reference(stats: PerSampleStats, reference: torch.Tensor, seed: int = 0):
    """Every read of ``stats`` against the dense (B, d) reference, relative error <= 1e-6."""
    gen = torch.Generator().manual_seed(seed)
    b, d = reference.shape
    batch = stats.gradient_batch()
    assert (batch.size, batch.dim) == (b, d)
    checks = {
        "norms_squared": (stats.norms_squared(), (reference * reference).sum(1)),
        "gram": (stats.gram(), reference @ reference.T),
        "total": (batch.total(), reference.sum(0)),
    }
    vectors = torch.randn(3, d, generator=gen, dtype=reference.dtype)
    weights = torch.randn(b, 2, generator=gen, dtype=reference.dtype)
    checks["dot (k, d)"] = (batch.dot(vectors), reference @ vectors.T)
    checks["dot (d,)"] = (batch.dot(vectors[0]), reference @ vectors[0])
    checks["weighted_sum (B, k)"] = (batch.weighted_sum(weights), weights.T @ reference)
    checks["weighted_sum (B,)"] = (batch.weighted_sum(weights[:, 0]), reference.T @ weights[:, 0])
    signs = torch.where(weights[:, 0] > 0, 1.0, -1.0).to(reference.dtype)
    checks["weighted_sum, signs"] = (batch.weighted_sum(signs), reference.T @ signs)
    two = torch.where(weights[:, 1] > 0.5, 0.25, -2.0).to(reference.dtype)
    checks["weighted_sum, two values"] = (batch.weighted_sum(two), reference.T @ two)
    named = _split(vectors[1], stats.param_shapes)
    checks["dot {name: tensor}"] = (stats.dot(named), reference @ vectors[1])
    summed = stats.weighted_sum(weights[:, 1])
    flat = torch.cat([summed[name].reshape(-1) for name in stats.param_shapes])
    checks["weighted_sum -> dict"] = (flat, weights[:, 1] @ reference)
    for what, (actual, expected) in checks.items():
        assert actual.shape == expected.shape, what
        err = relative_error(actual, expected)
        assert err <= RELATIVE_TOLERANCE, f"{what}: relative error {err:.3g}"


def _split(flat: torch.Tensor, shapes) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset : offset + n].reshape(shape)
        offset += n
    return out


@pytest.fixture
def float64():
    """Run the test with float64 as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def reference_tools():
    """The reference helpers, as a namespace."""

    class Tools:
        per_sample = staticmethod(per_sample_reference)
        record_dropout_masks = staticmethod(record_dropout_masks)
        assert_matches = staticmethod(assert_matches_reference)
        relative_error = staticmethod(relative_error)

    return Tools
