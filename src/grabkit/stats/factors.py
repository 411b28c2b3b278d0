"""Exact per-example gradient algebra for one parameter, from the factors autograd already has.

Every built-in layer rule describes the per-example gradients of a parameter in one of three
forms, each answering the four reads (norms, Gram, dots with a few vectors, weighted sums)
without a (B, d) tensor for the whole model:

* ``OuterProductFactor``: g_i = sum_t D[i, t] A[i, t]^T (Linear, Conv via unfold), per group;
* ``EmbeddingFactor``:    g_i = sum_t onehot(idx[i, t]) D[i, t]^T (Embedding rows);
* ``PerExampleFactor``:   g_i given outright (biases, normalisation affine parameters: small).

A factor also ``merge``\\ s with the factor of another call of the same layer (a layer used twice
in one forward), because the per-example gradient is then the sum over both calls. Optionally it
offers ``add_weighted_sum_to(weights, target)`` (the weighted sum added into ``target`` in place,
as running sums are updated every step); ``StepStatistics`` falls back to ``weighted_sum`` and an
addition for factors without it.

Shapes: B examples, T positions per example (1 for plain vectors), G groups, p inputs and q
outputs per group, k vectors. Parameters are addressed through their own shape ``param_shape``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = [
    "EmbeddingFactor",
    "OuterProductFactor",
    "ParameterFactor",
    "PerExampleFactor",
    "SumFactor",
    "as_dtype",
    "combine",
    "compute_dtype",
    "embedding_linear_cross",
]

# The (N, N) equality and inner-product blocks the Embedding Gram matrix builds are processed in
# row chunks of at most this many entries, so memory stays bounded for long sequences.
_EMBEDDING_GRAM_CHUNK_ENTRIES = 1 << 24

_STRATEGIES = ("auto", "ghost", "materialise")


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, copied into ``out`` when one is given."""
    if out is None:
        return result
    return out.copy_(result)


# dtype -> compute dtype: a dict read, not a tensor operation, for every factor of every step
_COMPUTE_DTYPES: dict[torch.dtype, torch.dtype] = {}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in at least float32 (half / bfloat16 activations under autocast)."""
    found = _COMPUTE_DTYPES.get(dtype)
    if found is None:
        found = _COMPUTE_DTYPES[dtype] = torch.promote_types(dtype, torch.float32)
    return found


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each ``t[i]`` is contiguous (``t[0].is_contiguous()`` without making a view)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` already has it (reads run every step)."""
    return t if t.dtype == dtype else t.to(dtype)


class ParameterFactor(Protocol):
    """Per-example gradients g_1..g_B of one parameter, read only through inner products."""

    batch_size: int
    param_shape: torch.Size

    def norms_squared(self) -> torch.Tensor:
        """(B,) entries ||g_i||^2."""
        ...

    def gram(self) -> torch.Tensor:
        """(B, B) entries <g_i, g_j>."""
        ...

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        """(k, *param_shape) vectors -> (B, k) entries <g_i, v_j>."""
        ...

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(B, k) weights -> (k, *param_shape) rows sum_i w[i, j] g_i.

        ``out``, when given, is a (k, *param_shape) tensor (possibly a view into a larger flat
        buffer) that receives the result and is returned.
        """
        ...

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        """The factor of g_i + h_i, where ``other`` holds h_i from another call of the layer."""
        ...


class PerExampleFactor:
    """Per-example gradients held outright as a (B, *param_shape) tensor.

    Used for parameters whose size is a small multiple of a layer's width (biases, affine
    parameters of normalisation layers), where materialising B copies costs little.

    ``output_of``: the weight factor of the same layer call when ``grads`` are exactly its output
    gradients (a Linear bias on plain vectors): the Gram matrix of both is then the same (B, B)
    matrix, computed once (``OuterProductFactor.output_gram``).

    ``positions`` and ``terms``, for a rule whose rows are sums over positions (a bias over a
    sequence, a normalisation layer): the number of positions summed per example, and a callable
    returning the sum over all (example, position) terms of their 2-norms (or an upper bound).
    The identity check's rounding tolerance (``grabkit.stats.identity``) is taken from the terms
    a sum was formed of; without them each row counts as one term. ``terms`` is only called when
    the check's cheap bound does not already settle it.
    """

    def __init__(
        self,
        grads: torch.Tensor,
        param_shape: torch.Size,
        *,
        output_of: OuterProductFactor | None = None,
        positions: int = 1,
        terms: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.batch_size = grads.shape[0]
        self.param_shape = torch.Size(param_shape)
        rows = grads if grads.dim() == 2 else grads.reshape(self.batch_size, -1)  # (B, n)
        self.grads = as_dtype(rows, compute_dtype(grads.dtype))
        self._output_of = output_of
        self.positions = positions
        self.terms = terms

    def norms_squared(self) -> torch.Tensor:
        return (self.grads * self.grads).sum(dim=1)

    def gram(self) -> torch.Tensor:
        if self._output_of is not None:
            return self._output_of.output_gram()
        return self.grads @ self.grads.T

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        rows = vectors if vectors.dim() == 2 else vectors.reshape(vectors.shape[0], -1)
        flat = as_dtype(rows, self.grads.dtype)  # (k, n)
        return self.grads @ flat.T

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = as_dtype(weights, self.grads.dtype).T @ self.grads  # (k, n)
        return _deliver(rows.reshape(weights.shape[1], *self.param_shape), out)

    def add_weighted_sum_to(self, weights: torch.Tensor, target: torch.Tensor) -> None:
        """In place: ``target`` (k, *param_shape) += ``weighted_sum(weights)``, by one GEMM
        accumulating into it where its rows can be viewed flat in the factors' dtype."""
        k = weights.shape[1]
        w = as_dtype(weights, self.grads.dtype).T  # (k, B)
        if k and target.dtype == self.grads.dtype and _rows_contiguous(target):
            (target if target.dim() == 2 else target.view(k, -1)).addmm_(w, self.grads)
        else:
            target.add_((w @ self.grads).reshape(target.shape).to(target.dtype))

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, PerExampleFactor):
            raise TypeError(f"cannot merge PerExampleFactor with {type(other).__name__}")
        merged = PerExampleFactor.__new__(PerExampleFactor)
        merged.batch_size = self.batch_size
        merged.param_shape = self.param_shape
        merged.grads = self.grads + other.grads
        merged._output_of = None
        merged.positions = self.positions + other.positions
        merged.terms = _summed_terms(self, other)
        return merged


def _summed_terms(
    first: PerExampleFactor, second: PerExampleFactor
) -> Callable[[], torch.Tensor] | None:
    """The ``terms`` of two merged per-example factors (None where both count rows as terms)."""
    if first.terms is None and second.terms is None:
        return None

    def terms() -> torch.Tensor:
        parts = [
            f.terms() if f.terms is not None else torch.linalg.vector_norm(f.grads, dim=1).sum()
            for f in (first, second)
        ]
        return parts[0] + parts[1]

    return terms


class OuterProductFactor:
    """g_i = sum_t D[i, t] A[i, t]^T per group: the weight of a Linear or an unfolded Conv.

    Args:
        inputs: A, (B, T, G, p) layer inputs (unfolded patches for a convolution); or (B, p)
            for one position and one group (a Linear on plain vectors), with (B, q)
            ``output_grads``: held as they are, the (B, 1, 1, f) forms made only when read.
        output_grads: D, (B, T, G, q) gradients of the layer's outputs.
        param_shape: the parameter's shape; its elements, read in order, are the (G, q, p) blocks.
        strategy: ``"auto"`` (the cheaper form below, per read), ``"ghost"`` or ``"materialise"``.

    The norms and the Gram matrix pick, per layer and per read, the cheaper of two exact forms:

    * ghost: <g_i, g_j> = sum_{t, s} (A_it . A_js)(D_it . D_js), about T^2 (p + q) multiply-adds
      per pair of examples (Li et al. 2021, "ghost norm");
    * materialised: build this layer's (B, G q p) per-example gradients transiently,
      B T p q multiply-adds, then their norms (B p q) or Gram matrix (B^2 p q).

    For plain vectors (T = 1) ghost always wins; for the norms of sequences it wins while
    T (p + q) < p q (short sequences through wide layers). Dots and weighted sums are one
    batched GEMM over the B T positions for all k vectors, except where the per-example
    gradients are no larger than the factors (a convolution's small kernel slid over many
    positions): they are then materialised once for the step and every read takes B rows
    instead of B T (``_per_example_grads``).
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        output_grads: torch.Tensor,
        param_shape: torch.Size,
        strategy: str = "auto",
    ) -> None:
        if strategy not in _STRATEGIES:
            raise ValueError(f"`strategy` should be one of {_STRATEGIES}, but got {strategy!r}")
        self.strategy = strategy
        dtype = inputs.dtype
        if output_grads.dtype != dtype:
            dtype = torch.promote_types(dtype, output_grads.dtype)
        #: of ``inputs`` and ``output_grads``: the compute dtype of both
        self.dtype = dtype = compute_dtype(dtype)
        self.out_features = output_grads.shape[-1]
        self.param_shape = torch.Size(param_shape)
        self._output_gram: torch.Tensor | None = None
        self._kept_grads: torch.Tensor | None = None  # see _per_example_grads
        # (N, p) and (N, q) views, kept once made (or the caller's own 2-D tensors)
        self._flat_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._inputs: torch.Tensor | None = None
        self._output_grads: torch.Tensor | None = None
        if inputs.dim() == 2:  # one position, one group: the (B, 1, 1, f) views made if read
            self.batch_size, self.in_features = inputs.shape
            self.positions = self.groups = 1
            self._flat_views = (as_dtype(inputs, dtype), as_dtype(output_grads, dtype))
            return
        self._inputs = as_dtype(inputs, dtype)
        self._output_grads = as_dtype(output_grads, dtype)
        self.batch_size, self.positions, self.groups, self.in_features = inputs.shape

    @property
    def inputs(self) -> torch.Tensor:
        """A, (B, T, G, p)."""
        if self._inputs is None:
            a = self._flat_views[0]
            self._inputs = a.view(self.batch_size, 1, 1, self.in_features)
        return self._inputs

    @property
    def output_grads(self) -> torch.Tensor:
        """D, (B, T, G, q)."""
        if self._output_grads is None:
            d = self._flat_views[1]
            self._output_grads = d.view(self.batch_size, 1, 1, self.out_features)
        return self._output_grads

    # -- helpers ---------------------------------------------------------------------------------
    def _use_ghost(self, pairs: int) -> bool:
        """Whether the ghost form is cheaper for ``pairs`` pairs of examples (B or B^2)."""
        if self.strategy != "auto":
            return self.strategy == "ghost"
        b, t, p, q = self.batch_size, self.positions, self.in_features, self.out_features
        ghost = pairs * t * t * (p + q)
        materialised = b * t * p * q + pairs * p * q
        return ghost < materialised

    def _materialised(self) -> torch.Tensor:
        """(B, G q p) per-example gradients of this layer (transient).

        For one group the entries may come transposed, (p, q) per example: the batched GEMM
        runs faster with the wider side last, and norms and Gram matrices do not see the order.
        """
        b, p, q = self.batch_size, self.in_features, self.out_features
        if self.groups == 1:
            a = self.inputs.reshape(b, -1, p)
            d = self.output_grads.reshape(b, -1, q)
            grads = torch.bmm(a.transpose(1, 2), d) if q >= p else torch.bmm(d.transpose(1, 2), a)
            return grads.reshape(b, -1)
        grads = torch.einsum("btgq,btgp->bgqp", self.output_grads, self.inputs)
        return grads.reshape(b, -1)

    def _per_example_grads(self) -> torch.Tensor | None:
        """(B, q, p) per-example gradients, kept for the step, where they are worth keeping: one
        group, several positions, no more numbers than the factors hold (B q p <= B T (p + q)),
        so one pass of B T p q multiply-adds replaces one per dot or weighted sum; else None."""
        t, p, q = self.positions, self.in_features, self.out_features
        if self.groups != 1 or t == 1 or self.strategy != "auto" or p * q > t * (p + q):
            return None
        return self.per_example_grads()

    def per_example_grads(self) -> torch.Tensor:
        """(B, q, p) per-example gradients in the parameter's layout, sum_t D_it A_it^T, formed
        by one batched GEMM (B T p q multiply-adds) and kept for the step. One group only: a
        grouped layer's gradients are blocks (``_materialised``)."""
        if self.groups != 1:
            raise ValueError(
                f"per_example_grads() forms one group's (B, q, p) gradients, but this factor "
                f"has {self.groups} groups"
            )
        if self._kept_grads is None:
            b, p, q = self.batch_size, self.in_features, self.out_features
            a = self.inputs.reshape(b, -1, p)
            d = self.output_grads.reshape(b, -1, q)
            self._kept_grads = torch.bmm(d.transpose(1, 2), a)  # (B, q, p): parameter layout
        return self._kept_grads

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, G, f) -> (G, B T, f): one row per (example, position), grouped first."""
        return t.reshape(-1, self.groups, t.shape[-1]).transpose(0, 1)

    def flat_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For one group: (B T, p) inputs and (B T, q) output gradients, as 2-D views.

        Plain matrix products on these run as single GEMMs, without the batched-matmul
        dispatch the grouped (G, N, f) layout needs.
        """
        if self._flat_views is None:
            self._flat_views = (
                self.inputs.reshape(-1, self.in_features),
                self.output_grads.reshape(-1, self.out_features),
            )
        return self._flat_views

    def _per_example(self, per_row: torch.Tensor) -> torch.Tensor:
        """(B T, k) values per (example, position) -> (B, k) sums over the positions."""
        if self.positions == 1:
            return per_row
        return per_row.reshape(self.batch_size, self.positions, -1).sum(dim=1)

    # -- reads -----------------------------------------------------------------------------------
    def norms_squared(self) -> torch.Tensor:
        if self.positions == 1 and self.strategy != "materialise":  # ||d a^T||^2 = |d|^2 |a|^2
            a_a = (self.inputs * self.inputs).sum(dim=-1)  # (B, 1, G)
            d_d = (self.output_grads * self.output_grads).sum(dim=-1)
            return (a_a * d_d).sum(dim=(1, 2))
        if self._use_ghost(self.batch_size):
            a_a = torch.einsum("btgp,bsgp->bgts", self.inputs, self.inputs)
            d_d = torch.einsum("btgq,bsgq->bgts", self.output_grads, self.output_grads)
            return (a_a * d_d).sum(dim=(1, 2, 3))
        kept = self._per_example_grads()
        grads = self._materialised() if kept is None else kept.reshape(self.batch_size, -1)
        return (grads * grads).sum(dim=1)

    def output_gram(self) -> torch.Tensor:
        """(B, B) <D_i, D_j> for one position and one group, computed once: the Gram matrix of
        a bias whose per-example gradients are these output gradients, and a factor of this
        weight's own ghost Gram matrix."""
        if self.positions != 1 or self.groups != 1:
            raise ValueError(
                f"output_gram() needs one position and one group, but this factor has "
                f"{self.positions} positions and {self.groups} groups"
            )
        if self._output_gram is None:
            d = self.flat_rows()[1]  # (B, q): one row per example here
            self._output_gram = torch.mm(d, d.T)
        return self._output_gram

    def gram(self) -> torch.Tensor:
        b, t = self.batch_size, self.positions
        if self._use_ghost(b * b):
            if self.groups == 1 and t == 1:
                a = self.flat_rows()[0]  # (B, p)
                return torch.mm(a, a.T).mul_(self.output_gram())  # (B, B)
            if self.groups == 1:
                a, d = self.flat_rows()  # (N, p), (N, q)
                pairs = torch.mm(a, a.T).mul_(torch.mm(d, d.T))  # (N, N)
            else:
                a = self._rows(self.inputs)  # (G, N, p)
                d = self._rows(self.output_grads)  # (G, N, q)
                pairs = ((a @ a.transpose(1, 2)) * (d @ d.transpose(1, 2))).sum(dim=0)
            return pairs if t == 1 else pairs.reshape(b, t, b, t).sum(dim=(1, 3))
        kept = self._per_example_grads()
        grads = self._materialised() if kept is None else kept.reshape(b, -1)
        return grads @ grads.T

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        k = vectors.shape[0]
        g, p, q = self.groups, self.in_features, self.out_features
        vectors = as_dtype(vectors, self.dtype)
        kept = self._per_example_grads()
        # (N, p), (N, q) views where the GEMMs below read them: for a convolution's permuted
        # patches they are copies, which the kept per-example gradients make unnecessary
        a, d = self.flat_rows() if g == 1 and kept is None else (None, None)
        if g == 1 and k == 1 and kept is None:  # one GEMM, contracting the wider side first
            v = vectors.reshape(q, p)  # a view, not a copy
            if p <= q:
                per_row = torch.mm(d, v).mul_(a).sum(dim=1, keepdim=True)  # (N, 1)
            else:
                per_row = torch.mm(a, v.T).mul_(d).sum(dim=1, keepdim=True)
            return self._per_example(per_row)
        v = vectors.reshape(k, g, q, p)  # a view, not a copy
        if kept is not None:  # (B, q p) @ (q p, k)
            return torch.mm(kept.reshape(self.batch_size, -1), v.reshape(k, q * p).T)
        if g == 1 and q <= p and v.is_contiguous():
            # One GEMM for all k: A [V_1; ..; V_k]^T -> (N, k q), then contract with D. (Rows
            # cut from a longer flat vector are not contiguous; the batched forms below read
            # them in place rather than copying them.)
            projected = torch.mm(a, v.reshape(k * q, p).T)
            return self._per_example((projected.view(-1, k, q) * d.unsqueeze(1)).sum(dim=-1))
        a = self._rows(self.inputs)  # (G, N, p)
        d = self._rows(self.output_grads)  # (G, N, q)
        if p <= q:  # D^T V_j for every j: intermediate (k, G, N, p), narrower than k q
            per_row = ((d.unsqueeze(0) @ v) * a.unsqueeze(0)).sum(dim=-1).sum(dim=1)
        else:
            per_row = ((a.unsqueeze(0) @ v.transpose(-1, -2)) * d.unsqueeze(0)).sum(dim=-1)
            per_row = per_row.sum(dim=1)
        return self._per_example(per_row.T)  # (k, N) -> (B, k)

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        k = weights.shape[1]
        g, p, q = self.groups, self.in_features, self.out_features
        kept = self._per_example_grads()
        if kept is not None:  # (k, B) @ (B, q p)
            w = as_dtype(weights, kept.dtype)
            summed = torch.mm(w.T, kept.reshape(self.batch_size, -1))
            return _deliver(summed.reshape(k, *self.param_shape), out)
        w = self._row_weights(weights)
        if g == 1 and k == 1:  # one GEMM straight into the parameter layout
            lhs, rhs = self._single_sum_operands(w)
            if out is not None and out.is_contiguous() and out.dtype == lhs.dtype:
                return torch.mm(lhs, rhs, out=out.view(q, p)).view(out.shape)
            return _deliver((lhs @ rhs).reshape(1, *self.param_shape), out)
        if g == 1 and q <= p:
            # One GEMM for all k: [w_1 D, .., w_k D]^T A -> (k q, p), already in parameter layout.
            a, d = self.flat_rows()
            scaled = (d.unsqueeze(1) * w.unsqueeze(-1)).reshape(-1, k * q)
            return _deliver((scaled.T @ a).reshape(k, *self.param_shape), out)
        a = self._rows(self.inputs)  # (G, N, p)
        d = self._rows(self.output_grads)  # (G, N, q)
        w = w.T[:, None, :, None]  # (k, 1, N, 1)
        if q <= p:  # scale the narrower side by the weights
            blocks = (d.unsqueeze(0) * w).transpose(-1, -2) @ a.unsqueeze(0)  # (k, G, q, p)
        else:
            blocks = d.transpose(-1, -2).unsqueeze(0) @ (a.unsqueeze(0) * w)
        return _deliver(blocks.reshape(k, *self.param_shape), out)

    def _row_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """(B, k) weights per example -> (N, k) per (example, position) row, in the factors'
        dtype."""
        w = as_dtype(weights, self.dtype)
        if self.positions > 1:
            w = w.repeat_interleave(self.positions, dim=0)
        return w

    def _single_sum_operands(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, N) and (N, p) whose product is sum_n w_n D_n A_n^T, for (N, 1) row weights ``w``
        (one group): the narrower side carries the weights."""
        a, d = self.flat_rows()  # (N, p), (N, q)
        if self.out_features <= self.in_features:
            return (d * w).T, a
        return d.T, a * w

    def add_weighted_sum_to(self, weights: torch.Tensor, target: torch.Tensor) -> None:
        """In place: ``target`` (k, *param_shape) += ``weighted_sum(weights)``.

        One GEMM accumulating straight into ``target`` for a single weight column on one group;
        otherwise the sum is formed and added.
        """
        if (
            self.groups == 1
            and weights.shape[1] == 1
            and target.dtype == self.dtype
            and target.is_contiguous()
            and self._per_example_grads() is None
        ):
            lhs, rhs = self._single_sum_operands(self._row_weights(weights))
            target.view(self.out_features, self.in_features).addmm_(lhs, rhs)
            return
        target.add_(self.weighted_sum(weights).to(target.dtype))

    def two_valued_sum(
        self,
        rows: torch.Tensor,
        alpha: float,
        total: torch.Tensor,
        beta: float,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor | None:
        """(1, *param_shape) ``beta * total + alpha * sum_{i in rows} g_i``, or None if unsupported.

        The signed sums GraB accumulates (weights +-1) equal ``b * sum_i g_i + (a - b) *
        sum_{w_i = a} g_i``; with ``total`` the batch gradient autograd already formed (in the
        factors' scale), only the rarer rows (at most B / 2) go through the GEMM, written straight
        into ``out`` (added to it with ``accumulate``). Returns None (the caller takes the
        ordinary weighted sum) for grouped layers and when ``total`` or ``out`` is not a
        contiguous tensor in the factors' dtype.
        """
        if self.groups != 1 or total.dtype != self.dtype:
            return None
        if out is not None and not (out.is_contiguous() and out.dtype == total.dtype):
            return None
        q, p = self.out_features, self.in_features
        if self.positions == 1:  # one row per example: pick from the (B, f) views
            flat_a, flat_d = self.flat_rows()
            d, a = flat_d.index_select(0, rows), flat_a.index_select(0, rows)
        else:
            d = self.output_grads.index_select(0, rows).reshape(-1, q)  # (|rows| T, q)
            a = self.inputs.index_select(0, rows).reshape(-1, p)  # (|rows| T, p)
        base = total if total.shape == (q, p) else total.reshape(q, p)
        if out is None:
            out = torch.empty(1, *self.param_shape, dtype=total.dtype, device=total.device)
        target = out.view(q, p)
        if accumulate:
            target.addmm_(d.T, a, alpha=alpha).add_(base, alpha=beta)
        else:
            torch.addmm(base, d.T, a, beta=beta, alpha=alpha, out=target)
        return out

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, OuterProductFactor):
            raise TypeError(f"cannot merge OuterProductFactor with {type(other).__name__}")
        return OuterProductFactor(
            torch.cat([self.inputs, other.inputs], dim=1),
            torch.cat([self.output_grads, other.output_grads], dim=1),
            self.param_shape,
            self.strategy,
        )


class EmbeddingFactor:
    """g_i = sum_t onehot(idx[i, t]) D[i, t]^T: the weight of an ``nn.Embedding``.

    Args:
        indices: (B, T) looked-up rows.
        output_grads: (B, T, dim) gradients of the looked-up vectors (zero at ``padding_idx``).
        param_shape: (num_embeddings, dim).

    Never materialised over the whole table (B x num_embeddings x dim would be the largest tensor
    in the model): <g_i, g_j> = sum_{t, s} [idx_it == idx_js] (D_it . D_js), or on the CPU, when
    smaller, from each example's gradient restricted to the U rows the batch looked up (B x U x
    dim, U < T^2 and at most 2^24 numbers).
    """

    def __init__(
        self, indices: torch.Tensor, output_grads: torch.Tensor, param_shape: torch.Size
    ) -> None:
        self.indices = indices
        self.output_grads = output_grads.to(compute_dtype(output_grads.dtype))
        self.batch_size, self.positions = indices.shape
        self.param_shape = torch.Size(param_shape)

    def norms_squared(self) -> torch.Tensor:
        same = self.indices.unsqueeze(2) == self.indices.unsqueeze(1)  # (B, T, T)
        d_d = self.output_grads @ self.output_grads.transpose(1, 2)  # (B, T, T)
        return (d_d * same).sum(dim=(1, 2))

    def gram(self) -> torch.Tensor:
        b, t = self.batch_size, self.positions
        if b > 1 and self.indices.stride(0) == 0:
            # Every example looked up the same rows (positions shared by the batch, expanded):
            # <g_i, g_j> = <D_i, M D_j> with M[t, s] = [idx_t == idx_s], B T^2 dim multiply-adds
            # instead of (B T)^2 dim.
            first = self.indices[0]
            same = (first[:, None] == first[None, :]).to(self.output_grads.dtype)  # (T, T)
            mixed = torch.matmul(same, self.output_grads)  # (B, T, dim)
            return self.output_grads.reshape(b, -1) @ mixed.reshape(b, -1).T
        idx = self.indices.reshape(-1)  # (N,)
        d = self.output_grads.reshape(b * t, -1)  # (N, dim)
        if idx.device.type == "cpu":
            rows, inverse = torch.unique(idx, return_inverse=True)
            u, dim = rows.numel(), d.shape[1]
            if u < t * t and u * b * dim <= _EMBEDDING_GRAM_CHUNK_ENTRIES:
                # Each example's gradient on the U rows looked up in the batch: (B, U dim),
                # B^2 U dim multiply-adds instead of (B T)^2 dim (a host sync finds U, so
                # devices keep the form below).
                example = torch.arange(b, device=idx.device).repeat_interleave(t)
                per_example = d.new_zeros(b * u, dim)
                per_example.index_add_(0, example * u + inverse, d)
                flat = per_example.view(b, u * dim)
                return flat @ flat.T
        rows_per_chunk = max(t, (_EMBEDDING_GRAM_CHUNK_ENTRIES // max(1, b * t)) // t * t)
        pieces = []
        for start in range(0, b * t, rows_per_chunk):
            stop = min(start + rows_per_chunk, b * t)
            same = idx[start:stop, None] == idx[None, :]
            pairs = (d[start:stop] @ d.T) * same  # (chunk, N)
            pieces.append(pairs.reshape(-1, t, b, t).sum(dim=(1, 3)))
        return torch.cat(pieces, dim=0)

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        rows = vectors.to(self.output_grads.dtype)[:, self.indices]  # (k, B, T, dim)
        return (rows * self.output_grads.unsqueeze(0)).sum(dim=(2, 3)).T

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        k = weights.shape[1]
        w = weights.to(self.output_grads.dtype).T  # (k, B)
        values = w[:, :, None, None] * self.output_grads.unsqueeze(0)  # (k, B, T, dim)
        rows = self.output_grads.new_zeros(k, *self.param_shape)
        rows.index_add_(1, self.indices.reshape(-1), values.reshape(k, -1, self.param_shape[1]))
        return _deliver(rows, out)

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, EmbeddingFactor):
            raise TypeError(f"cannot merge EmbeddingFactor with {type(other).__name__}")
        return EmbeddingFactor(
            torch.cat([self.indices, other.indices], dim=1),
            torch.cat([self.output_grads, other.output_grads], dim=1),
            self.param_shape,
        )


class SumFactor:
    """g_i = sum_u g_i^u over the uses u of one parameter by different layers (tied weights).

    A parameter shared by two layers (a language model's token embedding tied to its output
    head) has per-example gradient the sum of its uses' contributions, so its norms and Gram
    matrix need the cross terms <g_i^u, g_j^v> between uses, not only each use's own. A cross
    term is exact: use v's per-example gradients are formed transiently as a (B, *param_shape)
    tensor (``weighted_sum`` with the identity) and read by use u's ``dot``. Dots and weighted
    sums are plain sums over the uses.
    """

    def __init__(self, parts: list[ParameterFactor]) -> None:
        self.parts = parts
        self.batch_size = parts[0].batch_size
        self.param_shape = parts[0].param_shape

    def _cross(self, u: ParameterFactor, v: ParameterFactor) -> torch.Tensor:
        """(B, B) entries <g_i^u, g_j^v>."""
        if isinstance(u, EmbeddingFactor) and _is_plain_linear(v):
            return embedding_linear_cross(u, v)
        if isinstance(v, EmbeddingFactor) and _is_plain_linear(u):
            return embedding_linear_cross(v, u).T
        identity = torch.eye(self.batch_size, dtype=torch.float64)
        dense_v = v.weighted_sum(identity.to(_dtype_of(v)))  # (B, *param_shape)
        return u.dot(dense_v)

    def _pairs(self) -> list[tuple[ParameterFactor, ParameterFactor]]:
        return [(u, v) for k, u in enumerate(self.parts) for v in self.parts[k + 1 :]]

    def _cross_diagonal(self, u: ParameterFactor, v: ParameterFactor) -> torch.Tensor:
        """(B,) entries <g_i^u, g_i^v>: per-example blocks only where a ghost form allows."""
        if isinstance(u, EmbeddingFactor) and _is_plain_linear(v):
            return _embedding_linear_cross_diagonal(u, v)
        if isinstance(v, EmbeddingFactor) and _is_plain_linear(u):
            return _embedding_linear_cross_diagonal(v, u)
        return self._cross(u, v).diagonal()

    def norms_squared(self) -> torch.Tensor:
        total = sum(part.norms_squared() for part in self.parts)
        for u, v in self._pairs():
            total = total + 2 * self._cross_diagonal(u, v)
        return total

    def gram(self) -> torch.Tensor:
        total = sum(part.gram() for part in self.parts)
        for u, v in self._pairs():
            cross = self._cross(u, v)
            total = total + cross + cross.T
        return total

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        return sum(part.dot(vectors) for part in self.parts)

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        dtype = compute_dtype(weights.dtype)
        rows = sum(part.weighted_sum(weights).to(dtype) for part in self.parts)
        return _deliver(rows, out)

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        return combine(self, other)


def _is_plain_linear(factor: ParameterFactor) -> bool:
    return isinstance(factor, OuterProductFactor) and factor.groups == 1


def embedding_linear_cross(u: EmbeddingFactor, v: OuterProductFactor) -> torch.Tensor:
    """(B_u, B_v) <g_i^u, g_j^v> for a table used as embedding (u) and as output head (v),
    ghost-style (the two may hold other examples: two groups of a grouped batch).

    <sum_t onehot(idx_it) E_it^T, sum_s D_js A_js^T> = sum_{t, s} D_js[idx_it] (E_it . A_js):
    N_u x N_v pairs of d-dim dots, never the (B, V, d) per-example gradients.
    """
    dtype = torch.promote_types(u.output_grads.dtype, v.inputs.dtype)
    b = u.batch_size
    idx = u.indices.reshape(-1)
    e = u.output_grads.reshape(idx.numel(), -1).to(dtype)  # (N_u, d)
    a = v.inputs.reshape(-1, v.in_features).to(dtype)  # (N_v, d)
    d = v.output_grads.reshape(-1, v.out_features).to(dtype)  # (N_v, V)
    pairs = (e @ a.T) * d.index_select(1, idx).T  # (N_u, N_v)
    return pairs.reshape(b, -1, v.batch_size, v.positions).sum(dim=(1, 3))


def _embedding_linear_cross_diagonal(u: EmbeddingFactor, v: OuterProductFactor) -> torch.Tensor:
    """(B,) <g_i^u, g_i^v>, the diagonal of ``embedding_linear_cross``: per example,
    sum_{t, s} D_is[idx_it] (E_it . A_is) over T_u x T_v pairs only (no (B T)^2 products)."""
    dtype = torch.promote_types(u.output_grads.dtype, v.inputs.dtype)
    b = u.batch_size
    e = u.output_grads.reshape(b, u.positions, -1).to(dtype)  # (B, T_u, d)
    a = v.inputs.reshape(b, v.positions, v.in_features).to(dtype)  # (B, T_v, d)
    d = v.output_grads.reshape(b, v.positions, v.out_features).to(dtype)  # (B, T_v, V)
    picked = torch.gather(d, 2, u.indices.unsqueeze(1).expand(b, v.positions, u.positions))
    return (torch.bmm(e, a.transpose(1, 2)) * picked.transpose(1, 2)).sum(dim=(1, 2))


def _dtype_of(factor: ParameterFactor) -> torch.dtype:
    """The compute dtype a factor's tensors are held in."""
    for attribute in ("inputs", "output_grads", "grads"):
        tensor = getattr(factor, attribute, None)
        if isinstance(tensor, torch.Tensor):
            return tensor.dtype
    if isinstance(factor, SumFactor):
        return _dtype_of(factor.parts[0])
    return torch.float32


def combine(first: ParameterFactor, second: ParameterFactor) -> ParameterFactor:
    """The factor of g_i + h_i: ``merge`` for two calls of one layer, else a ``SumFactor``."""
    if isinstance(first, SumFactor) or isinstance(second, SumFactor):
        left = first.parts if isinstance(first, SumFactor) else [first]
        right = second.parts if isinstance(second, SumFactor) else [second]
        return SumFactor([*left, *right])
    if type(first) is type(second):
        return first.merge(second)
    return SumFactor([first, second])
