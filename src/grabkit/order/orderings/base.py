"""What every ordering shares: the ``Ordering`` interface, the front/back order builder, and the
one-call balancing of linear combinations of a batch against running sums.

An ordering sees an epoch as a sequence of ``observe(batch, indices)`` calls (per-example gradients
in visit order, with their dataset indices) and turns it into the next epoch's order in
``finish_epoch``. It only ever reads gradients through the ``GradientBatch`` protocol, so an
ordering that needs only inner products runs unchanged on hook statistics; those that need the
coordinates themselves set ``needs_coordinates``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

import grabkit.order.balance as balance_module
from grabkit.order.balance import (
    NON_FINITE_HELP,
    HostProducts,
    SignRule,
    apply_update,
    epoch_generator,
    fetch_inner_products,
    run_recursion,
)
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch

__all__ = [
    "ORDERINGS",
    "PURPOSE_FIRST_EPOCH",
    "PURPOSE_RESHUFFLE",
    "PURPOSE_SHUFFLE_ONCE",
    "PURPOSE_WITH_REPLACEMENT",
    "FrontBackOrder",
    "Ordering",
    "balance_combinations",
    "balance_dense_vectors",
    "check_state_keys",
    "cpu_block_rows",
    "random_permutation",
    "register_ordering",
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

    A new ordering is one file: a subclass with a ``name``, its options as keyword-only
    ``__init__`` arguments with defaults (validated there: they are its declaration, read by
    ``option_names``), ``observe`` and ``finish_epoch``, and ``@register_ordering`` on the class.
    ``GraBSampler(ds, balance_type=name, option=...)`` or ``GraBSampler(ds, ordering=instance)``
    then uses it.

    Args:
        n: number of examples.
        seed: all randomness derives from it.
        rule: the sign rule shared by the balancers (default: the deterministic rule).
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
        self,
        n: int,
        *,
        seed: int = 0,
        rule: SignRule | None = None,
        random_first_epoch: bool = True,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"`n` should be a positive integer, but got n={n!r}")
        self.n = n
        self.seed = seed
        self.rule = SignRule() if rule is None else rule
        self.random_first_epoch = random_first_epoch

    def __new__(cls, *args: Any, **kwargs: Any) -> Ordering:
        instance = super().__new__(cls)
        declared = cls.option_names()
        given = {k: v for k, v in kwargs.items() if k in declared}
        instance._options = {**declared, **given}  # as constructed: saved in the configuration
        return instance

    @property
    def option_values(self) -> dict[str, Any]:
        """This ordering's own options, as constructed (defaults filled in)."""
        return dict(self._options)

    @classmethod
    def option_names(cls) -> dict[str, Any]:
        """This ordering's own options and their defaults, read from the ``__init__`` chain."""
        found: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            init = klass.__dict__.get("__init__")
            if klass is Ordering or init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name not in _BASE_OPTIONS:
                    found[p.name] = p.default
        return found

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


_BASE_OPTIONS = ("seed", "rule", "random_first_epoch")

#: balance_type name -> ordering class; ``register_ordering`` adds to it
ORDERINGS: dict[str, type[Ordering]] = {}

_O = TypeVar("_O", bound=type[Ordering])


def register_ordering(cls: _O) -> _O:
    """Class decorator: make ``cls`` available as ``GraBSampler(balance_type=cls.name)``."""
    if not (isinstance(cls, type) and issubclass(cls, Ordering)):
        raise TypeError(f"register_ordering expects an Ordering subclass, but got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name` (its balance_type)")
    if ORDERINGS.get(name, cls) is not cls:
        raise ValueError(
            f"balance_type {name!r} is already registered by {ORDERINGS[name].__name__}; "
            "choose another name."
        )
    ORDERINGS[name] = cls
    return cls


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
        and accumulators.dtype == batch.dtype
    )


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
    before_update: Callable[[torch.Tensor], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Balance z_k = sum_i W[k, i] x_i - sum_f U[k, f] v_f against ``accumulators``.

    Device batches and hook statistics: one host transfer for the whole batch. Dense CPU
    batches have no transfer to save, and there the (B, B) Gram matrix would cost B/2 times the
    sequential loop's arithmetic, so their vectors are taken a few rows at a time
    (``cpu_block_rows``: many for short gradients, one for long ones), each block reading only its
    own rows of X and seeing the sums left by the blocks before it: the same decisions for a
    fraction of the work.

    Args:
        batch: B per-example gradients x_i.
        accumulators: (r, d) running signed sums, updated in place (r = 1, or a heap-ordered tree
            of 2^(depth+1) - 1 nodes).
        weights: W (k, B); None means the identity (z_i = x_i - ...). Each row's nonzeros must
            lie at or after those of the row before (true of every balancer here).
        fixed: (f, d) fixed vectors v_f (a centre, a carried-over example), with U (k, f) in
            ``fixed_weights``.
        depth: tree depth of ``run_recursion`` (0: flat).
        sequential: False decides every sign against the start-of-batch sums ("batch" ordering).
        before_update: ``before_update(total)`` runs once the whole batch was checked finite, so
            that a rejected batch leaves every piece of state untouched; total (d,) is the sum of
            the batch's rows (formed while each block is in cache on the dense CPU path).
    Returns:
        signs (k, depth + 1) and leaves (k,), as ``run_recursion`` returns them.
    """
    W = np.eye(batch.size) if weights is None else weights
    U = np.zeros((W.shape[0], 0 if fixed is None else fixed.shape[0]))
    if fixed_weights is not None:
        U = fixed_weights
    block = balance_module.CPU_BLOCK_ROWS
    if not (sequential and block > 0 and _dense_on_cpu(batch, accumulators)):
        if isinstance(batch, DenseGradientBatch):  # one pass over X for all the vectors
            products = fetch_inner_products(
                batch, _stack(accumulators, fixed), num_fixed=U.shape[1], need_gram=sequential
            )
        else:  # hook statistics read each vector apart: stacking them would only copy
            products = fetch_inner_products(batch, accumulators, fixed=fixed, need_gram=sequential)
        if before_update is not None:
            before_update(batch.total())
        return _decide_and_update(batch, products, accumulators, rule, W, fixed, U, depth)
    X = batch.matrix
    return _balance_dense_cpu(
        lambda lo, hi: X[lo:hi], X.shape, accumulators, rule, weights, fixed, U, depth,
        before_update,
    )  # fmt: skip


def cpu_block_rows(row_bytes: int) -> int:
    """How many vectors of ``row_bytes`` bytes a dense CPU block takes (at least one)."""
    return max(1, min(balance_module.CPU_BLOCK_ROWS, balance_module.CPU_BLOCK_BYTES // row_bytes))


def balance_dense_vectors(
    vectors: Callable[[int, int], torch.Tensor],
    count: int,
    accumulators: torch.Tensor,
    rule: SignRule,
) -> np.ndarray:
    """Balance ``count`` vectors made block by block against one running sum, on the CPU.

    Args:
        vectors: ``vectors(lo, hi)`` returns z_lo .. z_(hi-1) as a (hi - lo, d) CPU tensor of the
            accumulators' dtype, valid until the next call (it may reuse one scratch buffer).
            Blocks hold ``cpu_block_rows`` vectors, so a scratch buffer of that many rows is
            enough; vectors formed one block at a time stay in cache while they are used.
        accumulators: (1, d) running signed sum, updated in place once all blocks were finite.
    Returns:
        signs (count,).
    """
    shape = (count, accumulators.shape[1])
    zero = np.zeros((count, 0))
    signs, _ = _balance_dense_cpu(vectors, shape, accumulators, rule, None, None, zero, 0, None)
    return signs[:, 0]


def _vector_blocks(W: np.ndarray, max_rows: int) -> list[tuple[int, int, int, int]]:
    """Cut the balance vectors (rows of W) into consecutive blocks spanning <= max_rows rows of X.

    Returns (k0, k1, lo, hi) per block: vectors k0..k1-1 read only rows lo..hi-1 of X. A vector
    whose own span exceeds ``max_rows`` gets a block to itself; a vector with no nonzero weight
    joins the block being built.
    """
    nonzero = W != 0
    has_any = nonzero.any(axis=1)
    first = np.where(has_any, nonzero.argmax(axis=1), -1).tolist()
    last = np.where(has_any, W.shape[1] - 1 - nonzero[:, ::-1].argmax(axis=1), -1).tolist()
    blocks: list[tuple[int, int, int, int]] = []
    k0, lo, hi = 0, -1, -1
    for k in range(W.shape[0]):
        if first[k] < 0:
            continue
        if lo >= 0 and last[k] + 1 - lo > max_rows:
            blocks.append((k0, k, lo, hi))
            k0, lo = k, -1
        lo = first[k] if lo < 0 else min(lo, first[k])
        hi = max(hi, last[k] + 1)
    if W.shape[0] > k0:
        blocks.append((k0, W.shape[0], max(lo, 0), max(hi, 0)))
    return blocks


def _balance_dense_cpu(
    rows: Callable[[int, int], torch.Tensor],
    shape: tuple[int, int],
    accumulators: torch.Tensor,
    rule: SignRule,
    weights: np.ndarray | None,
    fixed: torch.Tensor | None,
    U: np.ndarray,
    depth: int,
    before_update: Callable[[torch.Tensor], None] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``balance_combinations`` for a dense (B, d) CPU matrix X, a few rows of X at a time.

    ``rows(lo, hi)`` returns X[lo:hi] (or vectors formed on demand, ``balance_dense_vectors``);
    ``shape`` is (B, d).

    The running sums and fixed vectors live in one (r + f, d) scratch matrix V, so each block of
    rows X_b costs one product X_b V^T (read from memory once), its small Gram X_b X_b^T and one
    in-place update of the sums, all three while X_b is still in cache. The fixed vectors' share
    of the sums (s_j = s'_j + sum_f D[j, f] v_f) is added once per batch, not once per block: the
    blocks only add rows of X to s', <x_i, s_j> = <x_i, s'_j> + D <x_i, v_f> comes from the same
    product, and <v_f, s_j> is carried on the host (it changes by known combinations of
    <x_i, v_f> and <v_f, v_g>). Blocks hold at most
    ``CPU_BLOCK_ROWS`` rows and about ``CPU_BLOCK_BYTES`` of X: few Python calls for short
    gradients, no Gram-dominated arithmetic for long ones. ``weights=None`` (z_i = x_i - ...)
    skips every product with W. The accumulators and the rule change only once every block was
    found finite.
    """
    r, f = accumulators.shape[0], U.shape[1]
    B, d = shape
    dtype = accumulators.dtype
    max_rows = cpu_block_rows(max(d * accumulators.element_size(), 1))
    if weights is None:
        blocks = [(k0, min(k0 + max_rows, B)) * 2 for k0 in range(0, B, max_rows)]
    else:
        blocks = _vector_blocks(weights, max_rows)
        unused = np.flatnonzero(np.abs(weights).sum(axis=0) == 0)  # e.g. an odd one out
        if unused.size and not all(bool(torch.isfinite(rows(i, i + 1)).all()) for i in unused):
            raise ValueError(NON_FINITE_HELP)
    # scratch rows: [batch total (when asked for); running sums; fixed vectors]
    t = 0 if before_update is None else 1
    scratch = torch.empty(t + r + f, d, dtype=dtype)
    scratch[:t].zero_()
    scratch[t:].copy_(_stack(accumulators, fixed))
    V, updated = scratch[t:], scratch[: t + r]  # what the rows meet; what they change
    sums, fixed_rows = V[:r], V[r:]
    summed = np.zeros(B, dtype=bool)  # rows already in the total
    if f:
        ff = (fixed_rows @ V.T).double().numpy()  # (f, r + f)
        if not np.isfinite(ff).all():
            raise ValueError(NON_FINITE_HELP)
        fs, ff = ff[:, :r].copy(), ff[:, r:]  # <v_f, s_j> (tracked), <v_f, v_g>
    # the fixed vectors' share of each sum is added once at the end: sums holds s - deferred @ F
    deferred = np.zeros((r, f))
    saved_rule = rule.state_dict() if rule.probabilistic else None
    signs, leaves = [], []
    try:
        for k0, k1, lo, hi in blocks:
            Xb = rows(lo, hi)
            xv = (V @ Xb.T).double().numpy().T  # (b, r + f): <x_i, s_j>, <x_i, v_f>
            # one vector needs no Gram: a NaN or Inf in x_i already shows in <x_i, s_j>
            gram = (Xb @ Xb.T).double().numpy() if k1 - k0 > 1 else np.zeros((hi - lo,) * 2)
            if not (np.isfinite(xv).all() and np.isfinite(gram).all()):
                raise ValueError(NON_FINITE_HELP)
            Wb = None if weights is None else weights[k0:k1, lo:hi]
            xs = xv[:, :r] + xv[:, r:] @ deferred.T if f else xv[:, :r]  # <x_i, s_j>
            values = xs if Wb is None else Wb @ xs  # (k, r): <s_j, z_k>
            kernel = gram if Wb is None else Wb @ gram @ Wb.T  # (k, k): <z_k, z_l>
            if f:
                Ub = U[k0:k1]
                xf = xv[:, r:]
                wxf_u = (xf if Wb is None else Wb @ xf) @ Ub.T
                values = values - Ub @ fs
                kernel = kernel - wxf_u - wxf_u.T + Ub @ ff @ Ub.T
            uniforms = rule.uniforms((k1 - k0) * (depth + 1))
            s, leaf, coef = run_recursion(values, kernel, rule, depth=depth, uniforms=uniforms)
            x_coef = coef if Wb is None else coef @ Wb  # (r, b): the change of each s_j
            change = x_coef
            if t:  # the total takes each row once, when a block first covers it
                fresh = ~summed[lo:hi]
                summed[lo:hi] = True
                change = np.concatenate([fresh[None, :].astype(np.float64), x_coef])
            updated.addmm_(torch.from_numpy(change).to(dtype), Xb)
            if f:
                f_coef = -(coef @ Ub)  # (r, f)
                deferred += f_coef
                fs += (x_coef @ xf + f_coef @ ff).T
            signs.append(s)
            leaves.append(leaf)
    except ValueError:
        if saved_rule is not None:
            rule.load_state_dict(saved_rule)
        raise
    if t:
        for i in np.flatnonzero(~summed).tolist():  # rows no vector used
            scratch[0] += rows(i, i + 1)[0]
        before_update(scratch[0])
    if f:
        sums.addmm_(torch.from_numpy(deferred).to(dtype), fixed_rows)
    accumulators.copy_(sums)
    return np.concatenate(signs), np.concatenate(leaves)


def _stack(accumulators: torch.Tensor, fixed: torch.Tensor | None) -> torch.Tensor:
    return accumulators if fixed is None else torch.cat([accumulators, fixed.to(accumulators)])


def _decide_and_update(
    batch: GradientBatch,
    products: HostProducts,
    accumulators: torch.Tensor,
    rule: SignRule,
    W: np.ndarray,
    fixed: torch.Tensor | None,
    U: np.ndarray,
    depth: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The host half of a balancing step: products -> signs, then one update of the sums."""
    r = accumulators.shape[0]
    xs, xf = products.xv[:, :r], products.xv[:, r:]
    fs, ff = products.fv[:, :r], products.fv[:, r:]
    values = W @ xs - U @ fs  # (k, r): <s_j, z_k>
    kernel = None
    if products.gram is not None:
        wxf_u = W @ xf @ U.T
        kernel = W @ products.gram @ W.T - wxf_u - wxf_u.T + U @ ff @ U.T  # (k, k): <z_k, z_l>
    uniforms = rule.uniforms(W.shape[0] * (depth + 1))
    signs, leaves, coef = run_recursion(values, kernel, rule, depth=depth, uniforms=uniforms)
    apply_update(accumulators, batch, (coef @ W).T, fixed, -(coef @ U) if U.shape[1] else None)
    return signs, leaves
