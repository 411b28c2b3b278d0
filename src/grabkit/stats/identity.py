"""The run-time identity check: per-example gradients add up to the gradient autograd delivered.

Whatever the layer rules compute, per parameter and per backward, sum_i g_i (in the factors'
scale) must equal G, the gradient that backward delivered to the parameter (seen by the
engine's hook on the parameter's ``AccumulateGrad`` node: local, before it is added into
``.grad`` and before any DDP all-reduce). A difference means the engine misread the step: a
weight used outside its layer, a loss term that is not a sum over examples, a gradient changed
by a hook, a backward it did not see. The check raises ``IdentityCheckError`` then, naming the
parameters, the size of the difference, the likely causes and the fixes; the statistics are not
returned.

**A random rank-one probe.** Comparing sum_i g_i with G in full costs a weight-gradient GEMM per
layer. Instead each matrix parameter (viewed as rows x cols: ``shape[0]`` by the rest, the view
every factor uses) gets fixed probe vectors a (rows) and b (cols), entries independent and
uniform in [-1, 1], drawn once from a private ``torch.Generator`` (the global RNG is never
touched, so a measurement does not change training). The gradient side a^T G b is computed in
the parameter's hook, while G is hot in cache (sketch mode keeps no copy of G); the factor side
<a b^T, sum_i g_i> = sum over example-positions n of (a . D_n)(b . A_n) is computed at read time
from the factors: O(N (rows + cols)) instead of O(N rows cols). A vector parameter is probed with
a alone. Since the probe's entries are continuous and drawn independently of the data, any
difference on the probed support is detected with probability 1.

**Support.** A matrix of more than ``FULL_SUPPORT_ENTRIES`` (32,768) entries is probed on a
rectangle of that many: a block of consecutive rows times a block of consecutive columns, about 181
x 181 (a side narrower than that whole, the other side widened to match), both moved to a random
place at every checked step (a private ``random.Random``). So the hook reads at most that many
entries of G (a full pass over a large G costs a few percent of a small model's step), and the
factor side reads N (rows + cols) numbers of the layer's output gradients and inputs instead of N
(all rows + all cols) (the output gradients of a language model's head are the largest tensors a
step holds). What that can miss: a difference confined to rows or columns outside this step's
rectangle. A difference spread over the matrix (a penalty, a missing or doubled use, an unseen
backward) is caught at every checked step; one confined to a few rows or columns (an output unit,
an input feature, some vocabulary entries) is caught once the moving rectangle covers it, within
about rows x cols / 32,768 checked steps for a single entry. Vectors (biases, normalisation
parameters) are probed whole, or on the rows of the matrix whose row probe they share.

**Tolerance, derived from the dtype and the reduction lengths.** Both sides evaluate the same
real number S = sum_{n, j, k} a_j D_nj A_nk b_k from the same stored operands, in different
orders; only rounding separates them. Model (Higham & Mary, SIAM J. Sci. Comput. 2019): every
floating-point operation has relative error delta, |delta| <= u, independent and of mean zero.
A term goes through at most m = N + rows + cols rounded additions on either side (the GEMM's sum
over the N example-positions, our products over the probed rows and columns). Each rounding adds
delta times a partial sum; by Azuma-Hoeffding their total is at most lambda u sqrt(sum of squared
partial sums) with probability >= 1 - 2 exp(-lambda^2 / 2). A partial sum over the positions is
at most sum_n |D_nj A_nk| (|a|, |b| <= 1); one over probe-weighted entries, sum_{j in J} a_j x_j,
is at most min(sqrt(|J|), lambda) |x|_2 (Cauchy-Schwarz, or Hoeffding over the probe's independent
bounded entries). Adding up, with R = sum_n |D_n|_2 |A_n|_2 over the probed support:

    |a^T G b - sum_n (a . D_n)(b . A_n)| <= kappa (lambda u sqrt(2 m) + 2 u_low (1 + u_low)^2) R,
    kappa = min(sqrt(rows * cols), lambda^2)  (min(sqrt(n), lambda) for a vector),

with lambda = ``LAMBDA`` = 6 (each tail 2 exp(-18) ~ 3e-8), u the unit roundoff of the
arithmetic (float32: 2^-24, float64: 2^-53) and u_low that of a lower precision the operands or
the delivered gradient were rounded to (bf16 / fp16 activations under autocast; bf16 / fp16
parameters, whose gradients autograd delivers rounded). Those are single roundings, each at most
u_low of its entry, so they need no random tail: an operand rounded by E_n (|E_n| <= u_low |A_n|)
moves G by sum_n D_n E_n^T, and the rounding of G by at most u_low |G| entrywise; both have a
Frobenius norm of at most u_low (1 + u_low)^2 R, and the probe turns a Frobenius norm into at most
kappa times it. Under bf16 that term dominates: the check catches differences of about
kappa u_low R and more, R summing the examples' own gradient norms (a loss term whose gradient
is 2 to 5 times the data's, ``benchmarks/identity_margins.py``), not small ones.

Below a dtype's smallest normal a rounding is absolute, not relative: a float16 gradient entry
under 6.1e-5 (no loss scale: a small model's attention gradients) is off by up to 2^-25 whatever
its size. Each delivered gradient therefore adds ``underflow_rounding(dtype)`` times the number
of probed entries (|a_i b_j| <= 1) to its parameter's bound: about 3e-5 for a 32 x 32 float16
weight, 2^-150 per entry (nothing) for float32. With a GradScaler's scale the gradients are far
above it and the bound is the relative one.

For per-example factors (biases, normalisation layers) the terms are the per-position contributions
their rule summed, whose norms the rule reports (``PerExampleFactor(terms=...)``; without it each
example's row is taken as one term); a normalisation layer's rule recomputes xhat, whose rounding
is relative to (|x| + |mean|) / sqrt(var + eps) rather than to |xhat| (they differ where x - mean
cancels), and reports its terms on that scale. Measured differences sit at most 1/500 of this bound
(training steps of the MLP and the small GPT of the benchmarks, float32), at most 0.135 under bf16
(tiny BERT, GPT-2 and Llama under bf16 autocast, float32 or bf16 parameters); it is not tuned to
anything.

Fast path: R needs row norms (a pass over every factor), so the check first compares against the
same bound with R replaced by L = sum_n |(a . D_n)(b . A_n)| / (|a|_2 |b|_2) <= R (Cauchy-Schwarz;
a moving block's norm taken at its bound sqrt(block), so the constants do not move), computed from
the probe products it formed anyway. Passing it passes the bound; only a parameter
that fails it has R computed, and raises if it fails the bound too.

**A delivered gradient that is not finite** (the weight gradient's GEMM overflowed under fp16
autocast: a GradScaler overflow step, which the scaler skips; a NaN loss) cannot be compared:
that parameter passes, and the statistics pass through as computed (each example's factors may
well be finite), for their consumers to reject or use.

**Schedule.** Checking every step costs a few small tensor operations per parameter: on a
small MLP 12-19% of a plain step on the CPU, on a small GPT 5-6%. By default
(``check_identity=True``) the check is spent where a misread step is likely to first appear:

* every step of the first ``WARMUP_STEPS`` (8) after the engine attaches, and again after every
  change of the step's structure as the engine sees it at the step's first delivered gradient
  (the number of calls of each layer, the functional uses recorded, the batch terms declared,
  a grouped batch) or of the trainable set (a new check);
* after that, each step with probability ``rate() = BUDGET * step time / check time`` (both
  running means of the calling thread's CPU seconds over the checked steps, measured as it
  runs: the check's own code, and the step from its first delivered gradient to the next
  step's, less the check; CPU time, so that other processes on the machine do not move the
  rate; the steps between are not timed), drawn from a private generator, so that
  the checked steps take about ``BUDGET`` (0.3%) of the training step's time: the step with
  the statistics read costs 1.2-2.5x a plain step on the benchmarks, so under 1% of a plain
  step, and with every step's decision (some 30 us in a training loop) 1.5-1.7% of the small
  MLP's plain step and 0.5-1.1% of the small GPT's (``benchmarks/RESULTS.md``); a model whose
  check costs less than that is checked at every step.

A mismatch that persists (a penalty in the loss, a tied weight used outside its layer, a gradient
hook) is caught on the first checked step after it appears: on the benchmarks' small MLP under GraB
about 1 step in 20, on the small GPT about 1 in 12. What the schedule can miss: a mismatch confined
to steps it does not check that changes nothing the engine sees (a loss term added on one step in a
thousand); those steps' statistics are returned unchecked. ``check_identity="always"`` checks every
step, at the cost above.

**The check's limit.** A sum cannot see which row belongs to which example: gradients credited to
the wrong examples (a misattribution) still add up to G and pass. So do per-example gradients of
a loss that couples the examples (a batch-level statistic inside the loss), for the same reason.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from grabkit.stats.factors import (
    EmbeddingFactor,
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    SumFactor,
)
from grabkit.stats.rows import RowsFactor
from grabkit.stats.transfer import NUMPY_DTYPES, to_device, to_host

__all__ = [
    "BUDGET",
    "FULL_SUPPORT_ENTRIES",
    "LAMBDA",
    "WARMUP_STEPS",
    "CheckedReads",
    "IdentityCheck",
    "IdentityCheckError",
    "PendingIdentityCheck",
    "unit_roundoff",
]

#: a matrix with more entries is probed on a moving block of columns (see the module docstring)
FULL_SUPPORT_ENTRIES = 1 << 15

#: the tail constant of the tolerance (see the module docstring)
LAMBDA = 6.0

#: the share of the training step's measured time the checked steps may take (see
#: "Schedule"): a step with statistics read costs up to about 2.5x a plain one on the
#: benchmarks, so this keeps the check under 2% of a plain step, its decisions included
BUDGET = 0.003

#: steps checked in a row after attaching and after every change of the step's structure
WARMUP_STEPS = 8

#: weight of the newest step in the running means of the step's and the check's times
_TIME_WEIGHT = 0.2

_PROBE_DTYPES = (torch.float32, torch.float64)

_CAUSES = (
    "Likely causes and fixes:\n"
    "  * a weight used outside its layer (F.linear(h, layer.weight), x @ W.T, a tied head): "
    "PerSampleStats computes F.linear / F.embedding / matmul uses made inside the model's "
    "forward when it watches it (functional_uses='auto', the default, watches the first step "
    "and keeps watching only if it saw such a use; pass functional_uses=True for a use that "
    "appears later); call the layer as a module for other uses, or register a rule for the "
    "module that makes them;\n"
    "  * a loss term that is not a sum over examples (an L2 penalty in the loss, an auxiliary "
    "loss on shared parameters or batch statistics): declare it, "
    "loss = per_example_loss + stats.batch_term(term), and it is left out of every g_i;\n"
    "  * a gradient hook that changes a parameter's gradient (p.register_hook), or parameters "
    "frozen or unfrozen between the forward and its backward;\n"
    "  * float16 parameters whose gradients underflow (entries below float16's smallest "
    "normal, 6.1e-5, without a loss scale): the delivered gradient lost what the per-example "
    "sum keeps; scale the loss with torch.amp.GradScaler (GraBSampler.step(grad_scale=...) "
    "divides it out) or train in bfloat16;\n"
    "  * a backward the engine did not see whole: a backward through a graph built before the "
    "step's forward, or through a model call made without its hooks.\n"
    "If you know the difference is intended, PerSampleStats(..., check_identity=False) (or "
    "GraBSampler(..., stats_options={'check_identity': False})) skips the check; the statistics "
    "may then silently be those of another loss."
)


class IdentityCheckError(RuntimeError):
    """The per-example gradients do not add up to the gradient autograd delivered."""


@functools.cache
def underflow_rounding(dtype: torch.dtype) -> float:
    """Half the spacing of a floating dtype's subnormals (float16: 2^-25): the absolute error a
    rounding to it may make below its smallest normal, where the relative bound u |x| fails."""
    if not dtype.is_floating_point:
        return 0.0
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


@functools.cache
def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-(mantissa bits + 1) of a floating dtype (float32: 2^-24); 0 for other dtypes."""
    if not dtype.is_floating_point:
        return 0.0
    return torch.finfo(dtype).eps / 2


class _Axis:
    """One side of a probe: a vector of independent entries uniform in [-1, 1] (float64, on the
    CPU), the block of it probed this step, and its copies on the devices and dtypes it met.

    A Linear's weight and bias share their row axis: the output gradients' product with the
    rows' probe then serves both.
    """

    __slots__ = ("_cut", "_masked", "block", "cpu", "moved", "norm", "size", "start")

    def __init__(self, values: torch.Tensor, block: int) -> None:
        self.cpu = values
        self.size = values.numel()
        self.block = block
        self.start = 0
        self.norm = float(values.norm())
        self.moved: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._cut: tuple[tuple, torch.Tensor] | None = None
        self._masked: tuple[tuple, torch.Tensor] | None = None

    @property
    def blocked(self) -> bool:
        return self.block < self.size

    def move(self, start: int) -> None:
        self.start = start
        self._cut = self._masked = None

    def bound(self) -> float:
        """An upper bound of the norm of the probed block whatever its place (|entries| <= 1)."""
        return math.sqrt(self.block) if self.blocked else self.norm

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """The whole vector on ``t``'s device in ``t``'s dtype (moved once)."""
        key = (t.get_device(), t.dtype)
        moved = self.moved.get(key)
        if moved is None:
            moved = self.moved[key] = to_device(self.cpu.to(t.dtype), t.device)
        return moved

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """This step's block, on ``t``'s device and dtype (cut once a step)."""
        if not self.blocked:
            return self.like(t)
        key = (t.get_device(), t.dtype)
        cut = self._cut
        if cut is None or cut[0] != key:
            cut = self._cut = (key, self.like(t).narrow(0, self.start, self.block))
        return cut[1]

    def masked(self, t: torch.Tensor) -> torch.Tensor:
        """The whole vector with zeros outside this step's block (for gathers and groups)."""
        if not self.blocked:
            return self.like(t)
        key = (t.get_device(), t.dtype)
        masked = self._masked
        if masked is None or masked[0] != key:
            values = torch.zeros_like(self.like(t))
            values.narrow(0, self.start, self.block).copy_(self.cut(t))
            masked = self._masked = (key, values)
        return masked[1]

    def narrow(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t`` cut to this step's block along ``dim``."""
        return t.narrow(dim, self.start, self.block) if self.blocked else t


def _support(rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of the probed rectangle of a rows x cols matrix: all of it up to
    ``FULL_SUPPORT_ENTRIES`` entries, else about sqrt of that on each side (fewest reads of the
    factors, N (rows + cols), for that many entries), a side narrower than that whole."""
    if rows * cols <= FULL_SUPPORT_ENTRIES:
        return rows, cols
    side = math.isqrt(FULL_SUPPORT_ENTRIES)
    if rows <= side:
        return rows, max(1, FULL_SUPPORT_ENTRIES // rows)
    if cols <= side:
        return max(1, FULL_SUPPORT_ENTRIES // cols), cols
    return side, side


class _Probe:
    """One parameter's probe: its rows x cols view (a vector: cols = 1), its row and column
    axes, and the constants of its segments, by (kind, number of products)."""

    __slots__ = ("col", "cols", "constants", "row", "rows")

    def __init__(self, shape: torch.Size, gen: torch.Generator, row: _Axis | None) -> None:
        numel = shape.numel()
        self.rows = int(shape[0]) if len(shape) >= 2 else numel
        self.cols = numel // self.rows if len(shape) >= 2 and self.rows else 1
        row_block, col_block = _support(self.rows, self.cols)
        if row is None or row.size != self.rows or self.cols != 1:
            values = torch.rand(self.rows, generator=gen, dtype=torch.float64) * 2 - 1
            row = _Axis(values, row_block if self.cols > 1 else self.rows)
        self.row = row
        column = torch.ones(1, dtype=torch.float64)
        if self.cols > 1:
            column = torch.rand(self.cols, generator=gen, dtype=torch.float64) * 2 - 1
        self.col = _Axis(column, col_block)
        self.constants: dict[tuple[str, int], tuple[float, int, float]] = {}

    @property
    def matrix(self) -> bool:
        return self.cols > 1

    @property
    def entries(self) -> int:
        """The number of entries of G the probe reads in a step (its support)."""
        return self.row.block * (self.col.block if self.matrix else 1)

    def gradient_side(self, grad: torch.Tensor) -> torch.Tensor:
        """a^T G b over this step's support, for a gradient G delivered to the parameter."""
        g = grad.detach() if grad.requires_grad else grad  # (create_graph: no graph for this)
        if g.dtype not in _PROBE_DTYPES:
            g = g.float()  # low-precision gradients are probed in float32
        a = self.row.cut(g)
        if not self.matrix:
            return torch.dot(a, self.row.narrow(g if g.dim() == 1 else g.reshape(-1), 0))
        if g.dim() != 2:
            g = g.reshape(self.rows, self.cols)
        g = self.col.narrow(self.row.narrow(g, 0), 1)
        return torch.dot(a, torch.mv(g, self.col.cut(g)))


class _Segment(NamedTuple):
    """One factor's probe products w_n for one parameter (a tied parameter has several):
    they sum to the factor side; L = scale * sum |w_n| <= R (Cauchy-Schwarz); m the longest
    chain of roundings, kappa the partial-sum factor (see the module docstring)."""

    index: int
    products: torch.Tensor
    scale: float
    length: int
    kappa: float
    magnitude: Callable[[], torch.Tensor]  # R, computed only if the fast path fails


@dataclass
class _Outcome:
    """What the check compared for one parameter (for the error message)."""

    name: str
    factor_side: float
    gradient_side: float
    tolerance: float


class _RunningMean:
    """An exponentially weighted mean of seconds (None until the first value)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        old = self.value
        self.value = seconds if old is None else old + _TIME_WEIGHT * (seconds - old)


class IdentityCheck:
    """The probes of one engine's trainable parameters, the comparison of both sides, and the
    choice of the steps that are checked.

    Args:
        param_shapes: name -> shape of every trainable parameter.
        seed: seeds the private generators (probe entries, block positions, scheduled steps).
        shared_rows: vector parameter -> matrix parameter whose row probe it takes (a Linear's
            bias and weight: the product of the output gradients with that probe serves both).
        every_step: check every step (``check_identity="always"``); otherwise the schedule of
            the module docstring.
        structure: called at a step's first delivered gradient, returns what the engine saw of
            the step so far (its layer calls, its declared batch terms, ...): a step whose
            structure differs from the last one's starts a new run of ``WARMUP_STEPS`` checked
            steps.

    ``begin_step()`` forgets the finished step (at the start of every step);
    ``observe(name, grad)`` adds the gradient side of one delivered gradient (in the parameter's
    hook); ``verify(...)`` compares with the factors and raises ``IdentityCheckError``.
    ``active`` says whether this step is checked (decided at its first delivered gradient); on a
    step that is not, ``observe`` and ``verify`` do nothing.
    """

    def __init__(
        self,
        param_shapes: Mapping[str, torch.Size],
        seed: int = 0,
        shared_rows: Mapping[str, str] | None = None,
        *,
        every_step: bool = True,
        structure: Callable[[], Hashable] | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        shared_rows = shared_rows or {}
        self.names = list(param_shapes)
        self.probes: dict[str, _Probe] = {}
        for name in sorted(param_shapes, key=lambda n: n in shared_rows):  # matrices first
            partner = self.probes.get(shared_rows.get(name, ""))
            row = None if partner is None else partner.row
            self.probes[name] = _Probe(torch.Size(param_shapes[name]), gen, row)
        axes = {id(a): a for p in self.probes.values() for a in (p.row, p.col) if a.blocked}
        self.moving = list(axes.values())  # each once (a shared row axis moves once)
        self._blocks = random.Random(seed)
        self._coefficients: dict[tuple, torch.Tensor] = {}
        self.gradient_sides: dict[str, torch.Tensor] = {}
        self.floors: dict[str, float] = {}  # name -> the delivered gradients' underflow bound
        self.every_step = every_step
        self._structure = structure
        self._draws = random.Random(seed + 1)  # which steps the schedule checks
        self._last_structure: Hashable = None
        self._checked_in_a_row = 0  # checked steps since the structure last changed
        self._active: bool | None = None  # this step checked? (None: not decided yet)
        # running means of a checked step's time without the check, and of the check's time
        self._step_time, self._check_time = _RunningMean(), _RunningMean()
        self._timed_from: float | None = None  # CPU clock at the last checked step's decision
        self._spent = 0.0  # seconds of the current checked step spent in the check's own code
        self.steps = self.checked_steps = 0

    def begin_step(self) -> None:
        self._active = None
        self.gradient_sides = {}
        self.floors = {}

    @property
    def active(self) -> bool:
        """Whether this step is checked (decided once, at its first delivered gradient)."""
        active = self._active
        if active is None:
            active = self._active = self._decide()
            self.steps += 1
            self.checked_steps += active
        return active

    def rate(self) -> float:
        """The share of steps of an unchanged structure the schedule checks: BUDGET times the
        step's time over one check's (1 until both were measured)."""
        step, check = self._step_time.value, self._check_time.value
        if step is None or not check:
            return 1.0
        return min(1.0, BUDGET * step / check)

    def _decide(self) -> bool:
        if self.every_step:
            return True
        now = None
        if self._timed_from is not None:  # the last checked step ends here: one step's time
            now = time.thread_time()
            self._check_time.add(self._spent)
            self._step_time.add(max(0.0, now - self._timed_from - self._spent))
            self._timed_from = None
        structure = None if self._structure is None else self._structure()
        if structure != self._last_structure:
            self._last_structure, self._checked_in_a_row = structure, 0
        if self._checked_in_a_row >= WARMUP_STEPS and self._draws.random() >= self.rate():
            return False
        self._checked_in_a_row += 1
        for axis in self.moving:  # this step's blocks
            axis.move(self._blocks.randrange(axis.size - axis.block + 1))
        self._timed_from, self._spent = time.thread_time() if now is None else now, 0.0
        return True

    def observe(self, name: str, grad: torch.Tensor) -> None:
        """Add a^T G b of a gradient G delivered to parameter ``name`` in this step."""
        if not self.active:
            return
        start = time.thread_time()
        probe = self.probes[name]
        value = probe.gradient_side(grad)
        previous = self.gradient_sides.get(name)
        self.gradient_sides[name] = value if previous is None else previous + value
        # each probed entry of G was rounded to grad's dtype: below its smallest normal by up to
        # underflow_rounding, and |a_i b_j| <= 1, so the probe moves by at most entries * that
        floor = probe.entries * underflow_rounding(grad.dtype)
        self.floors[name] = self.floors.get(name, 0.0) + floor
        self._spent += time.thread_time() - start

    def gradient_side(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """a^T G b of a gradient G of parameter ``name`` (not added to the step)."""
        return self.probes[name].gradient_side(grad)

    def verify(
        self,
        factors: Mapping[str, ParameterFactor | None],
        low_precision: Mapping[str, float],
        left_out: Mapping[str, torch.Tensor] | None = None,
        *,
        defer: bool = False,
    ) -> PendingIdentityCheck | None:
        """Raise ``IdentityCheckError`` unless every parameter's two sides agree (on a step the
        schedule checks; nothing otherwise).

        ``factors``: name -> merged factor (None: no per-example gradient this step);
        ``low_precision``: name -> unit roundoff of a lower precision its operands were rounded
        to (absent: none); ``left_out``: name -> gradient side of declared batch terms, taken
        from the delivered gradient's. ``defer=True``: the comparison's numbers are formed on the
        device and returned as a ``PendingIdentityCheck`` (None when there is nothing to
        compare), to be settled by the host transfer that reads the statistics' first values
        (one host sync per step instead of two).
        """
        if not self.active:
            return None
        start = time.thread_time()
        sides = self.gradient_sides
        if left_out:
            sides = dict(sides)
            for name, value in left_out.items():
                sides[name] = sides[name] - value if name in sides else -value
        names = [n for n in self.names if factors.get(n) is not None or n in sides]
        if not names:
            return None
        segments: list[_Segment] = []
        cache: dict[tuple, torch.Tensor] = {}
        for index, name in enumerate(names):
            factor = factors.get(name)
            if factor is not None:
                _add_segments(segments, index, self.probes[name], factor, cache)
        comparison = _Comparison(
            names, segments, sides, low_precision, self._coefficients, self.floors
        )
        pending = PendingIdentityCheck(comparison)
        self._spent += time.thread_time() - start
        if defer:
            return pending
        pending.settle()
        return None


class PendingIdentityCheck:
    """An identity check whose numbers are formed on the device and not yet compared.

    ``numbers`` is the (3, P) tensor the host compares; ``settle(values)`` compares them once
    they are on the host (read by the caller's own transfer, ``values`` then being that
    tensor's numbers in float64), or reads them itself (a host sync) when given none. It raises
    ``IdentityCheckError`` on a mismatch (and again at the next call); a check that passed does
    nothing more.
    """

    def __init__(self, comparison: _Comparison) -> None:
        self._comparison: _Comparison | None = comparison
        self.numbers = comparison.numbers()

    @property
    def settled(self) -> bool:
        return self._comparison is None

    def settle(self, values: np.ndarray | None = None) -> None:
        comparison = self._comparison
        if comparison is None:
            return
        if values is None:
            values = to_host(self.numbers.to(torch.float64))  # one host transfer
        failing = comparison.failures(values.reshape(3, -1).tolist())
        if failing:
            raise IdentityCheckError(_message(failing))
        self._comparison = None

    def read_with(self, tensor: torch.Tensor) -> np.ndarray:
        """The values of ``tensor`` on the host, read in one transfer with this check's
        numbers, which are compared first (``IdentityCheckError``: no value is returned).

        A floating-point ``tensor`` rides in the check's float64 transfer (exact: widened, then
        narrowed back to its own numpy dtype); any other tensor is read after settling.
        """
        if not tensor.is_floating_point():
            self.settle()
            return to_host(tensor)
        count = self.numbers.numel()
        parts = [self.numbers.reshape(-1), tensor.reshape(-1)]
        flat = to_host(torch.cat([p.to(torch.float64) for p in parts]))  # the one transfer
        self.settle(flat[:count])
        values = flat[count:].reshape(tuple(tensor.shape))
        wanted = NUMPY_DTYPES.get(tensor.dtype, np.float64)  # bfloat16: none in numpy
        return values if values.dtype == wanted else values.astype(wanted)


class CheckedReads:
    """The host reads of one step's statistics, with that step's identity check still pending
    (``pending``, None once compared or when the step was not checked).

    ``to_host`` reads a tensor in one transfer with the check's numbers, compared first;
    ``settle`` compares them on their own. A mismatch raises ``IdentityCheckError`` at every
    call until the check is replaced, and no value is returned. Batches read through this
    (``DenseGradientBatch(reads_through=...)``, ``GradientBatch.derived``).
    """

    def __init__(self, pending: PendingIdentityCheck | None = None) -> None:
        self.pending = pending

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        pending = self.pending
        if pending is None:
            return to_host(tensor)
        values = pending.read_with(tensor)
        self.pending = None
        return values

    def settle(self) -> None:
        if self.pending is not None:
            self.pending.settle()
            self.pending = None


class _Comparison:
    """The vectorised comparison of both sides for every parameter (one host sync when all pass)."""

    def __init__(
        self,
        names: list[str],
        segments: list[_Segment],
        gradient_sides: Mapping[str, torch.Tensor],
        low_precision: Mapping[str, float],
        coefficient_cache: dict[tuple, torch.Tensor],
        floors: Mapping[str, float],
    ) -> None:
        self.names, self.segments = names, segments
        self.floors = [floors.get(name, 0.0) for name in names]  # added to each bound
        values = list(gradient_sides.values())
        reference = values[0] if values else segments[0].products
        self.device = reference.device
        wide = any(v.dtype == torch.float64 for v in values) or any(
            s.products.dtype == torch.float64 for s in segments
        )
        self.dtype = torch.float64 if wide else torch.float32
        zero = None
        sides = []
        for name in names:
            side = gradient_sides.get(name)
            if side is None:
                if zero is None:
                    zero = torch.zeros((), dtype=self.dtype, device=self.device)
                side = zero
            sides.append(side if side.dtype == self.dtype else side.to(self.dtype))
        self.gradient = torch.stack(sides)
        self.constants = self._constants(low_precision)
        scaled = (c * s.scale for c, s in zip(self.constants, segments, strict=True))
        key = (self.device, self.dtype, *scaled)
        coefficients = coefficient_cache.get(key)
        if coefficients is None:
            if len(coefficient_cache) > 64:  # shapes that vary step to step: keep a few
                coefficient_cache.clear()
            host = torch.tensor(key[2:], dtype=self.dtype)
            coefficients = coefficient_cache[key] = to_device(host, self.device)
        self.coefficients = coefficients

    def _constants(self, low_precision: Mapping[str, float]) -> list[float]:
        """Per segment: kappa (lambda u sqrt(2 m) + 2 u_low (1 + u_low)^2), the factor of R in
        the bound."""
        u = unit_roundoff(self.dtype)
        out = []
        for s in self.segments:
            low = low_precision.get(self.names[s.index], 0.0) if low_precision else 0.0
            rounded = 2 * low * (1 + low) ** 2
            out.append(s.kappa * (LAMBDA * u * math.sqrt(2 * s.length) + rounded))
        return out

    def _per_parameter(self, per_segment: torch.Tensor) -> torch.Tensor:
        """(S,) per segment -> (P,) per parameter (the segments of a tied parameter added)."""
        segments = self.segments
        if len(segments) == len(self.names) and all(s.index == k for k, s in enumerate(segments)):
            return per_segment
        index = to_device(torch.tensor([s.index for s in segments]), self.device)
        return per_segment.new_zeros(len(self.names)).index_add_(0, index, per_segment)

    def numbers(self) -> torch.Tensor:
        """(3, P) on the device: per parameter the factor side, the fast path's bound and the
        gradient side (what the host compares, in one transfer)."""
        if not self.segments:
            zeros = torch.zeros_like(self.gradient)
            return torch.stack([zeros, zeros, self.gradient])
        sums, absolute = self._segment_sums()
        sums, tolerance = (
            self._per_parameter(sums),
            self._per_parameter(absolute.mul_(self.coefficients)),
        )
        return torch.stack([sums, tolerance, self.gradient])

    def failures(self, numbers: Sequence[Sequence[float]]) -> list[_Outcome]:
        """The parameters whose sides differ by more than the bound (fast path first), from
        ``numbers()`` read on the host; the comparison in double precision."""
        factor_side, tolerance, gradient_side = (list(map(float, row)) for row in numbers)
        # a delivered gradient that is not finite (a GradScaler overflow, a NaN loss) cannot be
        # compared: the statistics pass through as computed, for their consumers to reject or use
        failing = [
            k
            for k, (f, g, t) in enumerate(zip(factor_side, gradient_side, tolerance, strict=True))
            if abs(f - g) > t + self.floors[k] and math.isfinite(g)
        ]
        if not failing:
            return []
        return self._slow_path(factor_side, gradient_side, failing)

    def _segment_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(per segment sum_n w_n, per segment sum_n |w_n|)."""
        products = [
            s.products if s.products.dtype == self.dtype else s.products.to(self.dtype)
            for s in self.segments
        ]
        length = products[0].numel()
        if all(p.numel() == length for p in products):
            stacked = torch.stack(products)
            return stacked.sum(dim=1), torch.linalg.vector_norm(stacked, 1, dim=1)
        flat = torch.cat(products)
        index = torch.repeat_interleave(
            torch.arange(len(products), device=self.device),
            to_device(torch.tensor([p.numel() for p in products]), self.device),
        )
        sums = torch.zeros(len(products), dtype=self.dtype, device=self.device)
        absolute = torch.zeros_like(sums)
        return sums.index_add_(0, index, flat), absolute.index_add_(0, index, flat.abs())

    def _slow_path(
        self, factor_side: tuple, gradient_side: tuple, candidates: list[int]
    ) -> list[_Outcome]:
        """The bound with R itself, for the parameters that failed the fast path."""
        bound = {k: self.floors[k] for k in candidates}
        for constant, s in zip(self.constants, self.segments, strict=True):
            if s.index in bound:
                bound[s.index] += constant * float(s.magnitude())
        return [
            _Outcome(self.names[k], factor_side[k], gradient_side[k], bound[k])
            for k in candidates
            if abs(factor_side[k] - gradient_side[k]) > bound[k]
        ]


def _message(failing: list[_Outcome]) -> str:
    lines = [
        f"PerSampleStats' identity check failed: for {len(failing)} parameter(s) the per-example "
        f"gradients do not add up to the gradient autograd delivered in this backward "
        f"(probe <a b^T, .> of sum_i g_i against that of the delivered gradient):"
    ]
    for o in failing:
        scale = max(abs(o.factor_side), abs(o.gradient_side), 1e-300)
        if o.factor_side == 0.0:
            what = "received a gradient that no layer call explains"
        elif o.gradient_side == 0.0:
            what = "has per-example gradients but received no gradient"
        else:
            what = "the two differ"
        lines.append(
            f"  {o.name!r}: {what}: per-example sum {o.factor_side:.6g}, delivered "
            f"{o.gradient_side:.6g}, difference {abs(o.factor_side - o.gradient_side):.3g} "
            f"({abs(o.factor_side - o.gradient_side) / scale:.2%}), rounding tolerance "
            f"{o.tolerance:.3g}"
        )
    lines.append(_CAUSES)
    return "\n".join(lines)


# -- the factor side of each factor type ----------------------------------------------------------
def _row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1)


def _add_segments(
    segments: list[_Segment],
    index: int,
    probe: _Probe,
    factor: ParameterFactor,
    cache: dict[tuple, torch.Tensor],
) -> None:
    kind = type(factor)
    if kind is OuterProductFactor:
        segments.append(_outer_product(index, probe, factor, cache))
    elif kind is PerExampleFactor:
        segments.append(_per_example(index, probe, factor.grads, factor, cache))
    elif kind is EmbeddingFactor:
        segments.append(_embedding(index, probe, factor))
    elif isinstance(factor, SumFactor):
        for part in factor.parts:
            _add_segments(segments, index, probe, part, cache)
    elif isinstance(factor, RowsFactor):  # a grouped batch: its groups' factors (padding rows: 0)
        for part in factor.parts:
            if part is not None:
                _add_segments(segments, index, probe, part, cache)
    else:  # another factor type: its per-example gradients, materialised (B, *shape)
        eye = torch.eye(factor.batch_size, dtype=torch.float64)
        dense = factor.weighted_sum(eye.to(_any_dtype(factor)))
        segments.append(
            _per_example(index, probe, dense.reshape(factor.batch_size, -1), None, cache)
        )


def _any_dtype(factor: ParameterFactor) -> torch.dtype:
    for value in vars(factor).values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def _cached_mv(
    cache: dict[tuple, torch.Tensor], matrix: torch.Tensor, vector: torch.Tensor
) -> torch.Tensor:
    """``matrix @ vector``, shared by the factors that hold the same matrix (a Linear's weight
    and bias read the same output gradients with the same row probe)."""
    key = (matrix.data_ptr(), matrix.shape, matrix.stride(), id(vector))
    product = cache.get(key)
    if product is None:
        product = cache[key] = torch.mv(matrix, vector)
    return product


def _constants(probe: _Probe, kind: str, rows: int) -> tuple[float, int, float]:
    """(scale, m, kappa) of a segment of ``rows`` products of ``probe`` (see ``_Segment``)."""
    key = (kind, rows)
    found = probe.constants.get(key)
    if found is None:
        if len(probe.constants) > 64:  # sizes that vary step to step: keep a few
            probe.constants.clear()
        entries = probe.row.block * probe.col.block
        if kind == "embedding":  # |a[idx] . onehot| <= 1: only the column side is a sum
            norm, cap, chain = probe.col.bound(), LAMBDA, probe.col.block + 1
        elif probe.matrix:
            norm, cap = probe.row.bound() * probe.col.bound(), LAMBDA**2
            chain = probe.row.block + probe.col.block
        else:
            norm, cap, chain = probe.row.bound(), LAMBDA, probe.row.block
        found = probe.constants[key] = (
            1.0 / max(norm, 1e-300),
            rows + chain,
            min(math.sqrt(entries), cap),
        )
    return found


def _outer_product(
    index: int, probe: _Probe, f: OuterProductFactor, cache: dict[tuple, torch.Tensor]
) -> _Segment:
    """g_i = sum_t D_it A_it^T (per group): w_(n, g) = (a_g . D_ng)(b . A_ng) over the probed
    rows and columns."""
    row, col = probe.row, probe.col
    groups, q, p = f.groups, f.out_features, f.in_features
    if groups == 1 and not _flat_inputs(f):  # a convolution's patches, positions innermost
        d = row.narrow(f.output_grads.reshape(-1, q), 1)
        x = col.narrow(f.inputs.reshape(f.batch_size, -1, p).transpose(1, 2), 1)  # (B, p, T)
        x_b = torch.matmul(col.cut(x), x).reshape(-1)  # b . A_n, read along the positions
        products = _cached_mv(cache, d, row.cut(d)).mul(x_b)
        x = x.transpose(1, 2)  # (B, T, p) for the magnitude
    elif groups == 1:
        x, d = f.flat_rows()
        d, x = row.narrow(d, 1), col.narrow(x, 1)
        products = _cached_mv(cache, d, row.cut(d)).mul(torch.mv(x, col.cut(x)))
    else:  # the rows' block may span groups: the masked row vector, group by group
        d = f.output_grads.reshape(-1, groups, q)
        x = col.narrow(f.inputs.reshape(-1, groups, p), 2)
        u = torch.einsum("ngq,gq->ng", d, row.masked(d).view(groups, q))
        products = (u * torch.matmul(x, col.cut(x))).reshape(-1)
    scale, length, kappa = _constants(probe, "outer", products.numel())
    magnitude = functools.partial(_outer_magnitude, d, x)
    return _Segment(index, products, scale, length, kappa, magnitude)


def _outer_magnitude(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (_row_norms(d) * _row_norms(x).reshape(-1)).sum()


def _flat_inputs(f: OuterProductFactor) -> bool:
    """Whether the factor's inputs read as (B T, p) rows without a copy (a Linear's do; a
    convolution's patches, positions innermost, do not)."""
    if f._flat_views is not None:
        return True
    try:
        f.inputs.view(-1, f.in_features)
    except RuntimeError:
        return False
    return True


def _embedding(index: int, probe: _Probe, f: EmbeddingFactor) -> _Segment:
    """g_i = sum_t onehot(idx_it) D_it^T: w_n = a[idx_n] (b . D_n) over the probed rows (a
    zero for a row outside them) and columns."""
    row, col = probe.row, probe.col
    d = col.narrow(f.output_grads.reshape(f.indices.numel(), -1), 1)
    looked_up = row.masked(d).index_select(0, f.indices.reshape(-1))
    products = looked_up * torch.mv(d, col.cut(d))
    scale, length, kappa = _constants(probe, "embedding", products.numel())
    magnitude = functools.partial(_embedding_magnitude, d)
    return _Segment(index, products, scale, length, kappa, magnitude)


def _embedding_magnitude(d: torch.Tensor) -> torch.Tensor:
    return _row_norms(d).sum()


def _per_example(
    index: int,
    probe: _Probe,
    grads: torch.Tensor,
    factor: PerExampleFactor | None,
    cache: dict[tuple, torch.Tensor],
) -> _Segment:
    """g_i held outright, (B, numel): w_i = <a b^T, g_i> over the probed support."""
    row, col = probe.row, probe.col
    positions = 1 if factor is None else factor.positions
    if probe.matrix:
        held = grads.reshape(-1, probe.rows, probe.cols)
        held = col.narrow(row.narrow(held, 1), 2)
        products = torch.matmul(held, col.cut(held)) @ row.cut(held)
        rows = held.reshape(held.shape[0], -1)
    else:
        rows = row.narrow(grads, 1)
        products = _cached_mv(cache, rows, row.cut(rows))
    kind = "matrix" if probe.matrix else "vector"
    scale, length, kappa = _constants(probe, kind, products.numel() * positions)
    terms = None if factor is None else factor.terms
    magnitude = functools.partial(_rows_magnitude, rows) if terms is None else terms
    return _Segment(index, products, scale, length, kappa, magnitude)


def _rows_magnitude(rows: torch.Tensor) -> torch.Tensor:
    return _row_norms(rows).sum()
