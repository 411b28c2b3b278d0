"""The pieces a :class:`~grabkit.group.collection.DataCollection` is made of.

``TensorData`` wraps one item or one group (a tensor or a nested dict of tensors);
:class:`Grouping` is the grouped form. The helpers read every item's lengths from its shapes (or
check the lengths given for a padded batch), build one padder per annotated leaf, pad a group
tensor to a larger shape, lay a length mask out along an annotation and nest signatures.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .annotation import BATCH, CONST, LENGTH, Dim, Signature, iter_leaves, map_tree, tree_get
from .planning import as_length_matrix
from .plumbing import Padder, as_padder, length_mask

__all__ = [
    "Grouping",
    "TensorData",
    "assemble",
    "consecutive",
    "copy_masks",
    "group_size",
    "grouped_lengths",
    "label_mask",
    "length_labels",
    "lengths_for",
    "nested_signatures",
    "pad_to",
    "padded_lengths",
    "padding_tree",
    "place_mask",
    "read_item_lengths",
]


class TensorData:
    """A tensor or a nested dict of tensors; ``value`` is the raw object, ``[key]`` a subtree."""

    def __init__(self, value: Tensor | Mapping[str, Any]) -> None:
        self.value = value

    @property
    def is_leaf(self) -> bool:
        return not isinstance(self.value, Mapping)

    def __getitem__(self, key: str) -> TensorData:
        if self.is_leaf:
            raise KeyError(f"this TensorData is a tensor, not a dict; cannot look up {key!r}")
        return TensorData(self.value[key])

    def __contains__(self, key: str) -> bool:
        return not self.is_leaf and key in self.value

    def keys(self) -> list[str]:
        return [] if self.is_leaf else list(self.value)

    def with_key(self, key: str, value: Any) -> TensorData:
        """A new TensorData with ``key`` set; this one (and any dict it shares) is untouched."""
        return TensorData({**self.value, key: value})

    def __repr__(self) -> str:
        if self.is_leaf:
            return f"TensorData(shape={tuple(self.value.shape)})"
        return f"TensorData(keys={self.keys()})"


def as_tensor_data(values: Sequence[Any]) -> list[TensorData]:
    return [v if isinstance(v, TensorData) else TensorData(v) for v in values]


def padding_tree(signatures: Any, padding: Any, where: str = "padding") -> Any:
    """A Padder for every leaf of ``signatures`` (zeros where ``padding`` says nothing)."""
    if isinstance(signatures, Mapping):
        if padding is not None and not isinstance(padding, Mapping):
            raise TypeError(
                f"{where} should be a dict mirroring the annotation's keys, got {type(padding)!r}"
            )
        unknown = set(padding or {}) - set(signatures)
        if unknown:
            raise ValueError(
                f"{where} names keys {sorted(unknown)} that the annotation does not have; known "
                f"keys: {sorted(signatures)}"
            )
        return {
            k: padding_tree(v, (padding or {}).get(k), f"{where}[{k!r}]")
            for k, v in signatures.items()
        }
    return as_padder(padding, where)


def length_labels(signatures: Any) -> list[str]:
    """The length labels of every leaf, each once, in order of first appearance."""
    labels: list[str] = []
    for _, sig in iter_leaves(signatures):
        labels += [label for _, label in sig.length_dims() if label not in labels]
    return labels


def _where(path: tuple[str, ...]) -> str:
    return "/".join(path) or "(root)"


def _leaf_shapes(items: Sequence[TensorData], path: tuple[str, ...], sig: Signature) -> Tensor:
    """``(n, item rank)`` int64: the shape of every item's tensor at ``path``."""
    try:
        tensors = [tree_get(d.value, path) for d in items]
    except (KeyError, TypeError) as error:
        raise ValueError(f"an item lacks key path {'/'.join(path)!r} of the annotation") from error
    item_dims = sig.item_dims()
    ranks = {t.dim() for t in tensors}
    if ranks != {len(item_dims)}:
        raise ValueError(
            f"items at {_where(path)} should have {len(item_dims)} dims for {sig} (without B), "
            f"but have {sorted(ranks)}"
        )
    return torch.tensor([tuple(t.shape) for t in tensors], dtype=torch.long).reshape(
        len(tensors), len(item_dims)
    )


def _check_fixed(column: Tensor, dim: Dim, path: tuple[str, ...], sig: Signature) -> None:
    """Every item has the same size along a non-length dim (the annotated one, if constant)."""
    if not len(column):
        return
    if bool((column != column[0]).any()):
        bad = int((column != column[0]).nonzero()[0])
        raise ValueError(
            f"item {bad} at {_where(path)} has size {int(column[bad])} along "
            f"{dim.render('data')}, but item 0 has {int(column[0])}; only L_ dims may vary "
            "between items"
        )
    if dim.kind == CONST and int(column[0]) != dim.size:
        raise ValueError(
            f"items at {_where(path)} have size {int(column[0])} where {sig} says {dim.size}"
        )


def read_item_lengths(
    signatures: Any, items: Sequence[TensorData], validate: bool = True
) -> dict[str, Tensor]:
    """``{label: (n,) int64}``: every item's size along each length label.

    Checks ranks and that a label has one size per item across leaves; with ``validate`` also
    that the other dims agree between items and with constant sizes.
    """
    lengths: dict[str, Tensor] = {}
    for path, sig in iter_leaves(signatures):
        shapes = _leaf_shapes(items, path, sig)
        for axis, dim in enumerate(sig.item_dims()):
            column = shapes[:, axis].contiguous()
            if dim.kind != LENGTH:
                if validate:
                    _check_fixed(column, dim, path, sig)
                continue
            seen = lengths.setdefault(dim.label, column)
            if not torch.equal(seen, column):
                bad = int((seen != column).nonzero()[0])
                raise ValueError(
                    f"item {bad}: length L_{dim.label} is {int(column[bad])} at "
                    f"{'/'.join(path)!r} but {int(seen[bad])} elsewhere"
                )
    return lengths


def pad_to(tensor: Tensor, sig: Signature, target: Mapping[int, int], padder: Padder) -> Tensor:
    """Pad ``tensor`` along length positions to ``target`` sizes with ``padder``'s values."""
    if all(tensor.shape[p] == s for p, s in target.items()):
        return tensor
    shape = list(tensor.shape)
    for pos, size in target.items():
        shape[pos] = size
    out = padder.background(shape, sig, tensor.dtype, tensor.device)
    out[tuple(slice(0, s) for s in tensor.shape)] = tensor
    return out


def place_mask(mask: Tensor, sig: Signature, shape: Sequence[int]) -> Tensor:
    """Lay a ``(n, L_1, ..., L_k)`` mask out as ``sig`` and broadcast it to ``shape``."""
    positions = [sig.batch_index] + [p for p, _ in sig.length_dims()]
    order = sorted(range(len(positions)), key=positions.__getitem__)
    mask = mask.permute(order)
    view = [1] * len(shape)
    for p in positions:
        view[p] = shape[p]
    return mask.reshape(view).expand(tuple(shape))


@dataclass
class Grouping:
    """The grouped form of a collection.

    ``data[g]``: group ``g``'s padded tensors (a tree like the annotation); ``partition[g]``:
    its item indices, int64 CPU; ``dirty``: padded positions may hold module output rather than
    padding (reset on merge); ``padding``: the padder tree the groups were padded with (``None``
    for module outputs: the preset padding or zeros).
    """

    data: list[TensorData]
    partition: list[Tensor]
    dirty: bool = False
    padding: Any = None

    @property
    def is_identity(self) -> bool:
        """One group holding every item in order: split and merge are no-ops."""
        p = self.partition
        return len(p) == 1 and torch.equal(p[0], torch.arange(len(p[0])))


def consecutive(sizes: Sequence[int]) -> list[Tensor]:
    bounds = torch.cumsum(torch.tensor([0, *sizes], dtype=torch.long), 0).tolist()
    return [torch.arange(a, b) for a, b in itertools.pairwise(bounds)]


def group_size(signatures: Any, group: TensorData) -> int:
    path, sig = next(iter_leaves(signatures))
    return tree_get(group.value, path).shape[sig.batch_index]


def _check_partition(partition: list[Tensor], sizes: list[int]) -> None:
    """``partition[g]`` names ``sizes[g]`` items; together every index ``0..n-1`` once."""
    if len(partition) != len(sizes):
        raise ValueError(f"data_partition has {len(partition)} groups for {len(sizes)}")
    for g, (idx, rows) in enumerate(zip(partition, sizes, strict=True)):
        if len(idx) != rows:
            raise ValueError(
                f"data_partition[{g}] has {len(idx)} items but group {g} has {rows} rows"
            )
    n = sum(sizes)
    seen = torch.cat(partition) if partition else torch.zeros(0, dtype=torch.long)
    if not torch.equal(seen.sort().values, torch.arange(n)):
        raise ValueError(f"data_partition should hold every item index 0..{n - 1} exactly once")


def grouped_lengths(
    signatures: Any,
    groups: list[TensorData],
    partition: list[Tensor],
    length_info: Mapping[str, Sequence[Sequence[int]]],
) -> dict[str, Tensor]:
    """``{label: (n,) int64}`` from per-group lengths (``length_info[label][g][j]``), checked.

    The partition must cover every item once, match the groups' row counts, and give each
    length label one int per item, none above its group's padded size.
    """
    sizes = [group_size(signatures, g) for g in groups]
    _check_partition(partition, sizes)
    missing = set(length_labels(signatures)) - set(length_info)
    if missing:
        raise ValueError(f"length_info should give every length label; missing {sorted(missing)}")
    lengths = {}
    for label, per_group in length_info.items():
        if len(per_group) != len(groups):
            raise ValueError(
                f"length_info[{label!r}] gives {len(per_group)} groups for {len(groups)}"
            )
        full = torch.zeros(sum(sizes), dtype=torch.long)
        for g, (idx, values) in enumerate(zip(partition, per_group, strict=True)):
            where = f"length_info[{label!r}][{g}]"
            column = as_length_matrix(list(values), where, k=1)[:, 0]
            if len(column) != len(idx):
                raise ValueError(f"{where} has {len(column)} lengths for {len(idx)} items")
            full[idx] = column
        lengths[label] = full
    for g, (data, idx) in enumerate(zip(groups, partition, strict=True)):
        group_lengths = {k: v[idx] for k, v in lengths.items()}
        padded_lengths(signatures, data, group_lengths, f"length_info (group {g})")
    return lengths


def nested_signatures(
    signatures: Any, lengths: Mapping[str, Tensor], bdim_idx: int, new_ldim_label: str
) -> Any:
    """Signatures of groups taken as items.

    Each group's ``B`` becomes length dim ``L_<new_ldim_label>`` and a new ``B`` is inserted at
    ``bdim_idx``.
    """
    if new_ldim_label in lengths:
        raise ValueError(f"length label {new_ldim_label!r} is already in use")

    def convert(sig: Signature) -> Signature:
        dims = [Dim(LENGTH, new_ldim_label) if d.kind == BATCH else d for d in sig.dims]
        where = bdim_idx if bdim_idx >= 0 else bdim_idx + len(dims) + 1
        if not 0 <= where <= len(dims):
            raise ValueError(f"bdim_idx={bdim_idx} is out of range for {sig}")
        dims.insert(where, Dim(BATCH))
        return Signature(tuple(dims), "data")

    return map_tree(convert, signatures)


def assemble(signatures: Any, parts: Mapping[tuple[str, ...], Tensor]) -> Any:
    """The tree shaped like ``signatures`` whose leaf at each key path is ``parts[path]``."""
    if () in parts:
        return parts[()]

    def build(tree: Any, prefix: tuple[str, ...]) -> Any:
        if isinstance(tree, Mapping):
            return {k: build(v, (*prefix, k)) for k, v in tree.items()}
        return parts[prefix]

    return build(signatures, ())


def padded_lengths(
    signatures: Any,
    data: TensorData,
    lengths: Mapping[str, Sequence[int] | Tensor],
    name: str = "lengths",
) -> dict[str, Tensor]:
    """``{label: (n,) int64}`` for one padded batch, checked against its shapes.

    Every label must be given, as ints, one per row, none above the padded size.
    """
    missing = set(length_labels(signatures)) - set(lengths)
    if missing:
        raise ValueError(f"{name} should give every length label; missing {sorted(missing)}")
    table = {
        label: as_length_matrix(values, f"{name}[{label!r}]", k=1)[:, 0]
        for label, values in lengths.items()
    }
    n = group_size(signatures, data)
    for label, values in table.items():
        if len(values) != n:
            raise ValueError(f"{name}[{label!r}] has {len(values)} entries for {n} items")
    for path, sig in iter_leaves(signatures):
        size = tree_get(data.value, path).shape
        for pos, label in sig.length_dims():
            if n and int(table[label].max()) > size[pos]:
                raise ValueError(
                    f"a length {int(table[label].max())} in {name}[{label!r}] exceeds the "
                    f"padded size {size[pos]} of dim {pos}"
                )
    return table


def lengths_for(
    lengths: Mapping[str, Tensor], sig: Signature, n: int, rows: Tensor | None = None
) -> Tensor:
    """``(n, k)`` int64: the ``n`` items' lengths along ``sig``'s ``k`` length dims.

    With ``rows``, only those items (``(len(rows), k)``).
    """
    columns = [lengths[label] for _, label in sig.length_dims()]
    if not columns:
        return torch.zeros((n if rows is None else len(rows), 0), dtype=torch.long)
    matrix = torch.stack(columns, dim=1)
    return matrix if rows is None else matrix[rows]


def copy_masks(
    signatures: Any, lengths: Mapping[str, Tensor], idx: Tensor, group: TensorData
) -> Any:
    """Bool masks shaped like every tensor of ``group`` (items ``idx``): True where real."""

    def leaf_mask(sig: Signature, tensor: Tensor) -> Tensor:
        lens = sig.length_dims()
        if not lens:
            return torch.ones_like(tensor, dtype=torch.bool)
        sizes = [tensor.shape[p] for p, _ in lens]
        base = length_mask(lengths_for(lengths, sig, 0, idx), sizes, tensor.device)
        return place_mask(base, sig, tensor.shape).contiguous()

    return map_tree(leaf_mask, signatures, group.value)


def label_mask(
    lengths: Mapping[str, Tensor], idx: Tensor, group: TensorData, labels: Any
) -> Tensor:
    """One ``(n_g, L_a, L_b, ...)`` bool mask over the length ``labels`` of items ``idx``."""
    if isinstance(labels, str) or not isinstance(labels, Sequence) or not labels:
        raise ValueError(
            "mask_hint should be None, 'copy' or a non-empty list of length labels, but got "
            f"{labels!r}"
        )
    unknown = [label for label in labels if label not in lengths]
    if unknown:
        raise ValueError(
            f"mask_hint labels {unknown} are not length labels; known: {sorted(lengths)}"
        )
    matrix = torch.stack([lengths[label][idx] for label in labels], dim=1)
    device = next(t for _, t in iter_leaves(group.value)).device
    return length_mask(matrix, matrix.max(0).values.tolist(), device).contiguous()
