"""Naming the parameter blocks an estimator reports on: one block per parameter tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["named_trainable_parameters"]

ParamsLike = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_trainable_parameters(params: ParamsLike, where: str) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` of the tensors that require gradients, in a stable order.

    Accepts a module (its ``named_parameters()``), an iterable of ``(name, tensor)`` pairs, or an
    iterable of tensors (named ``"0"``, ``"1"``, ...). ``where`` names the caller for errors.
    """
    if isinstance(params, nn.Module):
        items = list(params.named_parameters())
    elif isinstance(params, torch.Tensor):
        items = [("0", params)]
    else:
        items = []
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                items.append((str(item[0]), item[1]))
            elif isinstance(item, torch.Tensor):
                items.append((str(i), item))
            else:
                raise TypeError(
                    f"{where} expects a module, tensors or (name, tensor) pairs, but item {i} "
                    f"is {type(item).__name__}"
                )
    items = [(name, p) for name, p in items if p.requires_grad]
    if not items:
        raise ValueError(f"{where} got no tensor that requires grad; pass the model's parameters")
    return items
