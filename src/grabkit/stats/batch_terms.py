"""Loss terms that are legitimately not a sum over examples, declared so the engine leaves them out.

An L2 penalty in the loss, an auxiliary loss on shared parameters, a load-balancing term over a
batch statistic: their gradient belongs to no example. Declared with
``loss = per_example_loss + stats.batch_term(term)``, the engine takes the term's gradient once,
by ``torch.autograd.grad(term, ..., retain_graph=True)`` (with respect to the trainable
parameters and to the outputs of this step's layer calls, where the layer hooks would otherwise
see it), and subtracts it, times whatever multiplies the term in the backward (a GradScaler's
scale, a weight), from the step's factors and batch gradients. So every g_i is the gradient of
example i's own loss, ``total()`` is their sum, and the identity check holds. The multiplier is
read in the backward itself: the returned term passes through an identity whose backward notes
the gradient arriving at it (zero if the term never reaches the backward).

Cost: one extra backward through the term's own graph (for a penalty on the weights, a few
elementwise ops per parameter), at the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BatchTerm", "gate"]


@dataclass
class BatchTerm:
    """One declared term of a step: its gradients, and the multiplier the backward applied."""

    param_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    call_grads: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(call) -> (call, grad)
    gradient_sides: dict[str, torch.Tensor] = field(default_factory=dict)
    multiplier: torch.Tensor | None = None

    def scaled(self, value: torch.Tensor) -> torch.Tensor | None:
        """``multiplier * value``, or None when the term did not reach the backward."""
        if self.multiplier is None:
            return None
        return value * self.multiplier.to(value.dtype)


class _Gate(torch.autograd.Function):
    """Identity on the term; its backward notes the gradient that reached the term."""

    @staticmethod
    def forward(ctx: Any, term: torch.Tensor, record: BatchTerm) -> torch.Tensor:
        ctx.record = record
        return term.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        record: BatchTerm = ctx.record
        grad_value = grad.detach()
        record.multiplier = (
            grad_value if record.multiplier is None else record.multiplier + grad_value
        )
        return grad, None


def gate(term: torch.Tensor, record: BatchTerm) -> torch.Tensor:
    """``term`` itself, passed through the identity that notes its multiplier in the backward."""
    return _Gate.apply(term, record)
