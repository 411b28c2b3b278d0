"""The NTK family: orders from the kernel K = F F^T of per-example features or gradients.

* ``ntk-fixed``: balance the rows of K offline for ``num_rounds`` rounds, then keep that order;
* ``ntk-fixed-eigen``: sort by an extreme eigenvector of K, computed once;
* ``ntk-eigen``: the same, recomputed every epoch from the gradients observed in that epoch.

K is n x n (float64), so these are for small or medium datasets; a ResourceWarning states the
size when it is large. The precomputed matrix is ``ntk_features`` (n, p), e.g. flattened
per-example gradients at initialisation (or their random projection), or ``ntk_kernel`` (n, n).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grabkit.order.balance import SignRule, run_recursion
from grabkit.order.orderings.base import (
    FrontBackOrder,
    Ordering,
    register_ordering,
)
from grabkit.order.orderings.store import StoredGradientOrdering, warn_memory
from grabkit.validation import check_positive_int

__all__ = ["NTKEigen", "NTKFixedBalance", "NTKFixedEigen", "balance_kernel_rows", "eigen_order"]


def kernel_from(
    n: int, name: str, features: torch.Tensor | None, kernel: torch.Tensor | None
) -> torch.Tensor | None:
    """The (n, n) float64 kernel from ``ntk_features`` or ``ntk_kernel`` (at most one)."""
    if features is not None and kernel is not None:
        raise ValueError(f'balance_type="{name}": pass ntk_features or ntk_kernel, not both.')
    warn_memory(
        f'balance_type="{name}" builds an ({n}, {n}) float64 kernel matrix that',
        8 * n * n,
        "Use it on a subset, or choose a streaming ordering such as 'mean' or 'pair'.",
    )
    if features is not None:
        F = torch.as_tensor(features).to(torch.float64).reshape(len(features), -1).cpu()
        if F.shape[0] != n:
            raise ValueError(
                f"`ntk_features` should have one row per example ({n}), but has shape "
                f"{tuple(F.shape)}."
            )
        return _finite(F, "ntk_features") @ F.T
    if kernel is not None:
        K = torch.as_tensor(kernel).to(torch.float64).cpu()
        if K.shape != (n, n):
            raise ValueError(
                f"`ntk_kernel` should have shape ({n}, {n}), but has shape {tuple(K.shape)}."
            )
        return (_finite(K, "ntk_kernel") + K.T) / 2
    return None


def _finite(matrix: torch.Tensor, name: str) -> torch.Tensor:
    """``matrix``, after checking that it holds no NaN or Inf (an order made from them would be
    arbitrary, with no error)."""
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(
            f"`{name}` holds NaN or Inf values; pass the finite per-example gradients (or "
            "their kernel) the order should be made from."
        )
    return matrix


def eigen_order(
    K: torch.Tensor,
    *,
    largest_eig: bool = False,
    descending_eig: bool = True,
    abs_eig: bool = False,
) -> torch.Tensor:
    """argsort of the eigenvector of K for its smallest (or largest) eigenvalue."""
    _, vectors = torch.linalg.eigh(K)
    v = vectors[:, -1 if largest_eig else 0]
    v = v * torch.sign(v.sum()) if v.sum() != 0 else v  # fix the eigenvector's sign
    if abs_eig:
        v = v.abs()
    return torch.argsort(v, descending=descending_eig, stable=True)


def balance_kernel_rows(K: torch.Tensor, rounds: int) -> torch.Tensor:
    """Mean-balance the rows of K (offline, exact mean) for ``rounds`` epochs from 0..n-1."""
    Z = K - K.mean(dim=0)
    G = (Z @ Z.T).numpy()
    order = torch.arange(K.shape[0])
    rule = SignRule()
    for _ in range(rounds):
        o = order.numpy()
        signs, _, _ = run_recursion(np.zeros((len(o), 1)), G[np.ix_(o, o)], rule)
        placement = FrontBackOrder()
        placement.place(o.tolist(), signs[:, 0])
        order = placement.build(order)
    return order


def _missing(name: str) -> ValueError:
    return ValueError(
        f'balance_type="{name}" orders by a precomputed kernel: pass ntk_features=(n, p) tensor '
        "(e.g. flattened per-example gradients) or ntk_kernel=(n, n) tensor to GraBSampler."
    )


class _PrecomputedOrder(Ordering):
    """An order computed once from the kernel (``self.order``) and visited every epoch."""

    uses_gradients = False
    order: torch.Tensor

    def initial_order(self, epoch: int) -> torch.Tensor:
        return self.order.clone()

    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        return self.order.clone()


@register_ordering
class NTKFixedBalance(_PrecomputedOrder):
    """``ntk-fixed``: one order from balancing the kernel's rows, used every epoch."""

    name = "ntk-fixed"

    def __init__(
        self,
        n: int,
        *,
        ntk_features: torch.Tensor | None = None,
        ntk_kernel: torch.Tensor | None = None,
        num_rounds: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__(n, **kwargs)
        K = kernel_from(n, self.name, ntk_features, ntk_kernel)
        if K is None:
            raise _missing(self.name)
        self.order = balance_kernel_rows(K, check_positive_int("num_rounds", num_rounds))


@register_ordering
class NTKFixedEigen(_PrecomputedOrder):
    """``ntk-fixed-eigen``: sort by the eigenvector of the smallest (``largest_eig=False``)
    eigenvalue, descending (``descending_eig=True``), optionally of its absolute values."""

    name = "ntk-fixed-eigen"

    def __init__(
        self,
        n: int,
        *,
        ntk_features: torch.Tensor | None = None,
        ntk_kernel: torch.Tensor | None = None,
        largest_eig: bool = False,
        descending_eig: bool = True,
        abs_eig: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(n, **kwargs)
        K = kernel_from(n, self.name, ntk_features, ntk_kernel)
        if K is None:
            raise _missing(self.name)
        self.order = eigen_order(
            K, largest_eig=largest_eig, descending_eig=descending_eig, abs_eig=abs_eig
        )


@register_ordering
class NTKEigen(StoredGradientOrdering):
    """``ntk-eigen``: like ``ntk-fixed-eigen``, with K rebuilt every epoch from the gradients
    observed in it (kept densely: n x d, warned about when large). The first epoch uses
    ``ntk_features``/``ntk_kernel`` when given, else the usual first order. Examples not
    observed follow at the end in their previous order."""

    name = "ntk-eigen"

    def __init__(
        self,
        n: int,
        *,
        ntk_features: torch.Tensor | None = None,
        ntk_kernel: torch.Tensor | None = None,
        largest_eig: bool = False,
        descending_eig: bool = True,
        abs_eig: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(n, **kwargs)
        self.options = {
            "largest_eig": largest_eig,
            "descending_eig": descending_eig,
            "abs_eig": abs_eig,
        }
        K = kernel_from(n, self.name, ntk_features, ntk_kernel)
        self.first = None if K is None else eigen_order(K, **self.options)

    def initial_order(self, epoch: int) -> torch.Tensor:
        return super().initial_order(epoch) if self.first is None else self.first.clone()

    def rank(self, rows: torch.Tensor) -> torch.Tensor:
        F = rows.to(torch.float64)
        return eigen_order(F @ F.T, **self.options)
