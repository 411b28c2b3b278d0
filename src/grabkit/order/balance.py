"""The batched sign recursion at the heart of every GraB balancer.

Herding decides one sign per vector: with s the running signed sum and z the next vector,

* deterministic rule: eps = +1 if <s, z> < 0 else -1  (the greedy choice ||s + eps z|| minimal;
  a tie, such as the first vector of an epoch, goes to -1 as in grab-sampler, whose orders
  grabkit reproduces exactly);
* probabilistic rule (the self-balancing walk): eps = +1 with probability 1/2 - <s, z> / (2c).

Done naively that is one device round trip per example. Here a batch costs one: for a batch of
balance vectors z_k = sum_i W[k, i] x_i - sum_f U[k, f] v_f (x_i the B per-example gradients,
v_f a few fixed vectors such as a stale mean), everything the recursion needs is a handful of
inner products,

    <s_j, z_k>   from  X S^T and V S^T,        <z_k, z_l>  from  X X^T, X V^T and V V^T,

which ``fetch_inner_products`` moves to the host in ONE transfer. The recursion then runs on
float64 scalars (``run_recursion``: one vectorised row product per decision, no loop over B^2
scalars), and the accumulators move by one ``weighted_sum`` (``apply_update``). Because
s_k = s_0 + sum_{l<k} eps_l z_l, the value <s_k, z_k> = <s_0, z_k> + sum_{l<k} eps_l <z_l, z_k>
is exactly what a sequential loop computes, so the decisions are those of the sequential rule.

On the CPU there is no host synchronisation to save, and the B x B Gram matrix costs B/2 times
the work of the sequential loop; dense CPU batches therefore run the same algebra on blocks of a
few rows (``BlockPolicy``: at most ``rows`` rows and about ``max_bytes`` of X, an explicit
argument), the running sums moving between blocks: the same decisions for a fraction of the
arithmetic, each block read from memory once (``balance_combinations``, below).

Several accumulators are supported at once (the nodes of a recursive-balance tree): a decision
at node j updates only s_j, and with ``depth > 0`` every vector walks from the root to a leaf,
going to the left child on +1 and to the right child on -1.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.stats.transfer import to_device, to_host
from grabkit.validation import check_bool, check_positive

__all__ = [
    "DEFAULT_POLICY",
    "BlockPolicy",
    "FixedGram",
    "HostProducts",
    "SignRule",
    "apply_update",
    "balance_combinations",
    "balance_dense_vectors",
    "epoch_generator",
    "fetch_inner_products",
    "run_recursion",
]

#: the walk's uniforms are drawn from the generator this many at a time
UNIFORM_BLOCK = 256


@dataclass(frozen=True)
class BlockPolicy:
    """How dense CPU batches are cut into blocks: tuning only, the decisions never change.

    Attributes:
        rows: at most this many rows of X per block; 0 sends dense CPU batches through the
            one-transfer path like device batches.
        max_bytes: ... and at most about this many bytes of X per block (at least one row): a
            block, the running sums and the fixed vectors then stay in a typical last-level
            cache while the block is used. For long gradients this means one vector per block,
            which needs no Gram matrix at all (a Gram of a few rows with a long inner dimension
            runs far below the arithmetic peak).
        observe_rows: the sampler hands an ordering at most this many rows at a time, for the
            orderings whose decisions do not depend on how a visit sequence is cut, so the
            host transfer of a (B, B) Gram matrix stays small.
        one_gram_macs: ``balance_dense_vectors`` takes all k vectors of a batch (k pair
            differences of d numbers) at once when their Gram matrix costs at most this many
            multiply-adds (k^2 d): short rows, such as (B, k) sketches, where the Python of a
            block costs more than the Gram's extra arithmetic. 0 always cuts blocks.
    """

    rows: int = 16
    max_bytes: int = 4 << 20
    observe_rows: int = 1024
    one_gram_macs: int = 1 << 21

    def block_rows(self, row_bytes: int) -> int:
        """How many vectors of ``row_bytes`` bytes a dense CPU block takes (at least one)."""
        return max(1, min(self.rows, self.max_bytes // row_bytes))

    def one_gram(self, count: int, dim: int) -> bool:
        """Whether ``count`` dense CPU vectors of ``dim`` numbers are balanced in one piece: one
        (count, count) Gram matrix, one host copy, one update (``balance_dense_vectors``)."""
        return self.rows > 0 and count * count * dim <= self.one_gram_macs

    def vector_rows(self, count: int, dim: int, element_size: int) -> int:
        """How many of ``count`` vectors of ``dim`` numbers ``balance_dense_vectors`` asks for
        at once (what a scratch buffer for them must hold)."""
        return count if self.one_gram(count, dim) else self.block_rows(dim * element_size)


DEFAULT_POLICY = BlockPolicy()

NON_FINITE_HELP = (
    "step() received per-example gradients containing NaN or Inf, so no balancing decision can "
    "be made for this batch (nothing changed). Fix the source of the non-finite values (lower "
    "the learning rate, clip gradients, check the loss for log(0) or division by zero), or skip "
    "the batch: call sampler.skip(len(batch)) (in hook mode or on a GraBBatchSampler, "
    "sampler.skip()), or pass the dataset indices of the next batch you step, "
    "step(grads, indices=idx). Just leaving out step() would give the next batch's gradients to "
    "the skipped examples."
)


class SignRule(Stateful):
    """Deterministic or probabilistic sign choice, with its random stream and scale estimate.

    Args:
        probabilistic: use the self-balancing walk instead of the greedy sign.
        c: the walk's constant. A positive number is used as given (grab-sampler fixes 30). ``None``
            or ``"auto"`` is scale-aware: c is the largest |<s, z>| met so far in the epoch (the
            current decision included), the smallest c that keeps every probability in [0, 1].
            Scaling all gradients by a factor a scales <s, z> and c alike by a^2, so the walk
            behaves the same at every gradient scale (a fixed c turns it into a fair coin for
            small gradients and into the greedy rule for large ones).
    """

    def __init__(self, probabilistic: bool = False, c: float | str | None = None) -> None:
        self.probabilistic = check_bool("prob_balance", probabilistic)
        auto = c is None or (isinstance(c, str) and c == "auto")
        self.c: float | None = None if auto else check_positive("prob_balance_c", c)
        self._saved: dict | None = None  # state_dict() until the state next changes
        # for the scale-aware c: max |<s, z>| in this epoch
        self.add_state("largest_seen", 0.0, load=float)
        self.add_state(
            "generator", torch.Generator().manual_seed(0), save=torch.Generator.get_state,
            load=_generator_with,
        )  # fmt: skip
        pool = torch.empty(0, dtype=torch.float64)  # drawn, not yet used
        self.add_state("pool", pool, save=torch.Tensor.clone, load=_float64_copy)

    def start_epoch(self, seed: int, epoch: int) -> None:
        """Reseed the walk's random stream from (seed, epoch) and reset the scale estimate."""
        self.generator.manual_seed(_mix(seed, epoch, 0x5EED))
        self.pool = torch.empty(0, dtype=torch.float64)
        self.largest_seen = 0.0
        self._saved = None

    def uniforms(self, count: int) -> np.ndarray | None:
        """``count`` U[0, 1) draws for the next decisions (None for the deterministic rule).

        Draws come from the generator in fixed blocks of ``UNIFORM_BLOCK``, so the k-th decision
        of an epoch always gets the k-th number, however the epoch is cut into batches.
        """
        if not self.probabilistic:
            return None
        self._saved = None
        while self.pool.numel() < count:
            block = torch.rand(UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64)
            self.pool = torch.cat([self.pool, block])
        taken, self.pool = self.pool[:count], self.pool[count:]
        return taken.numpy()

    def decide(self, value: float, uniform: float | None) -> float:
        """The sign (+1.0 / -1.0) for a vector z with <s, z> = ``value``."""
        if not self.probabilistic:
            return 1.0 if value < 0.0 else -1.0  # grab-sampler's convention: ties -> -1
        if self.c is None:
            self.largest_seen = max(self.largest_seen, abs(value))
            self._saved = None
            c = self.largest_seen
        else:
            c = self.c
        p_plus = 0.5 if c == 0.0 else min(1.0, max(0.0, 0.5 - value / (2.0 * c)))
        return 1.0 if uniform < p_plus else -1.0

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the rule's state (the same object until the state next changes: the
        sampler publishes it after every step, and the deterministic rule changes only when an
        epoch starts)."""
        if self._saved is None:
            self._saved = super().state_dict()
        return self._saved

    def after_load(self) -> None:
        self._saved = None


def _generator_with(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _float64_copy(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64).clone()


def _mix(*parts: int) -> int:
    """A 63-bit seed from a few integers (deterministic, platform independent)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def epoch_generator(seed: int, epoch: int, purpose: int) -> torch.Generator:
    """A CPU generator determined by (seed, epoch, purpose): orders need no saved RNG state."""
    return torch.Generator().manual_seed(_mix(seed, epoch, purpose))


@dataclass
class HostProducts:
    """Inner products of one batch on the host, in float64.

    Attributes:
        gram: (B, B) <x_i, x_j>, or None when not requested.
        xv: (B, m) <x_i, v_j> for the m vectors passed to ``fetch_inner_products``.
        fv: (f, m) <v_i, v_j> for the last f of them (the fixed vectors) against all m; products
            between running sums are never needed, so never computed.
    """

    gram: np.ndarray | None
    xv: np.ndarray
    fv: np.ndarray


class FixedGram:
    """F F^T of fixed vectors that stay the same over many batches, formed once.

    A stale mean is fixed for a whole epoch, yet each batch needs <m, m>: one more read of all
    d numbers per batch (a GEMV as long as the model) for the same value. Called with the (f, d)
    fixed vectors as ``fetch_inner_products`` sees them, it returns (f, f) ``F @ F.T``, the very
    product computed there, recomputed unless F views the same living tensor as last time with
    the same storage, version counter (no in-place change since), shape, strides, dtype and
    device. That tensor is held weakly: a rolled centre is freed as before, and a new tensor
    is never taken for the old one, even at the old one's address. Not state: a loaded centre
    is a new tensor, hence recomputed.
    """

    def __init__(self) -> None:
        self._owner: weakref.ref[torch.Tensor] | None = None
        self._key: tuple[Any, ...] | None = None
        self._gram: torch.Tensor | None = None

    def __call__(self, fixed: torch.Tensor) -> torch.Tensor:
        """(f, f) ``fixed @ fixed.T`` for (f, d) ``fixed``."""
        owner = fixed if fixed._base is None else fixed._base  # views are made per batch
        key = (
            fixed.data_ptr(), fixed._version, fixed.shape, fixed.stride(), fixed.dtype,
            fixed.device,
        )  # fmt: skip
        held = None if self._owner is None else self._owner()
        if self._gram is None or held is not owner or key != self._key:
            self._owner, self._key, self._gram = weakref.ref(owner), key, fixed @ fixed.T
        return self._gram


def fetch_inner_products(
    batch: GradientBatch,
    vectors: torch.Tensor | None,
    *,
    num_fixed: int = 0,
    need_gram: bool = True,
    fixed: torch.Tensor | None = None,
    fixed_gram: FixedGram | None = None,
) -> HostProducts:
    """Compute X X^T, X V^T and F V^T on the batch's device and move them to the host at once.

    Args:
        batch: B per-example gradients.
        vectors: (m, d) running sums followed by ``num_fixed`` fixed vectors F, or None (m = 0).
        need_gram: skip X X^T when the caller decides signs without it.
        fixed: (f, d) fixed vectors given apart from the running sums in ``vectors`` (then
            ``num_fixed`` is ignored): V = [vectors; fixed] is never stacked into one tensor, which
            saves a copy the size of the model where ``batch`` reads each vector separately anyway
            (hook statistics).
        fixed_gram: with ``fixed``, where F F^T comes from (``FixedGram``: formed once for a
            centre that stays the same over many batches); None forms it here.
    Raises:
        ValueError: when any product is NaN or Inf (a non-finite gradient).
    """
    B = batch.size
    parts: list[torch.Tensor] = []
    if need_gram:
        parts.append(batch.gram().reshape(-1))
    groups = [to_device(g.to(batch.dtype), batch.device) for g in (vectors, fixed) if g is not None]
    m = sum(g.shape[0] for g in groups)
    f = fixed.shape[0] if fixed is not None else (num_fixed if m else 0)
    if m:
        dots = [batch.dot(g).reshape(B, -1) for g in groups]
        xv = dots[0] if len(dots) == 1 else torch.cat(dots, dim=1)  # (B, m)
        parts.append(xv.reshape(-1))
        if f:
            tail = groups[-1][-f:]  # the fixed vectors come last
            products = [tail @ g.T for g in groups[:-1]]
            reused = fixed is not None and fixed_gram is not None
            products.append(fixed_gram(tail) if reused else tail @ groups[-1].T)
            parts.append(torch.cat(products, dim=1).reshape(-1))  # (f, m)
    else:
        # the norms still reveal a non-finite gradient when nothing else is requested
        parts.append(batch.norms_squared().reshape(-1))
    flat = batch.to_host(_float64_concatenated(parts))  # the one host sync
    if not np.isfinite(flat).all():
        raise ValueError(NON_FINITE_HELP)
    offset = 0
    gram = None
    if need_gram:
        gram = flat[: B * B].reshape(B, B)
        offset = B * B
    if m:
        xv = flat[offset : offset + B * m].reshape(B, m)
        fv = flat[offset + B * m : offset + B * m + f * m].reshape(f, m)
    else:
        xv, fv = np.zeros((B, 0)), np.zeros((0, 0))
    return HostProducts(gram=gram, xv=xv, fv=fv)


def _float64_concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """A new tensor: the 1-D ``parts`` one after another in float64 (exact: widened), cast
    once when they share a dtype."""
    if len({p.dtype for p in parts}) == 1:
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined.to(torch.float64, copy=joined is parts[0])
    return torch.cat([p.to(torch.float64) for p in parts])


def run_recursion(
    values: np.ndarray,
    kernel: np.ndarray | None,
    rule: SignRule,
    *,
    depth: int = 0,
    uniforms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decide the signs of k vectors against one or a tree of accumulators, on host scalars.

    Args:
        values: (k, r) <s_j, z_i> for every accumulator j at the start of the batch; r = 1 for
            flat balancing, r = 2^(depth+1) - 1 tree nodes in heap layout otherwise.
        kernel: (k, k) <z_i, z_l>; None decides every sign against the start-of-batch sums
            (the "batch" ordering: parallel decisions).
        rule: the sign rule (its random draws come from ``uniforms``).
        depth: 0 for flat balancing; else each vector makes depth + 1 decisions, root to leaf.
        uniforms: (k * (depth + 1),) draws for the probabilistic rule, in decision order.
    Returns:
        signs (k, depth + 1), leaves (k,) the node index where each vector ended,
        coef (r, k): coef[j, i] = the sign with which z_i enters accumulator j (0 if it does not).
    """
    k, r = values.shape
    if depth == 0 and r == 1 and kernel is not None:
        return _run_flat_recursion(values[:, 0], kernel, rule, uniforms)
    levels = depth + 1
    signs = np.zeros((k, levels))
    leaves = np.zeros(k, dtype=np.int64)
    coef = np.zeros((r, k))
    decision = 0
    for i in range(k):
        node = 0
        for level in range(levels):
            v = values[i, node]
            if kernel is not None and i:
                v += coef[node, :i] @ kernel[:i, i]
            u = None if uniforms is None else uniforms[decision]
            eps = rule.decide(float(v), u)
            decision += 1
            signs[i, level] = eps
            coef[node, i] = eps
            leaves[i] = node
            if level < depth:
                node = 2 * node + 1 if eps > 0 else 2 * node + 2
    return signs, leaves, coef


def _run_flat_recursion(
    values: np.ndarray, kernel: np.ndarray, rule: SignRule, uniforms: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``run_recursion`` for one accumulator.

    ``pending[l]`` is <s, z_l> with every decision so far folded in: deciding z_i adds
    eps_i <z_i, z_l> to each later entry (one vectorised row update, in the same order as a
    scalar loop, so the same floating-point numbers), and each decision reads one ready number.
    A sign is +1 or -1, so the update adds or subtracts the row in place (no product, no
    temporary: the same numbers, since x + (-y) is x - y in floating point).
    """
    k = values.shape[0]
    pending = np.array(values, dtype=np.float64)
    draws = [None] * k if uniforms is None else uniforms.tolist()
    decide = rule.decide
    chosen = []
    for i in range(k):
        eps = decide(pending.item(i), draws[i])
        chosen.append(eps)
        if i + 1 < k:
            later = pending[i + 1 :]
            (np.add if eps > 0 else np.subtract)(later, kernel[i, i + 1 :], out=later)
    signs = np.array(chosen, dtype=np.float64).reshape(k, 1)
    return signs, np.zeros(k, dtype=np.int64), signs.T.copy()


def apply_update(
    accumulators: torch.Tensor,
    batch: GradientBatch,
    x_weights: np.ndarray,
    fixed: torch.Tensor | None = None,
    fixed_weights: np.ndarray | None = None,
) -> None:
    """In place: accumulators (r, d) += (combination of the batch) + fixed_weights @ fixed.

    Args:
        accumulators: (r, d) running sums.
        x_weights: (B, r): column j holds the coefficient of each x_i in the change of s_j.
        fixed: (f, d) fixed vectors (e.g. the centre), with fixed_weights (r, f).
    """
    host = torch.from_numpy(np.ascontiguousarray(x_weights)).to(batch.dtype)  # (B, r)
    w = to_device(host, batch.device)
    if (
        accumulators.is_contiguous()
        and accumulators.dtype == batch.dtype
        and accumulators.device == batch.device
    ):  # hook statistics: no (r, d) temporary, and the weights read on the host, not the device
        batch.add_weighted_sum_to(accumulators, w, host=host)
    else:
        accumulators += batch.weighted_sum(w).to(accumulators.dtype).reshape(accumulators.shape)
    if fixed is not None and fixed_weights is not None and fixed_weights.size:
        fw = torch.from_numpy(np.ascontiguousarray(fixed_weights)).to(accumulators.dtype)
        fw = to_device(fw, accumulators.device)
        accumulators.addmm_(fw, fixed.to(accumulators.dtype).reshape(fw.shape[1], -1))


def _dense_on_cpu(batch: GradientBatch, accumulators: torch.Tensor) -> bool:
    return (
        batch.coordinates() is not None
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
    fixed_gram: FixedGram | None = None,
    depth: int = 0,
    sequential: bool = True,
    on_accept: Callable[[torch.Tensor | None], None] | None = None,
    policy: BlockPolicy = DEFAULT_POLICY,
) -> tuple[np.ndarray, np.ndarray]:
    """Balance z_k = sum_i W[k, i] x_i - sum_f U[k, f] v_f against ``accumulators``.

    Device batches and hook statistics: one host transfer for the whole batch. Dense CPU
    batches have no transfer to save, and there the (B, B) Gram matrix would cost B/2 times the
    sequential loop's arithmetic, so their vectors are taken a few rows at a time
    (``policy.block_rows``: many for short gradients, one for long ones), each block reading only
    its own rows of X and seeing the sums left by the blocks before it: the same decisions for a
    fraction of the work.

    Args:
        batch: B per-example gradients x_i.
        accumulators: (r, d) running signed sums, updated in place (r = 1, or a heap-ordered tree
            of 2^(depth+1) - 1 nodes).
        weights: W (k, B); None means the identity (z_i = x_i - ...). Each row's nonzeros must
            lie at or after those of the row before (true of every balancer here).
        fixed: (f, d) fixed vectors v_f (a centre, a carried-over example), with U (k, f) in
            ``fixed_weights``.
        fixed_gram: the caller's ``FixedGram`` for ``fixed`` when it stays the same over many
            batches (a stale mean): hook statistics then read it once, not every batch.
        depth: tree depth of ``run_recursion`` (0: flat).
        sequential: False decides every sign against the start-of-batch sums ("batch" ordering).
        on_accept: ``on_accept(total)`` runs once the whole batch was checked finite, before
            the sums move, so that a rejected batch leaves every piece of state untouched.
            ``total`` is the (d,) sum of the batch's rows where the dense CPU path formed it
            on the way (while each block is in cache), else None: the consumer takes the sum
            from ``batch`` as it likes (``batch.add_total_to`` forms none for hook statistics).
        policy: the dense CPU block shape (``BlockPolicy``); ``rows=0`` takes the one-transfer
            path as device batches do. The decisions do not depend on it.
    Returns:
        signs (k, depth + 1) and leaves (k,), as ``run_recursion`` returns them.
    """
    k = batch.size if weights is None else weights.shape[0]
    U = np.zeros((k, 0 if fixed is None else fixed.shape[0]))
    if fixed_weights is not None:
        U = fixed_weights
    if not (sequential and policy.rows > 0 and _dense_on_cpu(batch, accumulators)):
        if batch.coordinates() is not None:  # one pass over X for all the vectors
            products = fetch_inner_products(
                batch, _stack(accumulators, fixed), num_fixed=U.shape[1], need_gram=sequential
            )
        else:  # hook statistics read each vector apart: stacking them would only copy
            products = fetch_inner_products(
                batch, accumulators, fixed=fixed, need_gram=sequential, fixed_gram=fixed_gram
            )
        if on_accept is not None:
            on_accept(None)
        return _decide_and_update(batch, products, accumulators, rule, weights, fixed, U, depth)
    X = batch.coordinates()
    return _DenseCpuBalance(
        lambda lo, hi: X[lo:hi], X.shape, accumulators, rule, weights, fixed, U, depth,
        on_accept, policy,
    ).run()  # fmt: skip


def balance_dense_vectors(
    vectors: Callable[[int, int], torch.Tensor],
    count: int,
    accumulators: torch.Tensor,
    rule: SignRule,
    policy: BlockPolicy = DEFAULT_POLICY,
    *,
    read: Callable[[torch.Tensor], np.ndarray] = to_host,
) -> np.ndarray:
    """Balance ``count`` vectors made block by block against one running sum, on the CPU.

    Args:
        vectors: ``vectors(lo, hi)`` returns z_lo .. z_(hi-1) as a (hi - lo, d) CPU tensor of the
            accumulators' dtype, valid until the next call (it may reuse one scratch buffer).
            Blocks hold ``policy.block_rows(row bytes)`` vectors, so a scratch buffer of that many
            rows is enough; vectors formed one block at a time stay in cache while they are used.
        accumulators: (1, d) running signed sum, updated in place once all blocks were finite.
        read: reads the one-Gram path's products to the host (the batch's ``to_host``, so a
            check pending on the batch is compared in the same read).
    Returns:
        signs (count,).

    When ``policy.one_gram(count, d)`` the vectors come in one piece (``policy.vector_rows``):
    their (count, count) Gram matrix and their products with the sum go to the host as one
    copy, the signs are decided there, and the sum moves by one update.
    """
    d = accumulators.shape[1]
    if policy.one_gram(count, d):
        return _balance_with_one_gram(vectors(0, count), accumulators, rule, read)
    shape = (count, d)
    zero = np.zeros((count, 0))
    balancer = _DenseCpuBalance(
        vectors, shape, accumulators, rule, None, None, zero, 0, None, policy
    )
    signs, _ = balancer.run()
    return signs[:, 0]


def _balance_with_one_gram(
    Z: torch.Tensor,
    accumulators: torch.Tensor,
    rule: SignRule,
    read: Callable[[torch.Tensor], np.ndarray],
) -> np.ndarray:
    """Signs (k,) of the (k, d) CPU vectors ``Z`` against the (1, d) running sum, which moves by
    sum_i eps_i z_i once every product was found finite."""
    columns = Z.T
    products = read(torch.cat([accumulators @ columns, Z @ columns]))  # (1 + k, k)
    if not np.isfinite(products).all():
        raise ValueError(NON_FINITE_HELP)
    uniforms = rule.uniforms(Z.shape[0])
    signs, _, coef = _run_flat_recursion(products[0], products[1:], rule, uniforms)
    accumulators.addmm_(torch.from_numpy(coef).to(accumulators.dtype), Z)
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


class _DenseCpuBalance:
    """``balance_combinations`` for a dense (B, d) CPU matrix X, a few rows of X at a time.

    ``rows(lo, hi)`` returns X[lo:hi] (or vectors formed on demand, ``balance_dense_vectors``);
    ``shape`` is (B, d).

    The running sums and fixed vectors live in one (r + f, d) scratch matrix V, so each block of
    rows X_b costs one product X_b V^T (read from memory once), its small Gram X_b X_b^T and one
    in-place update of the sums, all three while X_b is still in cache. The fixed vectors' share
    of the sums (s_j = s'_j + sum_f D[j, f] v_f) is added once per batch, not once per block: the
    blocks only add rows of X to s', <x_i, s_j> = <x_i, s'_j> + D <x_i, v_f> comes from the same
    product, and <v_f, s_j> is carried on the host (it changes by known combinations of
    <x_i, v_f> and <v_f, v_g>). Blocks hold at most ``policy.rows`` rows and about
    ``policy.max_bytes`` of X: few Python calls for short gradients, no Gram-dominated
    arithmetic for long ones. ``weights=None`` (z_i = x_i - ...) skips every product with W.
    The accumulators and the rule change only once every block was found finite.
    """

    def __init__(
        self,
        rows: Callable[[int, int], torch.Tensor],
        shape: tuple[int, int],
        accumulators: torch.Tensor,
        rule: SignRule,
        weights: np.ndarray | None,
        fixed: torch.Tensor | None,
        U: np.ndarray,
        depth: int,
        on_accept: Callable[[torch.Tensor | None], None] | None,
        policy: BlockPolicy,
    ) -> None:
        self.rows, self.accumulators, self.rule = rows, accumulators, rule
        self.weights, self.U, self.depth, self.on_accept = weights, U, depth, on_accept
        self.r, self.f = accumulators.shape[0], U.shape[1]
        self.B, d = shape
        self.dtype = accumulators.dtype
        max_rows = policy.block_rows(max(d * accumulators.element_size(), 1))
        if weights is None:
            self.blocks = [
                (k0, min(k0 + max_rows, self.B)) * 2 for k0 in range(0, self.B, max_rows)
            ]
        else:
            self.blocks = _vector_blocks(weights, max_rows)
        # scratch rows: [batch total (when asked for); running sums; fixed vectors]
        self.t = 0 if on_accept is None else 1
        self.scratch = torch.empty(self.t + self.r + self.f, d, dtype=self.dtype)
        self.scratch[: self.t].zero_()
        self.scratch[self.t :].copy_(_stack(accumulators, fixed))
        self.V = self.scratch[self.t :]  # what the rows meet
        self.updated = self.scratch[: self.t + self.r]  # what they change
        self.summed = np.zeros(self.B, dtype=bool)  # rows already in the total
        # the fixed vectors' share of each sum is added once at the end: sums hold s - deferred F
        self.deferred = np.zeros((self.r, self.f))
        self.fs = self.ff = np.zeros((0, 0))

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        self._check_unused_rows()
        if self.f:
            ff = (self.V[self.r :] @ self.V.T).double().numpy()  # (f, r + f)
            if not np.isfinite(ff).all():
                raise ValueError(NON_FINITE_HELP)
            self.fs, self.ff = ff[:, : self.r].copy(), ff[:, self.r :]  # <v_f, s_j>, <v_f, v_g>
        saved_rule = self.rule.state_dict() if self.rule.probabilistic else None
        signs, leaves = [], []
        try:
            for block in self.blocks:
                s, leaf = self._block(*block)
                signs.append(s)
                leaves.append(leaf)
        except ValueError:
            if saved_rule is not None:
                self.rule.load_state_dict(saved_rule)
            raise
        self._commit()
        return np.concatenate(signs), np.concatenate(leaves)

    def _check_unused_rows(self) -> None:
        if self.weights is None:
            return
        unused = np.flatnonzero(np.abs(self.weights).sum(axis=0) == 0)  # e.g. an odd one out
        if unused.size and not all(bool(torch.isfinite(self.rows(i, i + 1)).all()) for i in unused):
            raise ValueError(NON_FINITE_HELP)

    def _block(self, k0: int, k1: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        r, f = self.r, self.f
        Xb = self.rows(lo, hi)
        xv = (self.V @ Xb.T).double().numpy().T  # (b, r + f): <x_i, s_j>, <x_i, v_f>
        # one vector needs no Gram: a NaN or Inf in x_i already shows in <x_i, s_j>
        gram = (Xb @ Xb.T).double().numpy() if k1 - k0 > 1 else np.zeros((hi - lo,) * 2)
        if not (np.isfinite(xv).all() and np.isfinite(gram).all()):
            raise ValueError(NON_FINITE_HELP)
        Wb = None if self.weights is None else self.weights[k0:k1, lo:hi]
        xs = xv[:, :r] + xv[:, r:] @ self.deferred.T if f else xv[:, :r]  # <x_i, s_j>
        values = xs if Wb is None else Wb @ xs  # (k, r): <s_j, z_k>
        kernel = gram if Wb is None else Wb @ gram @ Wb.T  # (k, k): <z_k, z_l>
        if f:
            Ub = self.U[k0:k1]
            xf = xv[:, r:]
            wxf_u = (xf if Wb is None else Wb @ xf) @ Ub.T
            values = values - Ub @ self.fs
            kernel = kernel - wxf_u - wxf_u.T + Ub @ self.ff @ Ub.T
        uniforms = self.rule.uniforms((k1 - k0) * (self.depth + 1))
        s, leaf, coef = run_recursion(
            values, kernel, self.rule, depth=self.depth, uniforms=uniforms
        )
        x_coef = coef if Wb is None else coef @ Wb  # (r, b): the change of each s_j
        change = x_coef
        if self.t:  # the total takes each row once, when a block first covers it
            fresh = ~self.summed[lo:hi]
            self.summed[lo:hi] = True
            change = np.concatenate([fresh[None, :].astype(np.float64), x_coef])
        self.updated.addmm_(torch.from_numpy(change).to(self.dtype), Xb)
        if f:
            f_coef = -(coef @ Ub)  # (r, f)
            self.deferred += f_coef
            self.fs += (x_coef @ xf + f_coef @ self.ff).T
        return s, leaf

    def _commit(self) -> None:
        if self.t:
            for i in np.flatnonzero(~self.summed).tolist():  # rows no vector used
                self.scratch[0] += self.rows(i, i + 1)[0]
            self.on_accept(self.scratch[0])
        sums = self.V[: self.r]
        if self.f:
            sums.addmm_(torch.from_numpy(self.deferred).to(self.dtype), self.V[self.r :])
        self.accumulators.copy_(sums)


def _stack(accumulators: torch.Tensor, fixed: torch.Tensor | None) -> torch.Tensor:
    return accumulators if fixed is None else torch.cat([accumulators, fixed.to(accumulators)])


def _decide_and_update(
    batch: GradientBatch,
    products: HostProducts,
    accumulators: torch.Tensor,
    rule: SignRule,
    W: np.ndarray | None,
    fixed: torch.Tensor | None,
    U: np.ndarray,
    depth: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The host half of a balancing step: products -> signs, then one update of the sums.

    ``W`` None is the identity, and a ``U`` with no columns means no fixed vectors: their
    products are left out rather than multiplied by ones and zeros (the same numbers).
    """
    r = accumulators.shape[0]
    xs = products.xv[:, :r]
    values = xs if W is None else W @ xs  # (k, r): <s_j, z_k>
    kernel = None  # (k, k): <z_k, z_l>
    if products.gram is not None:
        kernel = products.gram if W is None else W @ products.gram @ W.T
    if U.shape[1]:
        xf, fs, ff = products.xv[:, r:], products.fv[:, :r], products.fv[:, r:]
        values = values - U @ fs
        if kernel is not None:
            wxf_u = (xf if W is None else W @ xf) @ U.T
            kernel = kernel - wxf_u - wxf_u.T + U @ ff @ U.T
    uniforms = rule.uniforms(U.shape[0] * (depth + 1))
    signs, leaves, coef = run_recursion(values, kernel, rule, depth=depth, uniforms=uniforms)
    x_weights = coef.T if W is None else (coef @ W).T
    apply_update(accumulators, batch, x_weights, fixed, -(coef @ U) if U.shape[1] else None)
    return signs, leaves
