"""Sketched per-example gradients from layer hooks: a (B, k) matrix S g_i, never a (B, d) one.

GraB decides with signs of inner products, so it can balance S g_1, ..., S g_B for a random
linear map S: R^d -> R^k with E[<S x, S y>] = <x, y> instead of the gradients themselves. That
makes every ordering run in hook mode (the ones that need coordinates too: they see the k
coordinates of the sketch), and makes distributed GraB exchange (B, k) instead of (B, d).

The map is a sum of independent maps, one per trainable parameter: S g = sum_p S_p g^(p), each
into the same k coordinates, each computed from what the layer hooks hold
(``PerSampleStats.step_factors``):

* a parameter of two or more dims is viewed as a matrix of ``shape[0]`` rows (a Linear's or
  Conv's outputs, an Embedding's vocabulary) and ``numel / shape[0]`` columns, and
  S_p = (P_out kron P_in) / sqrt(k), with Gaussian P_out (k_out x rows), P_in (k_in x cols),
  k = k_out k_in (split per parameter, ``kronecker_split``; a side no wider than its factor
  gets orthogonal columns and is exact). For
  g_i = sum_t D_it A_it^T (Linear with any leading dims, Conv via unfold, transformers'
  Conv1D) that is sum_t (P_out D_it) kron (P_in A_it): O(B T (k_out rows + k_in cols + k))
  per layer, with no per-example gradient formed. For an Embedding, P_out onehot(idx) is a
  column of P_out (a gather);
* a parameter of one dim (biases, normalisation affine parameters) goes through a CountSketch:
  coordinate j is added, with a random sign, to one random coordinate of the k: O(B n);
* per-example gradients that a rule holds outright (the torch.func fallback) are mapped by the
  parameter's own map applied to them densely; a parameter with several uses (a tied embedding
  and output head) gets the sum of its uses' sketches, since S_p is linear.

Every map is drawn on the CPU in float32 from a generator seeded by (``seed``, canonical
parameter name: wrappers such as ``torch.compile``, DDP, FSDP and activation-checkpoint wrappers
looked through, ``grabkit.stats.names``) and then moved to the statistics' device and dtype:
every rank and every resumed run draws the same maps, in any process, compiled or wrapped or
not. ``GradientSketch.fingerprint`` digests what the maps are drawn from; a sampler's state
records it and a state of other maps is refused (``check_saved_maps``).

Guarantee (Johnson-Lindenstrauss style). Unbiased: E[<S g_i, S g_j>] = <g_i, g_j> for every
pair. For a dense Gaussian map of width k the error of one inner product has standard deviation
sqrt((|g_i|^2 |g_j|^2 + <g_i, g_j>^2) / k) <= sqrt(2 / k) |g_i| |g_j|, and with probability
1 - delta all inner products among n vectors are within eps |g_i| |g_j| once
k >= 8 ln(n / delta) / eps^2: the typical error of one product is sqrt(2 / k) |g_i| |g_j|
(0.044 at k = 1024, 0.088 at k = 256), and k = 1024 keeps all of n = 60,000 within about 0.2.
The independent maps of the parameters add up like one dense map of width k (the cross terms
between parameters have mean zero and the dense variance). The Kronecker map of a matrix
parameter is weaker on gradients of low rank: for a rank-one gradient (one position, T = 1)
the relative standard deviation is about sqrt(1/k_out + 1/k_in) instead of sqrt(1/k)
(0.25 at 32 x 32; a side exact by orthogonality drops its term: softmax regression's 10 x 784
weight at k = 1024 has sqrt(1/64) = 0.125); it approaches the dense figure as the rank
grows (many positions, or GraB's running sum of many examples, which is what its decisions
read). The CountSketch part has the dense variance up to the fourth moments of the
coordinates. A larger ``dim`` buys accuracy at O(B k) more balancing work and O(W B k) numbers
communicated per step.

Shapes: B examples, T positions, G groups, k = ``dim`` sketch coordinates.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from grabkit.stats.engine import PerSampleStats, unwrap_data_parallel
from grabkit.stats.factors import (
    EmbeddingFactor,
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    SumFactor,
    compute_dtype,
)
from grabkit.stats.gradient_batch import DenseGradientBatch
from grabkit.stats.identity import CheckedReads
from grabkit.stats.names import canonical_parameter_names
from grabkit.stats.rows import ItemLayout, RowsFactor
from grabkit.stats.source import BackwardMark, StatisticsSource
from grabkit.stats.transfer import to_device

__all__ = [
    "CountSketchMap",
    "GradientSketch",
    "KroneckerMap",
    "SketchedStats",
    "check_saved_maps",
    "kronecker_factors",
    "kronecker_split",
    "maps_fingerprint",
]


def kronecker_factors(dim: int) -> tuple[int, int]:
    """(k_out, k_in) with k_out k_in = dim and k_out the largest divisor of dim <= sqrt(dim).

    The Kronecker map is most accurate when both sides are wide, so ``dim`` should have a
    divisor near its square root (a power of two, a square): a prime ``dim`` is refused.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"`sketch_dim` should be a positive integer, but got {dim!r}")
    k_out = max(d for d in range(1, math.isqrt(dim) + 1) if dim % d == 0)
    if dim > 16 and k_out * k_out * 16 < dim:
        raise ValueError(
            f"sketch_dim={dim} has no divisor near its square root (the best split is "
            f"{k_out} x {dim // k_out}), which makes the Kronecker sketch of matrix parameters "
            f"inaccurate; use a power of two or a square, e.g. {2 ** round(math.log2(dim))}."
        )
    return k_out, dim // k_out


def kronecker_split(rows: int, cols: int, dim: int) -> tuple[int, int]:
    """(k_out, k_in) with k_out k_in = dim for a (rows, cols) matrix parameter.

    Accuracy first: on a rank-one gradient the relative error of the Kronecker map is about
    sqrt(e(k_out, rows) + e(k_in, cols)), where a side of f >= its dim n is drawn with
    orthogonal columns and is exact (e = 0), else e = 1 / f. Among the splits within 1.3 times
    (in variance) of the most accurate one, the cheapest to project (B T (k_out rows +
    k_in cols)) wins: softmax regression's 10 x 784 weight gets 16 x 64 (its 10 outputs
    exactly), a language model's 10,000 x 128 head 16 x 64 instead of 32 x 32 (half the cost,
    1.25 times the variance), a square 784 x 784 layer 32 x 32.
    """
    kronecker_factors(dim)  # validates dim

    def error(f: int, n: int) -> float:
        return 0.0 if f >= n else 1.0 / f

    pairs = [(a, dim // a) for a in range(1, dim + 1) if dim % a == 0]
    errors = {ab: error(ab[0], rows) + error(ab[1], cols) for ab in pairs}
    best = min(errors.values())
    allowed = [ab for ab in pairs if errors[ab] <= 1.3 * best + 1e-12]
    return min(allowed, key=lambda ab: (ab[0] * rows + ab[1] * cols, abs(ab[0] - ab[1])))


def _seed_of(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, canonical parameter name), the same in every
    process."""
    digest = hashlib.sha256(f"grabkit.sketch/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _side(k: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """(k, n) Gaussian; with k >= n its columns are made orthogonal, of norm sqrt(k), so that
    P^T P = k I exactly and this side of the Kronecker map adds no error."""
    p = torch.randn(k, n, generator=gen)
    if k >= n:
        q, r = torch.linalg.qr(p.double())
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)
        p = (q * math.sqrt(k)).float().contiguous()
    return p


class KroneckerMap:
    """S_p = (P_out kron P_in) / sqrt(k) for a parameter viewed as a (rows, cols) matrix.

    Attributes:
        rows / cols: the matrix view of the parameter (``shape[0]``, ``numel / shape[0]``).
        p_out: (k_out, rows), p_in: (k_in, cols): Gaussian, or with orthogonal columns of norm
            sqrt(k) where k >= the side's dim (``_side``); E[P^T P] = k I either way.
        scale: 1 / sqrt(k_out k_in).
        p_out_t / p_in_t: contiguous copies of the transposes, (rows, k_out) and (cols, k_in):
            vectors are projected by a plain (B, f) @ (f, k) product.
    """

    def __init__(self, rows: int, cols: int, k_out: int, k_in: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.cols, self.k_out, self.k_in = rows, cols, k_out, k_in
        self.p_out = _side(k_out, rows, gen)
        self.p_in = _side(k_in, cols, gen)
        self.scale = 1.0 / math.sqrt(k_out * k_in)
        self._transpose()

    def _transpose(self) -> None:
        self.p_out_t = self.p_out.T.contiguous()
        self.p_in_t = self.p_in.T.contiguous()

    def to(self, device: torch.device, dtype: torch.dtype) -> KroneckerMap:
        self.p_out = to_device(self.p_out.to(dtype), device)
        self.p_in = to_device(self.p_in.to(dtype), device)
        self._transpose()
        return self

    def dense(self, grads: torch.Tensor) -> torch.Tensor:
        """(B, rows * cols) per-example gradients -> (B, k): P_out G_i P_in^T, flattened."""
        g = grads.reshape(-1, self.rows, self.cols).to(self.p_in.dtype)
        out = self.p_out @ (g @ self.p_in.T)  # (B, k_out, k_in)
        return out.reshape(g.shape[0], -1) * self.scale

    def outer_product(self, factor: OuterProductFactor) -> torch.Tensor:
        """(B, k) sketch of g_i = sum_t D_it A_it^T (per group), from the factor's A and D."""
        return self._outer_sum(*self.outer_product_sides(factor))

    def embedding(self, factor: EmbeddingFactor) -> torch.Tensor:
        """(B, k) sketch of g_i = sum_t onehot(idx_it) D_it^T: P_out's columns gathered."""
        return self._outer_sum(*self.embedding_sides(factor))

    def add_outer_product(
        self, out: torch.Tensor, factor: OuterProductFactor, scale: float, overwrite: bool
    ) -> bool:
        """(B, k) ``out`` += (or, with ``overwrite``, =) ``scale`` times the ``outer_product``
        sketch, for a factor of one group whose parameter is this map's matrix: for one
        position (a plain Linear) two (B, f) @ (f, k) products and one fused outer product;
        for several positions where forming the per-example gradients is cheaper
        (``materialising_is_cheaper``: a convolution's small kernel over many positions),
        P_out G_i P_in^T of those. Returns False, doing nothing, for any other factor."""
        b, p = factor.batch_size, factor.in_features
        if factor.groups != 1 or factor.out_features != self.rows or p != self.cols:
            return False
        if factor.positions != 1:
            if not self.materialising_is_cheaper(factor.positions):
                return False
            grads = factor.per_example_grads()  # (B, rows, cols)
            sketch = torch.matmul(self.p_out, torch.matmul(grads, self.p_in_t))  # (B, k_out, k_in)
            out3 = out.view(b, self.k_out, self.k_in)
            if overwrite:
                torch.mul(sketch, self.scale * scale, out=out3)
            else:
                out3.add_(sketch, alpha=self.scale * scale)
            return True
        inputs, output_grads = factor.flat_rows()  # (B, p), (B, q)
        left = torch.mm(output_grads, self.p_out_t)  # (B, k_out)
        right = torch.mm(inputs, self.p_in_t)  # (B, k_in)
        left3, right3 = left.view(b, self.k_out, 1), right.view(b, 1, self.k_in)
        out3 = out.view(b, self.k_out, self.k_in)
        if overwrite:
            torch.mul(left3.mul_(self.scale * scale), right3, out=out3)
        else:
            out3.addcmul_(left3, right3, value=self.scale * scale)
        return True

    def materialising_is_cheaper(self, positions: int) -> bool:
        """Whether sketching g_i = sum_t D_it A_it^T over ``positions`` rows per example costs
        fewer multiply-adds by forming G_i first (T rows cols, then P_out G_i P_in^T) than by
        the outer sum of the projected sides (T (k_out rows + k_in cols + k)). Both give the
        same map, up to rounding. LeNet's first convolution (6 x 75 over 784 positions, k =
        1024): 0.4 M against 8.4 M per example; a transformer's 128 x 128 Linear over 64
        positions: 1.7 M against 0.6 M, so the outer sum stays."""
        rows, cols, k_out, k_in = self.rows, self.cols, self.k_out, self.k_in
        outer = positions * (k_out * rows + k_in * cols + k_out * k_in)
        materialised = positions * rows * cols + rows * cols * k_in + k_out * rows * k_in
        return materialised < outer

    def outer_product_sides(self, factor: OuterProductFactor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, k_out, R) P_out D_ir and (B, k_in, R) P_in A_ir (R = T G rows per example, the
        map's scale not applied) for g_i = sum_t D_it A_it^T (per group)."""
        b, t, g, p = factor.inputs.shape
        q = factor.out_features
        if g * q != self.rows or p != self.cols:
            raise ValueError(
                f"a layer factors this parameter as {g} group(s) of {q} x {p}, which does not "
                f"fit its sketch's {self.rows} x {self.cols} matrix view"
            )
        right = _project(factor.inputs.reshape(b, t * g, p), self.p_in)  # (B, k_in, T G)
        if g == 1:
            left = _project(factor.output_grads.reshape(b, t, q), self.p_out)  # (B, k_out, T)
        else:  # each group meets its own block of P_out's columns
            d = factor.output_grads
            left = torch.einsum("btgq,kgq->bktg", d, self.p_out.reshape(self.k_out, g, q))
            left = left.reshape(b, self.k_out, t * g)
        return left, right

    def embedding_sides(self, factor: EmbeddingFactor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, k_out, T) gathered columns of P_out and (B, k_in, T) P_in D_it, as
        ``outer_product_sides``."""
        b, t = factor.indices.shape
        rows = self.p_out.T.index_select(0, factor.indices.reshape(-1))  # (B T, k_out)
        left = rows.reshape(b, t, self.k_out).transpose(1, 2)  # (B, k_out, T)
        right = _project(factor.output_grads.reshape(b, t, -1), self.p_in)  # (B, k_in, T)
        return left, right

    def _outer_sum(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """(B, k_out, R), (B, k_in, R) -> (B, k): the map's scale times sum_r left_r kron
        right_r."""
        out = left.new_zeros(left.shape[0], self.k_out * self.k_in)
        self.add_outer_sum(out, left, right, 1.0)
        return out

    def add_outer_sum(
        self, out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
    ) -> None:
        """In place: (B, k) ``out`` += ``scale`` times the ``_outer_sum`` of the two sides,
        without a (B, k) temporary (one row per example: a broadcast product, no batched GEMM)."""
        out3 = out.view(out.shape[0], self.k_out, self.k_in)
        if left.shape[2] == 1:
            out3.addcmul_(left, right.transpose(1, 2), value=self.scale * scale)
        else:
            out3.baddbmm_(left, right.transpose(1, 2), alpha=self.scale * scale)

    def matrix(self) -> torch.Tensor:
        """The (k, rows * cols) matrix of the map in float64 (for checks: k times the parameter's
        size). Built by broadcasting, not ``torch.kron``, which fails on a side of one column
        whose strides are not the contiguous ones (a one-row weight's orthogonal side)."""
        p_out, p_in = self.p_out.double(), self.p_in.double()
        product = p_out[:, None, :, None] * p_in[None, :, None, :]  # (k_out, k_in, rows, cols)
        return product.reshape(self.k_out * self.k_in, self.rows * self.cols) * self.scale


class CountSketchMap:
    """S_p x = sum_j sign_j x_j e_{bucket_j}: each coordinate to one of k, with a random sign.

    Attributes:
        buckets: (n,) int64 in [0, k).  signs: (n,) +-1.
    """

    def __init__(self, numel: int, dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.buckets = torch.randint(0, dim, (numel,), generator=gen)
        self.signs = torch.randint(0, 2, (numel,), generator=gen).float() * 2 - 1

    def to(self, device: torch.device, dtype: torch.dtype) -> CountSketchMap:
        self.buckets = to_device(self.buckets, device)
        self.signs = to_device(self.signs.to(dtype), device)
        return self

    def dense(self, grads: torch.Tensor) -> torch.Tensor:
        """(B, n) per-example gradients -> (B, k)."""
        g = grads.reshape(grads.shape[0], -1).to(self.signs.dtype) * self.signs
        out = g.new_zeros(g.shape[0], self.dim)
        return out.index_add_(1, self.buckets, g)

    def matrix(self) -> torch.Tensor:
        """The (k, n) matrix of the map, in float64."""
        out = torch.zeros(self.dim, self.buckets.numel(), dtype=torch.float64)
        out[self.buckets.cpu(), torch.arange(self.buckets.numel())] = self.signs.cpu().double()
        return out


_Map = KroneckerMap | CountSketchMap


def maps_fingerprint(shapes: Mapping[str, torch.Size], dim: int, seed: int) -> str:
    """A short digest of what the maps are drawn from: the parameters' canonical names and
    shapes (in name order), k, the seed and the maps' version. Equal fingerprints, equal maps."""
    described = [_MAPS_VERSION, dim, seed, sorted((n, list(s)) for n, s in shapes.items())]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def check_saved_maps(where: str, state: Any, config: Mapping[str, Any]) -> None:
    """Raise unless a saved sampler ``state`` balanced sketches drawn from the maps this
    sampler's ``config`` describes. Only the maps' identity is checked here, where the rest of
    the configuration agrees (the sampler's own check names any other difference: a seed or
    sketch_dim of its own); nothing to check for a sampler without sketches."""
    ours = config.get("sketch_fingerprint")
    saved = state.get("config") if isinstance(state, Mapping) else None
    if ours is None or not isinstance(saved, Mapping):
        return
    theirs = saved.get("sketch_fingerprint")
    others = {k for k in set(saved) | set(config) if k != "sketch_fingerprint"}
    if theirs == ours or any(saved.get(k) != config.get(k) for k in others):
        return
    why = (
        "records no fingerprint of its maps (saved by an older grabkit)"
        if theirs is None
        else f"was balanced on sketches from other random maps (fingerprint {theirs!r}, this "
        f"sampler's {ours!r})"
    )
    raise ValueError(
        f"{where}.load_state_dict: the state {why}; continuing would mix sketches of two maps. "
        f"The maps are a function of the trainable parameters' names and shapes, the seed and "
        f"sketch_dim: build the sampler on the same model with the same trainable parameters, "
        f"seed and sketch_dim (torch.compile, DDP, FSDP and activation-checkpoint wrappers are "
        f"looked through, so they need not match)."
    )


#: changes whenever the maps drawn for a (seed, name, shape, dim) change: saved states record it
_MAPS_VERSION = 1


class GradientSketch:
    """The fixed random map S: R^d -> R^k of a model's trainable parameters, applied to factors.

    Args:
        param_shapes: name -> shape of every trainable parameter (``PerSampleStats.param_shapes``).
        dim: k, the sketch width (``kronecker_factors`` splits it for matrix parameters).
        seed: with each parameter's canonical name, seeds its map.
        canonical_names: name -> the parameter's name with wrappers looked through
            (``grabkit.stats.names.canonical_parameter_names``; default: the names as given),
            so that a compiled, DDP-, FSDP- or checkpoint-wrapped model draws the plain model's
            maps.

    ``config`` is the plain description a saved state records, with ``fingerprint`` (of the
    canonical names, shapes, seed and k: the maps' identity); ``map_for(name)`` the map of one
    parameter (drawn on first use, on the CPU in float32).
    """

    def __init__(
        self,
        param_shapes: Mapping[str, torch.Size],
        dim: int,
        seed: int,
        *,
        canonical_names: Mapping[str, str] | None = None,
    ) -> None:
        kronecker_factors(dim)  # validates dim
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"`seed` should be an int, but got seed={seed!r}")
        self.dim, self.seed = dim, seed
        self.param_shapes = {name: torch.Size(s) for name, s in param_shapes.items()}
        given = canonical_names or {}
        self.canonical_names = {name: given.get(name, name) for name in self.param_shapes}
        self.fingerprint = maps_fingerprint(
            {self.canonical_names[n]: s for n, s in self.param_shapes.items()}, dim, seed
        )
        self._cpu: dict[str, _Map] = {}
        self._moved: dict[tuple[str, torch.device, torch.dtype], _Map] = {}
        self._concatenated: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def config(self) -> dict[str, Any]:
        return {
            "sketch_dim": self.dim,
            "sketch_maps": _MAPS_VERSION,
            "sketch_fingerprint": self.fingerprint,
        }

    def map_for(self, name: str) -> _Map:
        """The map of parameter ``name``, on the CPU in float32."""
        if name not in self._cpu:
            shape = self.param_shapes[name]
            seed = _seed_of(self.seed, self.canonical_names[name])
            if len(shape) >= 2:
                rows = int(shape[0])
                cols = shape.numel() // rows
                k_out, k_in = kronecker_split(rows, cols, self.dim)
                self._cpu[name] = KroneckerMap(rows, cols, k_out, k_in, seed)
            else:
                self._cpu[name] = CountSketchMap(shape.numel(), self.dim, seed)
        return self._cpu[name]

    def _map_on(self, name: str, device: torch.device, dtype: torch.dtype) -> _Map:
        key = (name, device, dtype)
        if key not in self._moved:
            cpu = self.map_for(name)
            moved = type(cpu).__new__(type(cpu))
            moved.__dict__.update(cpu.__dict__)
            self._moved[key] = moved.to(device, dtype)
        return self._moved[key]

    def matrix(self) -> torch.Tensor:
        """The (k, d) matrix of S in the flat layout, in float64 (for checks on small models)."""
        return torch.cat([self.map_for(name).matrix() for name in self.param_shapes], dim=1)

    @torch.no_grad()
    def apply_dense(self, grads: torch.Tensor) -> torch.Tensor:
        """(B, d) per-example gradients in the flat layout -> (B, k), parameter by parameter."""
        out, offset = None, 0
        for name, shape in self.param_shapes.items():
            n = shape.numel()
            part = grads[:, offset : offset + n]
            offset += n
            m = self._map_on(name, grads.device, compute_dtype(grads.dtype))
            sketched = m.dense(part)
            out = sketched if out is None else out + sketched
        return out

    @torch.no_grad()
    def apply(
        self,
        factors: Mapping[str, ParameterFactor | None],
        batch_size: int,
        scale: float = 1.0,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """(B, k) ``scale * sum_p S_p g_i^(p)`` from each parameter's factor (None: no gradient).

        ``dtype`` is the statistics' dtype (at least float32); factors in another dtype are
        mapped in their own compute dtype and the result cast.

        One (B, k) result is accumulated in place, ``scale`` folded into each part: the first
        Kronecker part of a plain Linear writes it (no zero fill), every Kronecker part adds its
        outer products with one fused op (no (B, k) temporary per layer), and the per-example
        gradients of every CountSketched parameter (biases) go through one concatenated
        scatter-add, so a step costs a few small ops per layer (what dominates small models,
        whose projections are cheap). A grouped batch's factors (``RowsFactor``) are sketched
        group by group, each group's rows put at its items.
        """
        layout = next((f.layout for f in factors.values() if isinstance(f, RowsFactor)), None)
        if layout is not None:
            return self._apply_by_group(factors, layout, scale, device=device, dtype=dtype)
        out = torch.empty(batch_size, self.dim, device=device, dtype=dtype)
        written = False  # whether ``out`` holds a sum yet (else its contents are undefined)
        counted: list[tuple[str, torch.Tensor]] = []  # CountSketched (name, (B, n) grads)
        for name, factor in factors.items():
            if factor is None:
                continue
            m = self._direct_map(name, factor, out)
            if isinstance(m, CountSketchMap) and isinstance(factor, PerExampleFactor):
                counted.append((name, factor.grads))
                continue
            written = self._add_factor(out, written, name, factor, m, scale)
        if not written:
            out.zero_()
        if counted:
            self._add_counted(out, counted, scale)
        return out

    def _apply_by_group(
        self,
        factors: Mapping[str, ParameterFactor | None],
        layout: ItemLayout,
        scale: float,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """(n, k) sketches of a grouped batch: each group's factors sketched as one batch of its
        rows, the rows of its items added in the batch's item order (a whole-batch segment adds
        to every item; no item's row: dropped)."""
        out = torch.zeros(layout.size, self.dim, device=device, dtype=dtype)
        for s, group in enumerate(layout.groups):
            parts = {
                name: f.parts[s] if isinstance(f, RowsFactor) else None
                for name, f in factors.items()
            }
            if all(part is None for part in parts.values()):
                continue
            rows = self.apply(parts, group.rows, scale, device=device, dtype=dtype)
            index = layout.index(s, device)
            out.index_add_(0, index, rows[: len(index)])  # S is linear: segments add
        return out

    def _direct_map(
        self, name: str, factor: ParameterFactor, out: torch.Tensor
    ) -> KroneckerMap | CountSketchMap | None:
        """The parameter's map when its factor can be added straight into ``out`` (same dtype
        and device, not a tied sum), else None."""
        if isinstance(factor, SumFactor):
            return None
        tensor = _first_tensor(factor)
        if tensor.dtype != out.dtype or tensor.device != out.device:
            return None
        return self._map_on(name, tensor.device, tensor.dtype)

    def _add_factor(
        self,
        out: torch.Tensor,
        written: bool,
        name: str,
        factor: ParameterFactor,
        m: KroneckerMap | CountSketchMap | None,
        scale: float,
    ) -> bool:
        """Add ``scale * S_p g_i^(p)`` of one parameter into ``out`` (B, k), or write it there
        when nothing is ``written`` yet; returns True (``out`` now holds a sum)."""
        kronecker = isinstance(m, KroneckerMap)
        outer = isinstance(factor, OuterProductFactor)
        if kronecker and outer and m.add_outer_product(out, factor, scale, overwrite=not written):
            return True  # a plain Linear's sketch, written or added in place
        if not written:
            out.zero_()
        if kronecker and outer:
            m.add_outer_sum(out, *m.outer_product_sides(factor), scale)
        elif kronecker and isinstance(factor, EmbeddingFactor):
            m.add_outer_sum(out, *m.embedding_sides(factor), scale)
        else:  # a tied parameter's sum of uses, another dtype, another form
            out.add_(self._factor(name, factor).to(out.dtype), alpha=scale)
        return True

    def _add_counted(
        self, out: torch.Tensor, counted: list[tuple[str, torch.Tensor]], scale: float
    ) -> None:
        """Add the CountSketches of several parameters' (B, n) per-example gradients into
        ``out`` with one scatter-add."""
        names = tuple(n for n, _ in counted)
        buckets, signs = self._counted_maps(names, out.device, out.dtype, scale)
        grads = [g for _, g in counted]
        signed = torch.cat(grads, dim=1).mul_(signs) if len(grads) > 1 else grads[0] * signs
        out.index_add_(1, buckets, signed)  # (an alpha would take a slow path)

    def _counted_maps(
        self, names: tuple[str, ...], device: torch.device, dtype: torch.dtype, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CountSketch buckets (N,) and signs (N,) times ``scale`` of several parameters
        side by side (N their sizes added), built once per set of names, device, dtype and
        scale (the loss's B: the same every step)."""
        key = (names, device, dtype, scale)
        if key not in self._concatenated:
            if len(self._concatenated) >= 16:  # many batch sizes: keep the cache small
                self._concatenated.clear()
            maps = [self._map_on(name, device, dtype) for name in names]
            signs = torch.cat([m.signs for m in maps])
            self._concatenated[key] = (
                torch.cat([m.buckets for m in maps]),
                signs * scale if scale != 1.0 else signs,
            )
        return self._concatenated[key]

    def _factor(self, name: str, factor: ParameterFactor) -> torch.Tensor:
        if isinstance(factor, SumFactor):  # tied parameter: S_p is linear, sum the uses
            return sum(self._factor(name, part) for part in factor.parts)
        tensor = _first_tensor(factor)
        m = self._map_on(name, tensor.device, tensor.dtype)
        if isinstance(m, KroneckerMap):
            if isinstance(factor, OuterProductFactor):
                return m.outer_product(factor)
            if isinstance(factor, EmbeddingFactor):
                return m.embedding(factor)
        if isinstance(factor, PerExampleFactor):
            return m.dense(factor.grads)
        identity = torch.eye(factor.batch_size, device=tensor.device, dtype=tensor.dtype)
        return m.dense(factor.weighted_sum(identity))  # any other form, materialised


def _project(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(B, R, f) rows and a (k, f) projection -> (B, k, R) = P x_r for every row.

    Never copies ``x``: output gradients often arrive with each example stored transposed (a
    language model's head behind ``cross_entropy(logits.transpose(1, 2), ...)``), where folding
    B and R into one GEMM would first copy all B R f numbers. One row per example folds (a
    single GEMM, no copy needed).
    """
    b, r, f = x.shape
    if r == 1:
        return (x.reshape(b, f) @ p.T).unsqueeze(2)
    return torch.matmul(p, x.transpose(1, 2))


def _first_tensor(factor: ParameterFactor) -> torch.Tensor:
    for attribute in ("output_grads", "grads", "inputs"):
        t = getattr(factor, attribute, None)
        if isinstance(t, torch.Tensor):
            return t
    raise TypeError(f"cannot sketch a {type(factor).__name__}: it holds no tensor")


class SketchedStats(StatisticsSource):
    """Hook statistics read as sketches: after ``loss.backward()``, a (B, k) matrix S g_i.

    Args:
        model: the ``nn.Module`` (a ``DistributedDataParallel`` wrapper is looked through: the
            hooks go on the module inside, so DDP's buckets and ``no_sync`` are untouched).
        dim: k (default 1024 = 32 x 32).
        seed: seeds the maps (the same on every rank).
        loss_reduction: ``"mean"`` or ``"sum"``, as for ``PerSampleStats``.
        **options: passed on to ``PerSampleStats`` (``torch_func_fallback``, ...).

    ``gradient_batch()`` is a ``DenseGradientBatch`` of the (B, k) sketches, so anything that
    balances dense batches balances it. It is a ``StatisticsSource`` whose listeners, generation
    and ``backward_seen`` are the engine's, so gradient accumulation works as with exact
    statistics. The engine keeps no batch gradient copy (``keep_batch_gradients=False``); the
    identity check runs all the same (its probes of the delivered gradients are taken in the
    hooks). Parameters frozen or unfrozen later are followed: their maps drop out or join (each
    is a function of the seed and the parameter's name, so the others' do not change).

    Example::

        with SketchedStats(model, dim=1024) as stats:
            loss_fn(model(x), y).backward()
            s = stats.sketches()  # (B, 1024)
            approx_gram = s @ s.T  # unbiased for the (B, B) Gram matrix
    """

    def __init__(
        self,
        model: nn.Module,
        dim: int = 1024,
        seed: int = 0,
        loss_reduction: str = "mean",
        **options: Any,
    ) -> None:
        hooked = unwrap_data_parallel(model)
        self.engine = PerSampleStats(hooked, loss_reduction, keep_batch_gradients=False, **options)
        self._canonical = canonical_parameter_names(hooked)  # every parameter, trainable or not
        self.sketch = GradientSketch(
            self.engine.param_shapes, dim, seed, canonical_names=self._canonical
        )
        self.dim = dim
        self.step_listeners = self.engine.step_listeners
        self._cached: tuple[int, torch.Tensor] | None = None
        self._reads = CheckedReads()  # the host reads of the sketches, with their check

    @property
    def generation(self) -> int:
        """The engine's counter (the sketches change when its statistics do)."""
        return self.engine.generation

    @property
    def model(self) -> nn.Module:
        """The module the engine hooks (a ``DistributedDataParallel``'s inner module)."""
        return self.engine.model

    @property
    def loss_reduction(self) -> str:
        return self.engine.loss_reduction

    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def backward_seen(self) -> bool:
        return self.engine.backward_seen

    @property
    def step_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.engine.step_inputs

    @property
    def parameter_gradients_seen(self) -> bool:
        return self.engine.parameter_gradients_seen

    @property
    def backward_mark(self) -> BackwardMark | None:
        return self.engine.backward_mark

    @property
    def stepped_since_backward(self) -> bool:
        return self.engine.stepped_since_backward

    def batch_term(self, term: torch.Tensor) -> torch.Tensor:
        """Declare a loss term that is not a sum over examples (``PerSampleStats.batch_term``):
        its gradient is left out of every example's sketch. Returns ``term``."""
        return self.engine.batch_term(term)

    def sketches(self) -> torch.Tensor:
        """(B, k) S g_i of the latest backward (computed on first read, then cached), after
        the identity check of its statistics has passed."""
        matrix = self._sketches(defer=False)
        self.settle()
        return matrix

    def _sketches(self, *, defer: bool) -> torch.Tensor:
        """The sketches; with ``defer`` a check of the statistics is left pending (compared by
        ``to_host`` or ``settle``)."""
        generation = self.engine.generation
        if self._cached is None or self._cached[0] != generation:
            self.settle()  # a check left pending by the previous backward is compared first
            factors, batch_size, scale, pending = self.engine.checked_step_factors(defer=defer)
            if self.sketch.param_shapes != self.engine.param_shapes:  # the trainable set changed
                self.sketch = GradientSketch(
                    self.engine.param_shapes, self.dim, self.sketch.seed,
                    canonical_names=self._canonical,
                )  # fmt: skip
            dtype = compute_dtype(self.engine.dtype)
            matrix = self.sketch.apply(
                factors, batch_size, scale, device=self.engine.device, dtype=dtype
            )
            self._cached, self._reads = (generation, matrix), CheckedReads(pending)
        return self._cached[1]

    def settle(self) -> None:
        """Compare a pending identity check now (a host transfer; ``IdentityCheckError`` on a
        mismatch, again at every call until the next backward)."""
        self._reads.settle()

    def gradient_batch(self, *, settle: bool = True) -> DenseGradientBatch:
        """The sketches as a ``DenseGradientBatch`` (B rows of k numbers). ``settle=False``
        leaves the identity check pending on the batch: it is compared in the consumer's one
        host transfer (``batch.to_host``), before any value reaches the host."""
        matrix = self._sketches(defer=not settle)
        if settle:
            self.settle()
            return DenseGradientBatch(matrix)
        return DenseGradientBatch(matrix, reads_through=self._reads)

    def close(self) -> None:
        self.engine.close()
        self._cached = None

    def __enter__(self) -> SketchedStats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
