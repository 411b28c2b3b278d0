"""The pieces a :class:`~grabkit.group.collection.DataCollection` is made of.

``TensorData`` wraps one item or one group (a tensor or a nested dict of tensors); the helpers
read every item's lengths from its shapes, build one padder per annotated leaf, pad a group
tensor to a larger shape and lay a length mask out along an annotation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .annotation import CONST, LENGTH, Dim, Signature, iter_leaves, tree_get
from .plumbing import Padder, as_padder

__all__ = [
    "TensorData",
    "length_labels",
    "pad_to",
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
