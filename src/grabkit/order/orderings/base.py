"""What every ordering shares: the ``Ordering`` interface, the front/back order builder, and the
one-call balancing of linear combinations of a batch against running sums.

An ordering sees an epoch as a sequence of ``observe(batch, indices)`` calls (per-example gradients
in visit order, with their dataset indices) and turns it into the next epoch's order in
``finish_epoch``. It only ever reads gradients through the ``GradientBatch`` protocol, so an
ordering that needs only inner products runs unchanged on hook statistics; those that need the
coordinates themselves set ``needs_coordinates``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

import grabkit.order.balance as balance_module
from grabkit.order.balance import (
    NON_FINITE_HELP,
    SignRule,
    apply_update,
    balance_dense_blocks,
    epoch_generator,
    fetch_inner_products,
    run_recursion,
)
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch

__all__ = [
    "PURPOSE_FIRST_EPOCH",
    "PURPOSE_RESHUFFLE",
    "PURPOSE_SHUFFLE_ONCE",
    "PURPOSE_WITH_REPLACEMENT",
    "FrontBackOrder",
    "Ordering",
    "balance_combinations",
    "check_state_keys",
    "random_permutation",
]

# purposes for epoch_generator, so that two random streams never coincide
PURPOSE_FIRST_EPOCH = 1
PURPOSE_RESHUFFLE = 2
PURPOSE_SHUFFLE_ONCE = 3
PURPOSE_WITH_REPLACEMENT = 4


def random_permutation(n: int, seed: int, epoch: int, purpose: int) -> torch.Tensor:
    """A (n,) int64 permutation determined by (seed, epoch, purpose)."""
    return torch.randperm(n, generator=epoch_generator(seed, epoch, purpose))


def check_state_keys(where: str, state: dict, expected: set[str]) -> None:
    """Reject a state dict whose keys differ from ``expected``, naming the difference."""
    unknown, missing = set(state) - expected, expected - set(state)
    if unknown or missing:
        raise ValueError(
            f"{where}: state dict does not match this ordering (unexpected keys "
            f"{sorted(unknown)}, missing keys {sorted(missing)}); it was saved by a sampler "
            "with a different balance_type or configuration."
        )


class Ordering(ABC):
    """One example-ordering policy over a dataset of n examples.

    Args:
        n: number of examples.
        seed: all randomness derives from it.
        rule: the sign rule shared by the balancers.
        random_first_epoch: first epoch in a random order (else 0..n-1).
    """

    name: ClassVar[str]
    #: False for orderings that ignore gradients (step() is then free)
    uses_gradients: ClassVar[bool] = True
    #: True when the ordering needs a dense (B, d) batch, not only inner products
    needs_coordinates: ClassVar[bool] = False
    #: True when observing a batch equals observing its rows in consecutive pieces
    splittable: ClassVar[bool] = False

    def __init__(
        self, n: int, *, seed: int, rule: SignRule, random_first_epoch: bool = True
    ) -> None:
        self.n = n
        self.seed = seed
        self.rule = rule
        self.random_first_epoch = random_first_epoch

    def initial_order(self, epoch: int) -> torch.Tensor:
        """The order of the first epoch, numbered ``epoch``."""
        if self.random_first_epoch:
            return random_permutation(self.n, self.seed, epoch, PURPOSE_FIRST_EPOCH)
        return torch.arange(self.n)

    def renumber(self, epoch: int, order: torch.Tensor) -> torch.Tensor:
        """The order of a not-yet-started epoch after ``set_epoch`` changed its number."""
        return order

    def start_epoch(self, epoch: int) -> None:  # noqa: B027 (optional hook)
        """Called when an epoch begins; balancers reset their running sums here."""

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:  # noqa: B027
        """Take the gradients of the examples ``indices`` (B,), given in visit order."""

    @abstractmethod
    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        """The next epoch's order, from this epoch's ``order`` and what was observed.

        Examples of ``order`` that were never observed (an epoch abandoned part-way, a dropped
        last batch) keep their relative order; where they go is up to the ordering.
        """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(self.name, state, set())


class FrontBackOrder:
    """The GraB placement: +1 examples to the front in visit order, -1 examples to the back in
    reverse visit order, unobserved examples in between in their previous relative order."""

    def __init__(self) -> None:
        self.front: list[int] = []
        self.back: list[int] = []

    def clear(self) -> None:
        self.front.clear()
        self.back.clear()

    def place(self, indices: list[int], signs: np.ndarray) -> None:
        for index, eps in zip(indices, signs.tolist(), strict=True):
            (self.front if eps > 0 else self.back).append(index)

    def build(self, order: torch.Tensor) -> torch.Tensor:
        placed = set(self.front) | set(self.back)
        middle = [i for i in order.tolist() if i not in placed]
        return torch.tensor(self.front + middle + self.back[::-1], dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {
            "front": torch.tensor(self.front, dtype=torch.int64),
            "back": torch.tensor(self.back, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.front = [int(i) for i in state["front"]]
        self.back = [int(i) for i in state["back"]]


def _dense_on_cpu(batch: GradientBatch, accumulators: torch.Tensor) -> bool:
    return (
        isinstance(batch, DenseGradientBatch)
        and batch.device.type == "cpu"
        and accumulators.device.type == "cpu"
    )


def _materialise(
    X: torch.Tensor,
    weights: np.ndarray | None,
    fixed: torch.Tensor | None,
    fixed_weights: np.ndarray | None,
) -> torch.Tensor:
    """Z = W X - U F as a dense (k, d) tensor, after checking X and F are finite."""
    # a sum is NaN or Inf as soon as one entry is (one fast pass, no temporary)
    total = X.sum() if fixed is None else X.sum() + fixed.sum()
    if not bool(torch.isfinite(total)):
        raise ValueError(NON_FINITE_HELP)
    if weights is None:
        Z = X
    else:  # W has a couple of nonzeros per row: gather and add them, nnz * d work
        rows, cols = np.nonzero(weights)
        coefficients = torch.from_numpy(weights[rows, cols]).to(X.dtype)
        Z = X.new_zeros(weights.shape[0], X.shape[1])
        Z.index_add_(0, torch.from_numpy(rows), X[torch.from_numpy(cols)] * coefficients[:, None])
    if fixed is not None and fixed_weights is not None:
        Z = Z - torch.from_numpy(fixed_weights).to(X.dtype) @ fixed.to(X.dtype)
    return Z


def balance_combinations(
    batch: GradientBatch,
    accumulators: torch.Tensor,
    rule: SignRule,
    *,
    weights: np.ndarray | None = None,
    fixed: torch.Tensor | None = None,
    fixed_weights: np.ndarray | None = None,
    depth: int = 0,
    sequential: bool = True,
    before_update: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Balance z_k = sum_i W[k, i] x_i - sum_f U[k, f] v_f against ``accumulators``, one host sync
    (dense CPU batches: in blocks, see ``grabkit.order.balance.balance_dense_blocks``).

    Args:
        batch: B per-example gradients x_i.
        accumulators: (r, d) running signed sums, updated in place (r = 1, or a heap-ordered tree
            of 2^(depth+1) - 1 nodes).
        weights: W (k, B); None means the identity (z_i = x_i - ...).
        fixed: (f, d) fixed vectors v_f (a centre, a carried-over example), with U (k, f) in
            ``fixed_weights``.
        depth: tree depth of ``run_recursion`` (0: flat).
        sequential: False decides every sign against the start-of-batch sums ("batch" ordering).
        before_update: a callable run after the products were checked finite and before anything
            changes, so that a rejected batch leaves every piece of state untouched.
    Returns:
        signs (k, depth + 1) and leaves (k,), as ``run_recursion`` returns them.
    """
    if sequential and _dense_on_cpu(batch, accumulators) and balance_module.CPU_BLOCK_ROWS > 0:
        Z = _materialise(batch.matrix, weights, fixed, fixed_weights)
        if before_update is not None:
            before_update()
        return balance_dense_blocks(
            Z, accumulators, rule, depth=depth, block=balance_module.CPU_BLOCK_ROWS
        )
    r = accumulators.shape[0]
    f = 0 if fixed is None else fixed.shape[0]
    vectors = accumulators if fixed is None else torch.cat([accumulators, fixed.to(accumulators)])
    products = fetch_inner_products(batch, vectors, num_fixed=f, need_gram=sequential)
    if before_update is not None:
        before_update()
    W = np.eye(batch.size) if weights is None else weights
    xs, xf = products.xv[:, :r], products.xv[:, r:]
    fs, ff = products.fv[:, :r], products.fv[:, r:]
    U = np.zeros((W.shape[0], f)) if fixed_weights is None else fixed_weights
    values = W @ xs - U @ fs  # (k, r): <s_j, z_k>
    kernel = None
    if sequential:
        wxf_u = W @ xf @ U.T
        kernel = W @ products.gram @ W.T - wxf_u - wxf_u.T + U @ ff @ U.T  # (k, k): <z_k, z_l>
    uniforms = rule.uniforms(W.shape[0] * (depth + 1))
    signs, leaves, coef = run_recursion(values, kernel, rule, depth=depth, uniforms=uniforms)
    apply_update(accumulators, batch, (coef @ W).T, fixed, -(coef @ U) if f else None)
    return signs, leaves
