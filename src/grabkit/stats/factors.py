"""Exact per-example gradient algebra for one parameter, from the factors autograd already has.

Every built-in layer rule describes the per-example gradients of a parameter in one of three
forms, each answering the four reads (norms, Gram, dots with a few vectors, weighted sums)
without a (B, d) tensor for the whole model:

* ``OuterProductFactor``: g_i = sum_t D[i, t] A[i, t]^T (Linear, Conv via unfold), per group;
* ``EmbeddingFactor``:    g_i = sum_t onehot(idx[i, t]) D[i, t]^T (Embedding rows);
* ``PerExampleFactor``:   g_i given outright (biases, normalisation affine parameters: small).

A factor also ``merge``\\ s with the factor of another call of the same layer (a layer used twice
in one forward), because the per-example gradient is then the sum over both calls.

Shapes: B examples, T positions per example (1 for plain vectors), G groups, p inputs and q
outputs per group, k vectors. Parameters are addressed through their own shape ``param_shape``.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = [
    "EmbeddingFactor",
    "OuterProductFactor",
    "ParameterFactor",
    "PerExampleFactor",
    "compute_dtype",
]

# The (N, N) equality and inner-product blocks the Embedding Gram matrix builds are processed in
# row chunks of at most this many entries, so memory stays bounded for long sequences.
_EMBEDDING_GRAM_CHUNK_ENTRIES = 1 << 24

_STRATEGIES = ("auto", "ghost", "materialise")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in at least float32 (half / bfloat16 activations under autocast)."""
    return torch.promote_types(dtype, torch.float32)


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

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """(B, k) weights -> (k, *param_shape) rows sum_i w[i, j] g_i."""
        ...

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        """The factor of g_i + h_i, where ``other`` holds h_i from another call of the layer."""
        ...


class PerExampleFactor:
    """Per-example gradients held outright as a (B, *param_shape) tensor.

    Used for parameters whose size is a small multiple of a layer's width (biases, affine
    parameters of normalisation layers), where materialising B copies costs little.
    """

    def __init__(self, grads: torch.Tensor, param_shape: torch.Size) -> None:
        self.batch_size = grads.shape[0]
        self.param_shape = torch.Size(param_shape)
        self.grads = grads.reshape(self.batch_size, -1).to(compute_dtype(grads.dtype))  # (B, n)

    def norms_squared(self) -> torch.Tensor:
        return (self.grads * self.grads).sum(dim=1)

    def gram(self) -> torch.Tensor:
        return self.grads @ self.grads.T

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        flat = vectors.reshape(vectors.shape[0], -1).to(self.grads.dtype)  # (k, n)
        return self.grads @ flat.T

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        rows = weights.to(self.grads.dtype).T @ self.grads  # (k, n)
        return rows.reshape(weights.shape[1], *self.param_shape)

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, PerExampleFactor):
            raise TypeError(f"cannot merge PerExampleFactor with {type(other).__name__}")
        merged = PerExampleFactor.__new__(PerExampleFactor)
        merged.batch_size = self.batch_size
        merged.param_shape = self.param_shape
        merged.grads = self.grads + other.grads
        return merged


class OuterProductFactor:
    """g_i = sum_t D[i, t] A[i, t]^T per group: the weight of a Linear or an unfolded Conv.

    Args:
        inputs: A, (B, T, G, p) layer inputs (unfolded patches for a convolution).
        output_grads: D, (B, T, G, q) gradients of the layer's outputs, already scaled so that
            row i belongs to example i's own loss term.
        param_shape: the parameter's shape; its elements, read in order, are the (G, q, p) blocks.
        strategy: ``"auto"`` (the cheaper form below, per read), ``"ghost"`` or ``"materialise"``.

    The norms and the Gram matrix pick the cheaper of two exact forms per layer:

    * ghost: <g_i, g_j> = sum_{t, s} (A_it . A_js)(D_it . D_js), memory ~ T^2 per pair;
    * materialised: build this layer's (B, G q p) per-example gradients transiently.

    Ghost is chosen when its two T x T blocks are smaller than one q x p gradient (per example
    for the norms, per pair of examples for the Gram matrix). Dots and weighted sums never
    materialise: each is one batched GEMM for all k vectors.
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
        dtype = compute_dtype(torch.promote_types(inputs.dtype, output_grads.dtype))
        self.inputs = inputs.to(dtype)
        self.output_grads = output_grads.to(dtype)
        self.batch_size, self.positions, self.groups, self.in_features = inputs.shape
        self.out_features = output_grads.shape[-1]
        self.param_shape = torch.Size(param_shape)

    # -- helpers ---------------------------------------------------------------------------------
    def _use_ghost(self, ghost_entries: int) -> bool:
        """Ghost when its T x T blocks (``ghost_entries``) are smaller than one q x p gradient."""
        if self.strategy != "auto":
            return self.strategy == "ghost"
        return ghost_entries < self.out_features * self.in_features

    def _materialised(self) -> torch.Tensor:
        """(B, G q p) per-example gradients of this layer (transient)."""
        grads = torch.einsum("btgq,btgp->bgqp", self.output_grads, self.inputs)
        return grads.reshape(self.batch_size, -1)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, G, f) -> (G, B T, f): one row per (example, position), grouped first."""
        return t.reshape(-1, self.groups, t.shape[-1]).transpose(0, 1)

    # -- reads -----------------------------------------------------------------------------------
    def norms_squared(self) -> torch.Tensor:
        if self._use_ghost(2 * self.positions**2):
            a_a = torch.einsum("btgp,bsgp->bgts", self.inputs, self.inputs)
            d_d = torch.einsum("btgq,bsgq->bgts", self.output_grads, self.output_grads)
            return (a_a * d_d).sum(dim=(1, 2, 3))
        grads = self._materialised()
        return (grads * grads).sum(dim=1)

    def gram(self) -> torch.Tensor:
        b, t = self.batch_size, self.positions
        if self._use_ghost(2 * b * t**2):
            a = self._rows(self.inputs)  # (G, N, p)
            d = self._rows(self.output_grads)  # (G, N, q)
            pairs = (a @ a.transpose(1, 2)) * (d @ d.transpose(1, 2))  # (G, N, N)
            return pairs.sum(dim=0).reshape(b, t, b, t).sum(dim=(1, 3))
        grads = self._materialised()
        return grads @ grads.T

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        k = vectors.shape[0]
        g, p, q = self.groups, self.in_features, self.out_features
        v = vectors.to(self.inputs.dtype).reshape(k, g, q, p)
        a = self._rows(self.inputs)  # (G, N, p)
        d = self._rows(self.output_grads)  # (G, N, q)
        if p <= q:  # D V: (G, N, k p), then contract with A
            projected = torch.bmm(d, v.permute(1, 2, 0, 3).reshape(g, q, k * p))
            per_row = (projected.view(g, -1, k, p) * a.unsqueeze(2)).sum(dim=-1)
        else:  # A V^T: (G, N, k q), then contract with D
            projected = torch.bmm(a, v.permute(1, 3, 0, 2).reshape(g, p, k * q))
            per_row = (projected.view(g, -1, k, q) * d.unsqueeze(2)).sum(dim=-1)
        return per_row.sum(dim=0).reshape(self.batch_size, self.positions, k).sum(dim=1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        k = weights.shape[1]
        g, p, q = self.groups, self.in_features, self.out_features
        w = weights.to(self.inputs.dtype).repeat_interleave(self.positions, dim=0)  # (N, k)
        a = self._rows(self.inputs)  # (G, N, p)
        d = self._rows(self.output_grads)  # (G, N, q)
        if q <= p:  # scale the narrower side by the weights
            scaled = (d.unsqueeze(2) * w.unsqueeze(-1)).reshape(g, -1, k * q)
            blocks = torch.bmm(scaled.transpose(1, 2), a).view(g, k, q, p)
        else:
            scaled = (a.unsqueeze(2) * w.unsqueeze(-1)).reshape(g, -1, k * p)
            blocks = torch.bmm(d.transpose(1, 2), scaled).view(g, q, k, p).transpose(1, 2)
        return blocks.transpose(0, 1).reshape(k, *self.param_shape)

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

    Never materialised (B x num_embeddings x dim would be the largest tensor in the model):
    <g_i, g_j> = sum_{t, s} [idx_it == idx_js] (D_it . D_js).
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
        idx = self.indices.reshape(-1)  # (N,)
        d = self.output_grads.reshape(b * t, -1)  # (N, dim)
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

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        k = weights.shape[1]
        w = weights.to(self.output_grads.dtype).T  # (k, B)
        values = w[:, :, None, None] * self.output_grads.unsqueeze(0)  # (k, B, T, dim)
        out = self.output_grads.new_zeros(k, *self.param_shape)
        out.index_add_(1, self.indices.reshape(-1), values.reshape(k, -1, self.param_shape[1]))
        return out

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, EmbeddingFactor):
            raise TypeError(f"cannot merge EmbeddingFactor with {type(other).__name__}")
        return EmbeddingFactor(
            torch.cat([self.indices, other.indices], dim=1),
            torch.cat([self.output_grads, other.output_grads], dim=1),
            self.param_shape,
        )
