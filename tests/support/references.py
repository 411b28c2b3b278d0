"""Slow, obvious references for per-example statistics."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def per_example_rows(
    model: nn.Module, loss_of_example: Callable[[int], torch.Tensor], count: int
) -> torch.Tensor:
    """(count, d): gradient of ``loss_of_example(i)`` over the trainable parameters, one
    ``torch.autograd.grad`` per example, in ``named_parameters`` order (zeros where an example's
    loss does not reach a parameter)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(count):
        grads = torch.autograd.grad(loss_of_example(i), params, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, grads, strict=True)
                ]
            )
        )
    return torch.stack(rows)
