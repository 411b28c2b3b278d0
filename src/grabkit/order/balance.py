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
few rows (at most ``CPU_BLOCK_ROWS`` rows and about ``CPU_BLOCK_BYTES`` of X), the running sums
moving between blocks: the same decisions for a fraction of the arithmetic, each block read from
memory once (``grabkit.order.orderings.base.balance_combinations``).

Several accumulators are supported at once (the nodes of a recursive-balance tree): a decision
at node j updates only s_j, and with ``depth > 0`` every vector walks from the root to a leaf,
going to the left child on +1 and to the right child on -1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from grabkit.stats.gradient_batch import GradientBatch

__all__ = [
    "CPU_BLOCK_BYTES",
    "CPU_BLOCK_ROWS",
    "HostProducts",
    "SignRule",
    "apply_update",
    "epoch_generator",
    "fetch_inner_products",
    "run_recursion",
]

#: the walk's uniforms are drawn from the generator this many at a time
UNIFORM_BLOCK = 256

#: dense CPU batches are balanced at most this many rows of X at a time; 0 sends them through
#: the one-transfer path like device batches
CPU_BLOCK_ROWS = 16

#: ... and at most about this many bytes of X at a time (at least one row): a block, the running
#: sums and the fixed vectors then stay in a typical last-level cache while the block is used. For
#: long gradients this means one vector per block, which needs no Gram matrix at all (a Gram of
#: a few rows with a long inner dimension runs far below the arithmetic peak)
CPU_BLOCK_BYTES = 4 << 20

NON_FINITE_HELP = (
    "step() received per-example gradients containing NaN or Inf, so no balancing decision can "
    "be made for this batch (nothing changed). Fix the source of the non-finite values (lower "
    "the learning rate, clip gradients, check the loss for log(0) or division by zero), or skip "
    "the batch: call sampler.skip(len(batch)) (in hook mode or on a GraBBatchSampler, "
    "sampler.skip()), or pass the dataset indices of the next batch you step, "
    "step(grads, indices=idx). Just leaving out step() would give the next batch's gradients to "
    "the skipped examples."
)


class SignRule:
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
        if not isinstance(probabilistic, bool):
            raise TypeError(f"`prob_balance` should be a bool, but got {probabilistic!r}")
        if c is None or c == "auto":
            self.c: float | None = None
        elif isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0:
            self.c = float(c)
        else:
            raise ValueError(
                "`prob_balance_c` should be a positive number or 'auto', but got "
                f"prob_balance_c={c!r}"
            )
        self.probabilistic = probabilistic
        self.largest_seen = 0.0  # for the scale-aware c: max |<s, z>| in this epoch
        self.generator = torch.Generator().manual_seed(0)
        self.pool = torch.empty(0, dtype=torch.float64)  # drawn, not yet used

    def start_epoch(self, seed: int, epoch: int) -> None:
        """Reseed the walk's random stream from (seed, epoch) and reset the scale estimate."""
        self.generator.manual_seed(_mix(seed, epoch, 0x5EED))
        self.pool = torch.empty(0, dtype=torch.float64)
        self.largest_seen = 0.0

    def uniforms(self, count: int) -> np.ndarray | None:
        """``count`` U[0, 1) draws for the next decisions (None for the deterministic rule).

        Draws come from the generator in fixed blocks of ``UNIFORM_BLOCK``, so the k-th decision
        of an epoch always gets the k-th number, however the epoch is cut into batches.
        """
        if not self.probabilistic:
            return None
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
            c = self.largest_seen
        else:
            c = self.c
        p_plus = 0.5 if c == 0.0 else min(1.0, max(0.0, 0.5 - value / (2.0 * c)))
        return 1.0 if uniform < p_plus else -1.0

    def state_dict(self) -> dict:
        return {
            "largest_seen": self.largest_seen,
            "generator": self.generator.get_state(),
            "pool": self.pool.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.largest_seen = float(state["largest_seen"])
        self.generator.set_state(state["generator"])
        self.pool = state["pool"].to(torch.float64).clone()


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


def fetch_inner_products(
    batch: GradientBatch,
    vectors: torch.Tensor | None,
    *,
    num_fixed: int = 0,
    need_gram: bool = True,
    fixed: torch.Tensor | None = None,
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
    Raises:
        ValueError: when any product is NaN or Inf (a non-finite gradient).
    """
    B = batch.size
    parts: list[torch.Tensor] = []
    if need_gram:
        parts.append(batch.gram().reshape(-1))
    groups = [
        g.to(device=batch.device, dtype=batch.dtype) for g in (vectors, fixed) if g is not None
    ]
    m = sum(g.shape[0] for g in groups)
    f = fixed.shape[0] if fixed is not None else (num_fixed if m else 0)
    if m:
        xv = torch.cat([batch.dot(g).reshape(B, -1) for g in groups], dim=1)  # (B, m)
        parts.append(xv.reshape(-1))
        if f:
            tail = groups[-1][-f:]  # the fixed vectors come last
            parts.append(torch.cat([tail @ g.T for g in groups], dim=1).reshape(-1))  # (f, m)
    else:
        # the norms still reveal a non-finite gradient when nothing else is requested
        parts.append(batch.norms_squared().reshape(-1))
    flat = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()  # the one host sync
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
    """``run_recursion`` for one accumulator, on Python floats (blocks are small on the CPU).

    ``pending[l]`` is <s, z_l> with every decision so far folded in: deciding z_i adds
    eps_i <z_i, z_l> to each later entry, so each decision reads one ready number.
    """
    k = values.shape[0]
    pending = values.tolist()
    rows = kernel.tolist()
    draws = [None] * k if uniforms is None else uniforms.tolist()
    chosen = []
    for i in range(k):
        eps = rule.decide(pending[i], draws[i])
        chosen.append(eps)
        row = rows[i]
        for l in range(i + 1, k):
            pending[l] += eps * row[l]
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
    w = torch.from_numpy(np.ascontiguousarray(x_weights)).to(batch.device, batch.dtype)
    add_to = getattr(batch, "add_weighted_sum_to", None)  # hook statistics: no (r, d) temporary
    if (
        add_to is not None
        and accumulators.is_contiguous()
        and accumulators.dtype == batch.dtype
        and accumulators.device == batch.device
    ):
        add_to(accumulators, w)
    else:
        accumulators += batch.weighted_sum(w).to(accumulators.dtype).reshape(accumulators.shape)
    if fixed is not None and fixed_weights is not None and fixed_weights.size:
        fw = torch.from_numpy(np.ascontiguousarray(fixed_weights)).to(
            accumulators.device, accumulators.dtype
        )
        accumulators.addmm_(fw, fixed.to(accumulators.dtype).reshape(fw.shape[1], -1))
