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

**Support.** A matrix of more than ``FULL_SUPPORT_ENTRIES`` entries is probed on all its rows but
only a block of ``FULL_SUPPORT_ENTRIES // rows`` consecutive columns, moved to a random place at
every step (a private ``random.Random``), so that the hook reads at most that many entries of G
(a full pass over a large G costs a few percent of a small model's step). What that can miss: a
difference confined to the columns outside this step's block (input features that are zero
everywhere else, say a one-hot input); a difference spread over the matrix, or confined to rows
(a table's other rows, an output unit), is still caught at every step, and a persistent one
confined to columns within about cols / block steps.

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

    |a^T G b - sum_n (a . D_n)(b . A_n)| <= lambda kappa (u sqrt(2 m) + 2 u_low) R,
    kappa = min(sqrt(rows * cols), lambda^2)  (min(sqrt(n), lambda) for a vector),

with lambda = ``LAMBDA`` = 6 (each tail 2 exp(-18) ~ 3e-8), u the unit roundoff of the
arithmetic (float32: 2^-24, float64: 2^-53) and u_low that of a lower precision the operands were
rounded to (bf16 / fp16 activations or output gradients under autocast, low-precision
parameters: one rounding each, not accumulated). Under bf16 that term dominates and the check
only catches differences comparable to the gradient itself. For per-example factors (biases,
normalisation layers) the terms are the per-position contributions their rule summed, whose norms
the rule reports (``PerExampleFactor(terms=...)``; without it each example's row is taken as one
term). Measured differences sit three to five orders of magnitude below this bound; it is not
tuned to anything.

Fast path: R needs row norms (a pass over every factor), so the check first compares against the
same bound with R replaced by L = sum_n |(a . D_n)(b . A_n)| / (|a|_2 |b|_2) <= R (Cauchy-Schwarz),
computed from the probe products it formed anyway. Passing it passes the bound; only a parameter
that fails it has R computed, and raises if it fails the bound too.

**The check's limit.** A sum cannot see which row belongs to which example: gradients credited to
the wrong examples (a misattribution) still add up to G and pass. So do per-example gradients of
a loss that couples the examples (a batch-level statistic inside the loss), for the same reason.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from grabkit.stats.factors import (
    EmbeddingFactor,
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    SumFactor,
)
from grabkit.stats.rows import RowsFactor

__all__ = ["FULL_SUPPORT_ENTRIES", "LAMBDA", "IdentityCheck", "IdentityCheckError", "unit_roundoff"]

#: a matrix with more entries is probed on a moving block of columns (see the module docstring)
FULL_SUPPORT_ENTRIES = 1 << 15

#: the tail constant of the tolerance (see the module docstring)
LAMBDA = 6.0

_PROBE_DTYPES = (torch.float32, torch.float64)

_CAUSES = (
    "Likely causes and fixes:\n"
    "  * a weight used outside its layer (F.linear(h, layer.weight), x @ W.T, a tied head): "
    "PerSampleStats computes F.linear / F.embedding / matmul uses made inside the model's "
    "forward (functional_uses=True, the default); call the layer as a module for other uses, "
    "or register a rule for the module that makes them;\n"
    "  * a loss term that is not a sum over examples (an L2 penalty in the loss, an auxiliary "
    "loss on shared parameters or batch statistics): declare it, "
    "loss = per_example_loss + stats.batch_term(term), and it is left out of every g_i;\n"
    "  * a gradient hook that changes a parameter's gradient (p.register_hook), or parameters "
    "frozen or unfrozen between the forward and its backward;\n"
    "  * a backward the engine did not see whole: a backward through a graph built before the "
    "step's forward, or through a model call made without its hooks.\n"
    "If you know the difference is intended, PerSampleStats(..., check_identity=False) (or "
    "GraBSampler(..., stats_options={'check_identity': False})) skips the check; the statistics "
    "may then silently be those of another loss."
)


class IdentityCheckError(RuntimeError):
    """The per-example gradients do not add up to the gradient autograd delivered."""


@functools.cache
def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-(mantissa bits + 1) of a floating dtype (float32: 2^-24); 0 for other dtypes."""
    if not dtype.is_floating_point:
        return 0.0
    return torch.finfo(dtype).eps / 2


@dataclass
class _Probe:
    """One parameter's probe: rows x cols view, a (rows,), b (cols,), and this step's block."""

    rows: int
    cols: int
    block: int  # columns probed per step (cols when the support is full)
    a: torch.Tensor  # float64, on the CPU
    b: torch.Tensor
    a_norm: float
    b_square_prefix: list[float]  # prefix sums of b^2, for the norm of any block
    start: int = 0
    moved_a: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)
    moved_b: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def matrix(self) -> bool:
        return self.cols > 1

    def block_norm(self) -> float:
        prefix = self.b_square_prefix
        return math.sqrt(max(prefix[self.start + self.block] - prefix[self.start], 0.0))

    def vectors(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) on ``device`` in ``dtype`` (cached), b over the whole of cols."""
        key = (device, dtype)
        a = self.moved_a.get(key)
        if a is None:
            a = self.moved_a[key] = self.a.to(device, dtype)
        b = self.moved_b.get(key)
        if b is None:
            b = self.moved_b[key] = self.b.to(device, dtype)
        return a, b


def _draw_probe(shape: torch.Size, gen: torch.Generator, rows_of: _Probe | None) -> _Probe:
    """The probe of a parameter of ``shape``; a vector whose length is ``rows_of``'s rows
    takes that probe's row vector (and its moved copies), so both read one product."""
    numel = shape.numel()
    rows = int(shape[0]) if len(shape) >= 2 else numel
    cols = numel // rows if len(shape) >= 2 and rows else 1
    block = cols if rows * cols <= FULL_SUPPORT_ENTRIES else max(1, FULL_SUPPORT_ENTRIES // rows)
    if rows_of is not None and cols == 1 and rows_of.rows == rows:
        a, moved_a = rows_of.a, rows_of.moved_a
    else:
        a, moved_a = torch.rand(rows, generator=gen, dtype=torch.float64) * 2 - 1, {}
    b = torch.ones(1, dtype=torch.float64)
    if cols > 1:
        b = torch.rand(cols, generator=gen, dtype=torch.float64) * 2 - 1
    prefix = [0.0, *torch.cumsum(b.square(), 0).tolist()]
    return _Probe(rows, cols, block, a, b, float(a.norm()), prefix, moved_a=moved_a)


@dataclass
class _Segment:
    """One factor's probe products w_n for one parameter (a tied parameter has several)."""

    index: int  # the parameter's position in the check
    products: torch.Tensor  # (N,) w_n, summing to the factor side of the probe
    scale: float  # L = scale * sum |w_n| <= R
    magnitude: Callable[[], torch.Tensor]  # R, computed only if the fast path fails
    length: int  # m
    kappa: float


@dataclass
class _Outcome:
    """What the check compared for one parameter (for the error message)."""

    name: str
    factor_side: float
    gradient_side: float
    tolerance: float


class IdentityCheck:
    """The probes of one engine's trainable parameters and the comparison of both sides.

    Args:
        param_shapes: name -> shape of every trainable parameter.
        seed: seeds the private generators (probe entries, block positions).
        shared_rows: vector parameter -> matrix parameter whose row probe it takes (a Linear's
            bias and weight: the product of the output gradients with that probe serves both).

    ``begin_step()`` moves the blocks (at the start of every step); ``observe(name, grad)`` adds
    the gradient side of one delivered gradient (in the parameter's hook); ``verify(...)``
    compares with the factors and raises ``IdentityCheckError``.
    """

    def __init__(
        self,
        param_shapes: Mapping[str, torch.Size],
        seed: int = 0,
        shared_rows: Mapping[str, str] | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        shared_rows = shared_rows or {}
        self.names = list(param_shapes)
        self.probes: dict[str, _Probe] = {}
        ordered = sorted(param_shapes, key=lambda n: n in shared_rows)  # matrices first
        for name in ordered:
            partner = self.probes.get(shared_rows.get(name, ""))
            self.probes[name] = _draw_probe(torch.Size(param_shapes[name]), gen, partner)
        self.moving = [p for p in self.probes.values() if p.block < p.cols]
        self._blocks = random.Random(seed)
        self.gradient_sides: dict[str, torch.Tensor] = {}

    def begin_step(self) -> None:
        self.gradient_sides = {}
        for probe in self.moving:
            probe.start = self._blocks.randrange(probe.cols - probe.block + 1)

    # -- gradient side (hooks) ------------------------------------------------------------------
    def observe(self, name: str, grad: torch.Tensor) -> None:
        """Add a^T G b of a gradient G delivered to parameter ``name`` in this step."""
        value = self.gradient_side(name, grad)
        previous = self.gradient_sides.get(name)
        self.gradient_sides[name] = value if previous is None else previous + value

    def gradient_side(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        probe = self.probes[name]
        g = grad.detach() if grad.requires_grad else grad  # (create_graph: no graph for this)
        if g.dtype not in _PROBE_DTYPES:
            g = g.float()  # low-precision gradients are probed in float32
        a, b = probe.vectors(g.device, g.dtype)
        if not probe.matrix:
            return torch.dot(a, g.reshape(-1))
        g = g.reshape(probe.rows, probe.cols)
        if probe.block < probe.cols:
            stop = probe.start + probe.block
            g, b = g[:, probe.start : stop], b[probe.start : stop]
        return torch.dot(a, torch.mv(g, b))

    # -- factor side and comparison -------------------------------------------------------------
    def verify(
        self,
        factors: Mapping[str, ParameterFactor | None],
        low_precision: Mapping[str, float],
        left_out: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Raise ``IdentityCheckError`` unless every parameter's two sides agree.

        ``factors``: name -> merged factor (None: no per-example gradient this step);
        ``low_precision``: name -> unit roundoff of a lower precision its operands were rounded
        to (absent: none); ``left_out``: name -> gradient side of declared batch terms, taken
        from the delivered gradient's.
        """
        sides = dict(self.gradient_sides)
        for name, value in (left_out or {}).items():
            sides[name] = sides[name] - value if name in sides else -value
        names = [n for n in self.names if factors.get(n) is not None or n in sides]
        if not names:
            return
        segments: list[_Segment] = []
        cache: dict[tuple, torch.Tensor] = {}
        for index, name in enumerate(names):
            factor = factors.get(name)
            if factor is not None:
                segments.extend(_segments(index, self.probes[name], factor, cache))
        outcome = _Comparison(names, segments, sides, low_precision)
        failing = outcome.failures()
        if failing:
            raise IdentityCheckError(_message(failing))


class _Comparison:
    """The vectorised comparison of both sides for every parameter (one host sync when all pass)."""

    def __init__(
        self,
        names: list[str],
        segments: list[_Segment],
        gradient_sides: Mapping[str, torch.Tensor],
        low_precision: Mapping[str, float],
    ) -> None:
        self.names, self.segments = names, segments
        reference = next(iter(gradient_sides.values()), None)
        if reference is None:
            reference = segments[0].products
        self.device = reference.device
        self.dtype = torch.float64 if self._any_float64(gradient_sides) else torch.float32
        self.constants = self._constants(low_precision)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self.gradient = torch.stack([gradient_sides.get(n, zero).to(self.dtype) for n in names])

    def _any_float64(self, gradient_sides: Mapping[str, torch.Tensor]) -> bool:
        return any(v.dtype == torch.float64 for v in gradient_sides.values()) or any(
            s.products.dtype == torch.float64 for s in self.segments
        )

    def _constants(self, low_precision: Mapping[str, float]) -> list[float]:
        """Per segment: lambda kappa (u sqrt(2 m) + 2 u_low), the factor of R in the bound."""
        u = unit_roundoff(self.dtype)
        out = []
        for s in self.segments:
            low = low_precision.get(self.names[s.index], 0.0)
            out.append(LAMBDA * s.kappa * (u * math.sqrt(2 * s.length) + 2 * low))
        return out

    def _per_parameter(self, per_segment: torch.Tensor) -> torch.Tensor:
        if len(self.segments) == len(self.names) and all(
            s.index == k for k, s in enumerate(self.segments)
        ):
            return per_segment
        index = torch.tensor([s.index for s in self.segments], device=self.device)
        out = torch.zeros(len(self.names), dtype=per_segment.dtype, device=self.device)
        return out.index_add_(0, index, per_segment)

    def failures(self) -> list[_Outcome]:
        if not self.segments:
            factor_side = torch.zeros_like(self.gradient)
            tolerance = torch.zeros_like(self.gradient)
        else:
            sums, absolute = self._segment_sums()
            factor_side = self._per_parameter(sums)
            coefficients = torch.tensor(
                [c * s.scale for c, s in zip(self.constants, self.segments, strict=True)],
                dtype=self.dtype,
                device=self.device,
            )
            tolerance = self._per_parameter(absolute * coefficients)
        difference = (factor_side - self.gradient).abs()
        if bool((difference <= tolerance).all()):  # the one host sync of a passing check
            return []
        return self._slow_path(factor_side, difference)

    def _segment_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(per segment sum_n w_n, per segment sum_n |w_n|)."""
        products = [s.products.to(self.dtype) for s in self.segments]
        lengths = {p.numel() for p in products}
        if len(lengths) == 1:
            stacked = torch.stack(products)
            return stacked.sum(dim=1), stacked.abs().sum(dim=1)
        flat = torch.cat(products)
        index = torch.repeat_interleave(
            torch.arange(len(products), device=self.device),
            torch.tensor([p.numel() for p in products], device=self.device),
        )
        sums = torch.zeros(len(products), dtype=self.dtype, device=self.device)
        absolute = torch.zeros_like(sums)
        return sums.index_add_(0, index, flat), absolute.index_add_(0, index, flat.abs())

    def _slow_path(self, factor_side: torch.Tensor, difference: torch.Tensor) -> list[_Outcome]:
        """The bound with R itself, for every parameter (only when the fast path failed)."""
        bound = torch.zeros(len(self.names), dtype=torch.float64)
        for constant, s in zip(self.constants, self.segments, strict=True):
            bound[s.index] += constant * float(s.magnitude())
        factor_values = factor_side.double().cpu()
        gradient_values = self.gradient.double().cpu()
        differences = difference.double().cpu()
        return [
            _Outcome(name, float(factor_values[k]), float(gradient_values[k]), float(bound[k]))
            for k, name in enumerate(self.names)
            if differences[k] > bound[k]
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


def _segments(
    index: int, probe: _Probe, factor: ParameterFactor, cache: dict[tuple, torch.Tensor]
) -> list[_Segment]:
    if isinstance(factor, SumFactor):
        return [s for part in factor.parts for s in _segments(index, probe, part, cache)]
    if isinstance(factor, RowsFactor):  # a grouped batch: its groups' factors (padding rows: 0)
        parts = [part for part in factor.parts if part is not None]
        return [s for part in parts for s in _segments(index, probe, part, cache)]
    if isinstance(factor, OuterProductFactor):
        return [_outer_product(index, probe, factor, cache)]
    if isinstance(factor, EmbeddingFactor):
        return [_embedding(index, probe, factor)]
    if isinstance(factor, PerExampleFactor):
        return [_per_example(index, probe, factor.grads, factor, cache)]
    # another factor type: its per-example gradients, materialised (B, *shape)
    eye = torch.eye(factor.batch_size, dtype=torch.float64)
    dense = factor.weighted_sum(eye.to(_any_dtype(factor)))
    return [_per_example(index, probe, dense.reshape(factor.batch_size, -1), None, cache)]


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
    key = (matrix.data_ptr(), tuple(matrix.shape), matrix.stride(), id(vector), matrix.dtype)
    if key not in cache:
        cache[key] = torch.mv(matrix, vector)
    return cache[key]


def _outer_product(
    index: int, probe: _Probe, f: OuterProductFactor, cache: dict[tuple, torch.Tensor]
) -> _Segment:
    """g_i = sum_t D_it A_it^T (per group): w_(n, g) = (a_g . D_ng)(b . A_ng) over the block."""
    a, b = probe.vectors(f.inputs.device, f.inputs.dtype)
    groups, q, p = f.groups, f.out_features, f.in_features
    start, stop = probe.start, probe.start + probe.block
    if groups == 1:
        d = f.output_grads.reshape(-1, q)
        x = f.inputs.reshape(-1, p)[:, start:stop]
        u = _cached_mv(cache, d, a)
        products = u * torch.mv(x, b[start:stop])
    else:
        d = f.output_grads.reshape(-1, groups, q)
        x = f.inputs.reshape(-1, groups, p)[..., start:stop]
        u = torch.einsum("ngq,gq->ng", d, a.view(groups, q))
        products = (u * torch.matmul(x, b[start:stop])).reshape(-1)

    def magnitude() -> torch.Tensor:
        return (_row_norms(d) * _row_norms(x)).sum()

    block = stop - start
    return _Segment(
        index,
        products,
        1.0 / max(probe.a_norm * probe.block_norm(), 1e-300),
        magnitude,
        products.numel() + q + block,
        min(math.sqrt(q * block), LAMBDA**2),
    )


def _embedding(index: int, probe: _Probe, f: EmbeddingFactor) -> _Segment:
    """g_i = sum_t onehot(idx_it) D_it^T: w_n = a[idx_n] (b . D_n) over the block of columns."""
    a, b = probe.vectors(f.output_grads.device, f.output_grads.dtype)
    start, stop = probe.start, probe.start + probe.block
    d = f.output_grads.reshape(f.indices.numel(), -1)[:, start:stop]
    products = a.index_select(0, f.indices.reshape(-1)) * torch.mv(d, b[start:stop])

    def magnitude() -> torch.Tensor:
        return _row_norms(d).sum()

    block = stop - start
    return _Segment(
        index,
        products,
        1.0 / max(probe.block_norm(), 1e-300),
        magnitude,
        products.numel() + block + 1,
        min(math.sqrt(block), LAMBDA),
    )


def _per_example(
    index: int,
    probe: _Probe,
    grads: torch.Tensor,
    factor: PerExampleFactor | None,
    cache: dict[tuple, torch.Tensor],
) -> _Segment:
    """g_i held outright, (B, numel): w_i = <a b^T, g_i> over the probed support."""
    a, b = probe.vectors(grads.device, grads.dtype)
    positions = 1 if factor is None else factor.positions
    if probe.matrix:
        start, stop = probe.start, probe.start + probe.block
        held = grads.reshape(-1, probe.rows, probe.cols)[..., start:stop]
        products = torch.matmul(held, b[start:stop]) @ a
        rows = held.reshape(held.shape[0], -1)
        scale = 1.0 / max(probe.a_norm * probe.block_norm(), 1e-300)
        entries, kappa = (
            probe.rows * (stop - start),
            min(math.sqrt(probe.rows * (stop - start)), LAMBDA**2),
        )
    else:
        products = _cached_mv(cache, grads, a)
        rows = grads
        scale = 1.0 / max(probe.a_norm, 1e-300)
        entries, kappa = probe.rows, min(math.sqrt(probe.rows), LAMBDA)
    terms = None if factor is None else factor.terms

    def magnitude() -> torch.Tensor:
        return _row_norms(rows).sum() if terms is None else terms()

    return _Segment(
        index, products, scale, magnitude, products.numel() * positions + entries, kappa
    )
