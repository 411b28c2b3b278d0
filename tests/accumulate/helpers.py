"""Small float64 models and data for the accumulation tests, with slow obvious references."""

from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def make_microbatches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64),
        )
        for n in sizes
    ]


def mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over examples of the per-example squared error."""
    return (model(x) - y).square().sum(dim=1).mean()


def full_batch_gradient(model: nn.Module, batches) -> list[torch.Tensor]:
    """Gradient of the mean loss over every example of ``batches`` at once (the reference)."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    grads = torch.autograd.grad(mean_loss(model, x, y), list(model.parameters()))
    return [g.detach().clone() for g in grads]


def capture_applied_gradients(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Record the ``.grad`` of every parameter each time ``optimizer`` (the inner one) steps."""
    applied: list[list[torch.Tensor]] = []

    def hook(opt, args, kwargs):
        applied.append(
            [
                None if p.grad is None else p.grad.detach().clone()
                for group in opt.param_groups
                for p in group["params"]
            ]
        )

    optimizer.register_step_pre_hook(hook)
    return applied
