"""Vectorised padding, masks, group gathering and merging.

Every function here issues a constant number of tensor operations per call (or per group),
never one per item: items are concatenated once and written into a padded tensor with a single
``index_put_``; groups are one ``index_select`` plus narrowing; merging is one ``cat`` plus one
inverse permutation.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .annotation import BATCH, CONST, LENGTH, Signature

__all__ = [
    "CDimPadder",
    "ConstantPadder",
    "Padder",
    "ZeroPadder",
    "as_padder",
    "length_mask",
    "merge_groups",
    "narrow_gather",
    "normalise_dims",
    "pad_stack",
]


class Padder:
    """What padded positions hold. Subclasses build the background a padded tensor starts from."""

    def background(
        self, shape: Sequence[int], signature: Signature, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A tensor of ``shape`` (laid out as ``signature``) filled with the padding value."""
        raise NotImplementedError

    def to(self, device: torch.device | str) -> Padder:
        return self


class ConstantPadder(Padder):
    """Pads with one scalar value (``0`` for :class:`ZeroPadder`)."""

    def __init__(self, value: float | int | bool = 0) -> None:
        if not isinstance(value, (int, float, bool)):
            raise TypeError(f"pad value should be a number, but got {type(value)!r}")
        self.value = value

    def background(self, shape, signature, dtype, device):
        return torch.full(tuple(shape), self.value, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class ZeroPadder(ConstantPadder):
    """Pads with zeros (the default)."""

    def __init__(self) -> None:
        super().__init__(0)

    def __repr__(self) -> str:
        return "ZeroPadder()"


class CDimPadder(Padder):
    """Structured padding: the constant dimensions jointly take ``value`` at padded positions.

    ``value`` has the sizes of the annotation's constant dimensions, in order; e.g. for
    ``"(B, L_res, 3, 3)"`` and ``value=torch.eye(3)`` every padded residue is an identity frame.
    """

    def __init__(self, value: Tensor) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"CDimPadder value should be a tensor, but got {type(value)!r}")
        self.value = value

    def background(self, shape, signature, dtype, device):
        const_sizes = [d.size for d in signature.dims if d.kind == CONST]
        if list(self.value.shape) != const_sizes:
            raise ValueError(
                f"CDimPadder value has shape {tuple(self.value.shape)}, but {signature} has "
                f"constant dimensions {tuple(const_sizes)}; give a value of exactly that shape"
            )
        view = [d.size if d.kind == CONST else 1 for d in signature.dims]
        value = self.value.to(device=device, dtype=dtype).reshape(view)
        return value.expand(tuple(shape)).clone()

    def to(self, device):
        return CDimPadder(self.value.to(device))

    def __repr__(self) -> str:
        return f"CDimPadder({self.value!r})"


def as_padder(spec: object, where: str = "padding") -> Padder:
    """A :class:`Padder` from ``None`` (zeros), a number, or a Padder."""
    if spec is None:
        return ZeroPadder()
    if isinstance(spec, Padder):
        return spec
    if isinstance(spec, (int, float, bool)):
        return ConstantPadder(spec)
    raise TypeError(f"{where} should be None, a number or a Padder, but got {type(spec)!r}")


def normalise_dims(dims: Sequence[int], rank: int, what: str) -> tuple[int, ...]:
    """``length_dims`` as non-negative positions of a rank-``rank`` ``what``; distinct ints."""
    out = []
    for d in dims:
        try:
            index = None if isinstance(d, bool) else operator.index(d)  # ints, numpy ints
        except TypeError:
            index = None
        if index is None or not -rank <= index < rank:
            raise ValueError(
                f"length_dims should be dims of {what} (rank {rank}: in [-{rank}, {rank})), but "
                f"got {tuple(dims)}"
            )
        out.append(index % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"length_dims name the same dim twice: {tuple(dims)}")
    return tuple(out)


def _layout(signature: Signature) -> tuple[list[int], list[int]]:
    """Positions of length dims and of the other item dims, both in the batched signature."""
    lengths = [i for i, d in enumerate(signature.dims) if d.kind == LENGTH]
    others = [i for i, d in enumerate(signature.dims) if d.kind not in (LENGTH, BATCH)]
    return lengths, others


def pad_stack(
    items: Sequence[Tensor],
    signature: Signature,
    lengths: Tensor,
    padder: Padder,
    padded_lengths: Sequence[int] | None = None,
) -> Tensor:
    """Stack variable-length ``items`` into one padded tensor laid out as ``signature``.

    ``items[i]`` has the signature's item dims; ``lengths`` is ``(n, k)`` int64 (CPU), the item
    sizes along the ``k`` length dims in signature order; ``padded_lengths`` (default: the
    maxima) are the padded sizes. Cost: one ``cat`` and one ``index_put_`` whatever ``n``.
    """
    n = len(items)
    length_pos, other_pos = _layout(signature)
    b = signature.batch_index
    first = items[0]
    if padded_lengths is None:
        padded_lengths = lengths.max(0).values.tolist() if n else [0] * len(length_pos)
    shape = [0] * len(signature)
    shape[b] = n
    item_positions = [i for i in range(len(signature)) if i != b]
    for item_axis, pos in enumerate(item_positions):
        shape[pos] = first.shape[item_axis]
    for k, pos in enumerate(length_pos):
        shape[pos] = int(padded_lengths[k])
    if not length_pos:
        return torch.stack(list(items), dim=b)
    out = padder.background(shape, signature, first.dtype, first.device)
    # item axis of each batched position (the batch dim removed)
    item_axis_of = {pos: ax for ax, pos in enumerate(item_positions)}
    perm_item = [item_axis_of[p] for p in length_pos] + [item_axis_of[p] for p in other_pos]
    rest = [shape[p] for p in other_pos]
    flat = torch.cat([t.permute(perm_item).reshape(-1, *rest) for t in items])
    counts = lengths.prod(1)
    row = torch.repeat_interleave(torch.arange(n), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    coords = []
    for k in range(len(length_pos) - 1, -1, -1):
        size = torch.repeat_interleave(lengths[:, k], counts)
        coords.append(local % size)
        local = local // size
    coords.reverse()
    view = out.permute([b, *length_pos, *other_pos])
    index = tuple(c.to(first.device) for c in (row, *coords))
    view.index_put_(index, flat)
    return out


def length_mask(
    lengths: Tensor, sizes: Sequence[int], device: torch.device | str | None = None
) -> Tensor:
    """Boolean ``(n, *sizes)`` mask, True where every coordinate is below the item's length.

    ``lengths`` is ``(n, k)``; the mask is the AND over the ``k`` length dims (a position is
    real only when it is inside the item along every length dim).
    """
    n, k = lengths.shape
    lengths = lengths.to(device)
    mask = torch.ones((n,) + (1,) * k, dtype=torch.bool, device=lengths.device)
    for j, size in enumerate(sizes):
        shape = [n] + [1] * k
        shape[1 + j] = size
        along = torch.arange(size, device=lengths.device)[None, :] < lengths[:, j : j + 1]
        mask = mask & along.reshape(shape)
    return mask.expand((n, *sizes))


def narrow_gather(
    tensor: Tensor, batch_dim: int, sizes: Mapping[int, int], rows: Tensor | None
) -> Tensor:
    """One group of a padded batch: narrowed to ``sizes`` (dim -> size), then rows gathered.

    Narrowing first means the gather (``index_select`` of ``rows`` along ``batch_dim``) moves
    only the group's columns; ``rows=None`` keeps every row (a view, no copy). Sizes at or
    above the tensor's are left alone.
    """
    for dim, size in sizes.items():
        if size < tensor.shape[dim]:
            tensor = tensor.narrow(dim, 0, size)
    if rows is None:
        return tensor
    return tensor.index_select(batch_dim, rows.to(tensor.device))


def merge_groups(
    outputs: Sequence[Tensor],
    inverse_order: Tensor | None,
    batch_dim: int,
    length_dims: Sequence[int] = (),
    fill: float = 0.0,
) -> Tensor:
    """Put group outputs back into one batch in the original item order.

    Each output is zero-padded (``fill``) along ``length_dims`` to the largest group, the groups
    are concatenated along ``batch_dim`` and ``inverse_order`` (item -> row of the concatenation)
    restores the original order. ``None`` means the concatenation is already in order.
    """
    if length_dims:
        target = {d: max(o.shape[d] for o in outputs) for d in length_dims}
        padded = []
        for o in outputs:
            spec: list[int] = []
            for d in range(o.dim() - 1, -1, -1):
                spec += [0, target[d] - o.shape[d] if d in target else 0]
            padded.append(F.pad(o, spec, value=fill) if any(spec) else o)
        outputs = padded
    merged = outputs[0] if len(outputs) == 1 else torch.cat(list(outputs), dim=batch_dim)
    if inverse_order is None:
        return merged
    return merged.index_select(batch_dim, inverse_order.to(merged.device))
