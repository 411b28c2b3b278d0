"""The one interface through which orderings and estimators read a batch of per-example gradients.

A batch of B per-example gradients g_1..g_B, each a vector in R^d, is only ever used through
inner products: with itself (the Gram matrix), with a few fixed vectors (a running sum, a stale
mean), and as weighted sums. ``GradientBatch`` names exactly those operations, so the same
balancing code runs on

* a dense (B, d) tensor (``DenseGradientBatch``: torch.func per-sample gradients, projections), and
* statistics read from layer hooks without ever building a (B, d) tensor
  (``grabkit.stats.PerSampleStats.gradient_batch()``).

Vectors in R^d are flat tensors laid out as ``torch.cat([p.reshape(-1) for p in params])`` over the
parameters that take part, in ``named_parameters()`` order. ``flat_to_named`` / ``named_to_flat``
convert between that layout and a ``{name: tensor}`` dict.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from grabkit.stats.transfer import to_host

__all__ = [
    "DenseGradientBatch",
    "FlatLayout",
    "ForeignBatch",
    "GradientBatch",
    "NormalizedBatch",
    "PendingReads",
    "ScaledBatch",
    "as_gradient_batch",
    "flat_to_named",
    "named_to_flat",
]


class PendingReads(Protocol):
    """What a derived batch reads the host through: ``to_host`` (the consumer's one transfer,
    which compares a pending check first) and ``settle`` (compare it now)."""

    def to_host(self, tensor: torch.Tensor) -> np.ndarray: ...

    def settle(self) -> None: ...


class GradientBatch(ABC):
    """B per-example gradients in R^d, accessed only through inner products.

    A subclass implements the five reads (``gram``, ``norms_squared``, ``dot``, ``total``,
    ``weighted_sum``) and sets the four attributes. Everything else has a default written with
    those reads, which a subclass overrides where it can do better: the in-place sums
    (``add_total_to``, ``add_weighted_sum_to``: hook statistics add layer by layer, with no
    temporary the size of the model), one example's gradient (``row``), the normalised view
    (``normalized``), the view of a scaled loss's gradients in the loss's units (``divided``),
    cutting into consecutive pieces (``split``) and the coordinates themselves
    (``coordinates``: None unless the batch holds a (B, d) matrix). Consumers call these methods;
    they never ask which class a batch is.

    Attributes:
        size: B, the number of examples.
        dim: d, the length of one flattened gradient.
        dtype / device: of the vectors this batch accepts and returns.
    """

    size: int
    dim: int
    dtype: torch.dtype
    device: torch.device

    @abstractmethod
    def gram(self) -> torch.Tensor:
        """(B, B) matrix K with K[i, j] = <g_i, g_j>."""

    @abstractmethod
    def norms_squared(self) -> torch.Tensor:
        """(B,) vector with entries ||g_i||^2 (the diagonal of ``gram()``, usually cheaper)."""

    @abstractmethod
    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        """Inner products with fixed vectors.

        Args:
            vectors: (d,) or (k, d).
        Returns:
            (B,) for a (d,) input, (B, k) for a (k, d) input: entry [i, j] = <g_i, v_j>.
        """

    @abstractmethod
    def total(self) -> torch.Tensor:
        """(d,) vector sum_i g_i; free in hook mode, where autograd computed the batch gradient."""

    @abstractmethod
    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """sum_i w_i g_i.

        Args:
            weights: (B,) or (B, k).
        Returns:
            (d,) for (B,) weights, (k, d) for (B, k) weights (row j uses column j of the weights).
        """

    # -- with defaults -------------------------------------------------------------------------
    def coordinates(self) -> torch.Tensor | None:
        """The (B, d) gradients themselves when this batch holds them, else None (inner
        products only). Per-coordinate transforms, projections and the exchange between ranks
        need them; everything else reads inner products."""
        return None

    def add_total_to(self, target: torch.Tensor) -> None:
        """In place: ``target`` (d,) += ``total()``."""
        target.add_(self.total())

    def add_weighted_sum_to(
        self, target: torch.Tensor, weights: torch.Tensor, *, host: torch.Tensor | None = None
    ) -> None:
        """In place: ``target`` += ``weighted_sum(weights)``; ``target`` (k, d) for (B, k)
        weights, (d,) for (B,) weights (running sums).

        ``host``, when the caller has it, is the same weights as a CPU tensor: a batch that must
        look at the weights' values reads them there instead of waiting for the device.
        """
        target += self.weighted_sum(weights).to(target.dtype).reshape(target.shape)

    def row(self, index: int) -> torch.Tensor:
        """(d,) g_index, a tensor of its own (not a view into the batch)."""
        one_hot = torch.zeros(self.size, 1, dtype=self.dtype, device=self.device)
        one_hot[index] = 1.0
        return self.weighted_sum(one_hot).reshape(-1)

    def normalized(self) -> GradientBatch:
        """The batch of g_i / ||g_i|| (zero rows stay zero)."""
        return NormalizedBatch(self)

    def divided(self, factor: float) -> GradientBatch:
        """The batch of g_i / ``factor`` (a positive finite number): the gradients of a loss
        that was multiplied by ``factor`` before its backward (a GradScaler's loss scale),
        brought back to the loss's own units. ``factor == 1`` is the batch itself."""
        return self if factor == 1.0 else ScaledBatch(self, 1.0 / factor)

    def split(self, rows: int) -> list[GradientBatch]:
        """Consecutive pieces of at most ``rows`` examples, in order, where the batch can be cut
        without recomputing anything; by default the whole batch, uncut."""
        return [self]

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """The values of ``tensor``, computed from this batch's reads, on the host: the
        consumer's host transfer. A batch whose statistics carry a pending check (hook
        statistics' identity check) compares it in the same transfer, before any value is
        returned."""
        return to_host(tensor)

    def settle(self) -> None:  # noqa: B027 (nothing pending by default)
        """Run a pending check of the statistics now (a host transfer where one is pending)."""

    def derived(self, matrix: torch.Tensor) -> DenseGradientBatch:
        """A dense batch of (B', d') rows computed from this batch (cast, projected, gathered,
        centred, cut) whose host reads and ``settle`` go through this batch, so a check pending
        here still rides on the consumer's one host transfer."""
        return DenseGradientBatch(matrix, reads_through=self)


class DenseGradientBatch(GradientBatch):
    """A ``GradientBatch`` backed by a dense (B, d) tensor.

    Args:
        matrix: (B, d) per-example gradients, one row per example.
        reads_through: where its host reads and ``settle`` go (anything with ``to_host`` and
            ``settle``: the batch or statistics these rows were computed from, which may hold an
            identity check still pending); None reads directly.
    """

    def __init__(
        self, matrix: torch.Tensor, *, reads_through: GradientBatch | PendingReads | None = None
    ) -> None:
        if matrix.ndim != 2:
            raise ValueError(
                f"DenseGradientBatch expects a (B, d) matrix, but got shape {tuple(matrix.shape)}; "
                "flatten each example's gradient into one row first."
            )
        self.matrix = matrix
        self.size, self.dim = matrix.shape
        self.dtype = matrix.dtype
        self.device = matrix.device
        self.reads_through = reads_through

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        if self.reads_through is None:
            return to_host(tensor)
        return self.reads_through.to_host(tensor)

    def settle(self) -> None:
        if self.reads_through is not None:
            self.reads_through.settle()

    def gram(self) -> torch.Tensor:
        return self.matrix @ self.matrix.T  # (B, B)

    def norms_squared(self) -> torch.Tensor:
        return (self.matrix * self.matrix).sum(dim=1)  # (B,)

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        return self.matrix @ vectors.T  # (B,) or (B, k)

    def total(self) -> torch.Tensor:
        return self.matrix.sum(dim=0)  # (d,)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        w = weights.to(self.dtype)
        return (w if w.ndim == 1 else w.mT) @ self.matrix  # (d,) or (k, d)

    def coordinates(self) -> torch.Tensor:
        return self.matrix

    def row(self, index: int) -> torch.Tensor:
        return self.matrix[index].clone()

    def normalized(self) -> DenseGradientBatch:
        norms = torch.linalg.vector_norm(self.matrix, dim=1, keepdim=True)  # (B, 1)
        return self.derived(self.matrix / torch.where(norms > 0, norms, 1.0))

    def divided(self, factor: float) -> DenseGradientBatch:
        return self if factor == 1.0 else self.derived(self.matrix / factor)

    def split(self, rows: int) -> list[GradientBatch]:
        if self.size <= rows:
            return [self]
        return [
            self.derived(self.matrix[start : start + rows]) for start in range(0, self.size, rows)
        ]


class NormalizedBatch(GradientBatch):
    """A ``GradientBatch`` of g_i / ||g_i|| (zero rows stay zero), read lazily from ``inner``:
    every read is the inner batch's, rescaled by the (B,) inverse norms."""

    def __init__(self, batch: GradientBatch) -> None:
        self.inner = batch
        self.size, self.dim = batch.size, batch.dim
        self.dtype, self.device = batch.dtype, batch.device
        norms = batch.norms_squared().sqrt()
        self.scale = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))  # (B,)

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        return self.inner.to_host(tensor)

    def settle(self) -> None:
        self.inner.settle()

    def gram(self) -> torch.Tensor:
        return self.inner.gram() * self.scale[:, None] * self.scale[None, :]

    def norms_squared(self) -> torch.Tensor:
        return self.inner.norms_squared() * self.scale**2

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        d = self.inner.dot(vectors)
        return d * (self.scale if d.ndim == 1 else self.scale[:, None])

    def total(self) -> torch.Tensor:
        return self.inner.weighted_sum(self.scale[:, None]).reshape(-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        s = self.scale if weights.ndim == 1 else self.scale[:, None]
        return self.inner.weighted_sum(weights * s.to(weights.dtype))


class ScaledBatch(GradientBatch):
    """A ``GradientBatch`` of c g_i for a constant c known on the host (a Python float), read
    lazily from ``inner``: every read is the inner batch's times c (c^2 for the quadratic ones).

    The constant never goes to the device and back: the weights of a weighted sum are scaled
    on the device and their host copy on the host, so the inner batch's signed-sum shortcut and
    its pending check keep their single host transfer per step.
    """

    def __init__(self, batch: GradientBatch, factor: float) -> None:
        self.inner = batch
        self.factor = float(factor)
        self.size, self.dim = batch.size, batch.dim
        self.dtype, self.device = batch.dtype, batch.device

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        return self.inner.to_host(tensor)

    def settle(self) -> None:
        self.inner.settle()

    def gram(self) -> torch.Tensor:
        return self.inner.gram() * (self.factor * self.factor)

    def norms_squared(self) -> torch.Tensor:
        return self.inner.norms_squared() * (self.factor * self.factor)

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        return self.inner.dot(vectors) * self.factor

    def total(self) -> torch.Tensor:
        return self.inner.total() * self.factor

    def add_total_to(self, target: torch.Tensor) -> None:
        target.add_(self.inner.total(), alpha=self.factor)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        return self.inner.weighted_sum(weights * self.factor)

    def add_weighted_sum_to(
        self, target: torch.Tensor, weights: torch.Tensor, *, host: torch.Tensor | None = None
    ) -> None:
        self.inner.add_weighted_sum_to(
            target, weights * self.factor, host=None if host is None else host * self.factor
        )

    def row(self, index: int) -> torch.Tensor:
        return self.inner.row(index) * self.factor

    def coordinates(self) -> torch.Tensor | None:
        matrix = self.inner.coordinates()
        return None if matrix is None else matrix * self.factor

    def split(self, rows: int) -> list[GradientBatch]:
        pieces = self.inner.split(rows)
        return [self] if len(pieces) == 1 else [ScaledBatch(p, self.factor) for p in pieces]


class ForeignBatch(GradientBatch):
    """Any object with the five reads and the four attributes, seen as a ``GradientBatch``.

    ``as_gradient_batch`` wraps such an object once, where it enters (a statistics object of
    your own, a batch passed to ``step()``), so that everything past that point meets the
    declared interface and its defaults.
    """

    def __init__(self, batch: object) -> None:
        self.inner = batch
        self.size, self.dim = int(batch.size), int(batch.dim)
        self.dtype, self.device = batch.dtype, batch.device

    def gram(self) -> torch.Tensor:
        return self.inner.gram()

    def norms_squared(self) -> torch.Tensor:
        return self.inner.norms_squared()

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        return self.inner.dot(vectors)

    def total(self) -> torch.Tensor:
        return self.inner.total()

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        return self.inner.weighted_sum(weights)


_READS = ("gram", "norms_squared", "dot", "total", "weighted_sum")
_ATTRIBUTES = ("size", "dim", "dtype", "device")


def as_gradient_batch(batch: object) -> GradientBatch:
    """``batch`` itself when it is a ``GradientBatch``; an object offering the same five reads
    and four attributes wrapped as one (``ForeignBatch``); anything else a TypeError."""
    if isinstance(batch, GradientBatch):
        return batch
    missing = [name for name in _READS if not callable(getattr(batch, name, None))]
    missing += [name for name in _ATTRIBUTES if not hasattr(batch, name)]
    if missing:
        raise TypeError(
            f"expected a GradientBatch (grabkit.stats.GradientBatch), but got a "
            f"{type(batch).__name__} without {missing}; subclass GradientBatch, or return a "
            "DenseGradientBatch of the (B, d) per-example gradients."
        )
    return ForeignBatch(batch)


def named_to_flat(named: Mapping[str, torch.Tensor], batch_dims: int = 0) -> torch.Tensor:
    """Concatenate a ``{name: tensor}`` dict into the flat layout, keeping ``batch_dims`` lead dims.

    With ``batch_dims=1`` a dict of (B, ...) per-example gradients (what
    ``torch.func.vmap(torch.func.grad(f))`` returns) becomes a (B, d) matrix.
    """
    tensors = list(named.values())
    if not tensors:
        raise ValueError("cannot flatten an empty dict of tensors")
    lead = tensors[0].shape[:batch_dims]
    for name, t in named.items():
        if t.shape[:batch_dims] != lead:
            raise ValueError(
                f"tensor {name!r} has leading shape {tuple(t.shape[:batch_dims])}, expected "
                f"{tuple(lead)} like the first tensor: every entry must share its batch dims."
            )
    return torch.cat([t.reshape(*lead, -1) for t in tensors], dim=batch_dims)


def flat_to_named(flat: torch.Tensor, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Split a flat (d,) vector into a dict of views shaped like ``shapes`` (name -> shape)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset : offset + n].view(shape)
        offset += n
    if offset != flat.shape[-1]:
        raise ValueError(
            f"flat vector has length {flat.shape[-1]} but the shapes add up to {offset}"
        )
    return out


class FlatLayout:
    """Where each parameter's numbers sit in the flat layout of ``shapes`` (name -> shape).

    ``views(flat)`` cuts a (k, d) buffer into name -> (k, *shape) views (a (d,) one into
    (*shape) views). The views of the last
    few buffers cut are kept while those buffers live: running sums and fixed vectors are cut
    the same way at every step, and their cuts then cost nothing.

    Attributes:
        entries: (name, shape, offset, numel) per parameter, in layout order.
        dim: d, the total number of entries.
    """

    #: how many buffers' views are kept (running sums, fixed vectors, an epoch's sum, a spare)
    KEPT = 6

    def __init__(self, shapes: Mapping[str, torch.Size]) -> None:
        self.entries: list[tuple[str, torch.Size, int, int]] = []
        offset = 0
        for name, shape in shapes.items():
            size = torch.Size(shape)
            self.entries.append((name, size, offset, size.numel()))
            offset += size.numel()
        self.dim = offset
        # (weak reference to the buffer, its data pointer / shape / strides / dtype, its views)
        self._cuts: list[tuple[weakref.ref[torch.Tensor], tuple, dict[str, torch.Tensor]]] = []

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> (k, *shape) pieces of the rows of a (k, d) tensor (or (*shape) pieces of a
        (d,) one): views (no copy) when its last dim has stride 1, else reshaped copies."""
        lead = flat.shape[:-1]  # (k,) or ()
        if flat.stride(-1) != 1:
            return {
                name: flat[..., offset : offset + n].reshape(*lead, *shape)
                for name, shape, offset, n in self.entries
            }
        key = (flat.data_ptr(), flat.shape, flat.stride(), flat.dtype, flat.device)
        for ref, cut_key, views in self._cuts:
            if ref() is flat and cut_key == key:
                return views
        views = {
            name: flat[..., offset : offset + n].view(*lead, *shape)
            for name, shape, offset, n in self.entries
        }
        self._cuts = [(weakref.ref(flat, self._forget), key, views), *self._cuts[: self.KEPT - 1]]
        return views

    def _forget(self, gone: weakref.ref[torch.Tensor]) -> None:
        """A buffer that was cut is gone: drop its views (they would keep its storage alive)."""
        self._cuts = [cut for cut in self._cuts if cut[0] is not gone]
