"""``DataCollection``: a batch of variable-length (possibly nested) items, grouped by length.

Ungrouped, it is a list of items (each a tensor or nested dict of tensors) with a shape
annotation. Grouped, it is a list of padded group tensors plus every item's lengths and the
partition that says which item sits in which row, so module outputs can be put back in the
original order. Padding, splitting and merging are vectorised (see ``plumbing``).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .annotation import (
    BATCH,
    CONST,
    LENGTH,
    AnnotationError,
    Dim,
    KeyConversion,
    Signature,
    convert_keys,
    iter_leaves,
    map_tree,
    parse_annotation,
    tree_get,
)
from .groupers import Grouper
from .planning import as_length_matrix
from .plumbing import Padder, as_padder, length_mask, pad_stack

__all__ = [
    "DataCollection",
    "IncompatibleDataCollectionError",
    "TensorData",
    "warn_if_batch_coupled",
]

_FROM_MODULE = object()


class IncompatibleDataCollectionError(ValueError):
    """Two collections do not share items or grouping, so they cannot be combined."""


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

    def __repr__(self) -> str:
        if self.is_leaf:
            return f"TensorData(shape={tuple(self.value.shape)})"
        return f"TensorData(keys={self.keys()})"


def _padding_tree(signatures: Any, padding: Any, where: str = "padding") -> Any:
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
            k: _padding_tree(v, (padding or {}).get(k), f"{where}[{k!r}]")
            for k, v in signatures.items()
        }
    return as_padder(padding, where)


def _length_labels(signatures: Any) -> list[str]:
    labels: list[str] = []
    for _, sig in iter_leaves(signatures):
        labels += [label for _, label in sig.length_dims() if label not in labels]
    return labels


_BATCH_COUPLED: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def warn_if_batch_coupled(module: nn.Module, groups: int) -> None:
    """Warn (once per module) when a training-mode BatchNorm would see per-group statistics."""
    if groups <= 1 or not isinstance(module, nn.Module) or module in _warned:
        return
    coupled = [
        name for name, m in module.named_modules() if isinstance(m, _BATCH_COUPLED) and m.training
    ]
    if coupled:
        _warned.add(module)
        warnings.warn(
            f"{type(module).__name__} has batch-coupled layers in training mode ({coupled[:3]}); "
            f"run in {groups} groups they normalise each group with its own statistics, so "
            "results differ from the padded batch. Use LayerNorm/GroupNorm, eval mode, or "
            "UniGrouper for these layers.",
            stacklevel=3,
        )


class DataCollection:
    """Variable-length items with a shape annotation; group, apply modules, ungroup.

    Args:
        shape_annot: data-side annotation, e.g. ``"(B, L_seq, M_feat)"`` or a nested dict.
        data_list: the items; each a tensor (or nested dict) shaped like the annotation
            without ``B``.
        data_groups, length_info, data_partition: build an already grouped collection instead
            (``length_info[label][g][j]`` is the length of the ``j``-th item of group ``g``;
            ``data_partition[g]`` its item indices, consecutive by default).
        padding: pad value per leaf: ``None`` (zeros), a number, a ``Padder`` such as
            ``CDimPadder(torch.eye(3))``, or a nested dict of those.
    """

    def __init__(
        self,
        shape_annot: Any,
        data_list: Sequence[Any] | None = None,
        data_groups: Sequence[Any] | None = None,
        length_info: Mapping[str, Sequence[Sequence[int]]] | None = None,
        data_partition: Sequence[Sequence[int]] | None = None,
        padding: Any = None,
        validate: bool = True,
    ) -> None:
        self.shapesig_data = parse_annotation(shape_annot, "data", "shape_annot")
        self.preset_padding = (
            None if padding is None else _padding_tree(self.shapesig_data, padding)
        )
        self._dirty = False
        self._active_padding = None
        if data_list is not None:
            if data_groups is not None or length_info is not None or data_partition is not None:
                raise ValueError("give either data_list or data_groups with length_info, not both")
            self.data_list: list[TensorData] | None = [
                d if isinstance(d, TensorData) else TensorData(d) for d in data_list
            ]
            if not self.data_list:
                raise ValueError("data_list should hold at least one item, but it is empty")
            self.data_groups: list[TensorData] | None = None
            self._lengths = self._read_lengths(validate)
            self._groups: list[Tensor] | None = None
        elif data_groups is not None:
            if length_info is None:
                raise ValueError("data_groups needs length_info (label -> per-group lengths)")
            self.data_list = None
            self.data_groups = [
                d if isinstance(d, TensorData) else TensorData(d) for d in data_groups
            ]
            sizes = [self._group_size(g) for g in self.data_groups]
            if data_partition is None:
                bounds = torch.cumsum(torch.tensor([0, *sizes]), 0).tolist()
                data_partition = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
            self._groups = [
                torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in data_partition
            ]
            n = sum(sizes)
            self._lengths = {}
            for label, per_group in length_info.items():
                full = torch.zeros(n, dtype=torch.long)
                for g, (idx, values) in enumerate(zip(self._groups, per_group, strict=False)):
                    name = f"length_info[{label!r}][{g}]"
                    full[idx] = as_length_matrix(list(values), name, k=1)[:, 0]
                self._lengths[label] = full
        else:
            raise ValueError("give data_list, or data_groups with length_info")

    # ----------------------------------------------------------------- construction helpers
    @classmethod
    def _grouped(
        cls,
        signatures: Any,
        groups_data: list[TensorData],
        lengths: dict[str, Tensor],
        groups: list[Tensor],
        padding: Any = None,
        dirty: bool = False,
    ) -> DataCollection:
        dc = cls.__new__(cls)
        dc.shapesig_data = signatures
        dc.preset_padding = padding
        dc.data_list = None
        dc.data_groups = groups_data
        dc._lengths = lengths
        dc._groups = groups
        dc._dirty = dirty
        dc._active_padding = None
        return dc

    @classmethod
    def from_padded(
        cls,
        shape_annot: Any,
        padded: Any,
        lengths: Mapping[str, Sequence[int] | Tensor],
        padding: Any = None,
    ) -> DataCollection:
        """A collection holding one padded batch (one group, items in order), no per-item work.

        ``padded`` is a tensor (or nested dict) laid out as ``shape_annot``; ``lengths[label]``
        the ``(n,)`` item lengths. Call :meth:`regroup` to split it into length groups.
        """
        signatures = parse_annotation(shape_annot, "data", "shape_annot")
        labels = _length_labels(signatures)
        missing = set(labels) - set(lengths)
        if missing:
            raise ValueError(f"lengths should give every length label; missing {sorted(missing)}")
        table = {}
        for label, values in lengths.items():
            table[label] = as_length_matrix(values, f"lengths[{label!r}]", k=1)[:, 0]
        data = TensorData(padded)
        leaves = [(tree_get(padded, path), sig) for path, sig in iter_leaves(signatures)]
        n = leaves[0][0].shape[leaves[0][1].batch_index]
        for label, values in table.items():
            if len(values) != n:
                raise ValueError(f"lengths[{label!r}] has {len(values)} entries for {n} items")
        for tensor, sig in leaves:
            for pos, label in sig.length_dims():
                if n and int(table[label].max()) > tensor.shape[pos]:
                    raise ValueError(
                        f"a length {int(table[label].max())} in lengths[{label!r}] exceeds the "
                        f"padded size {tensor.shape[pos]} of dim {pos}"
                    )
        preset = None if padding is None else _padding_tree(signatures, padding)
        return cls._grouped(signatures, [data], table, [torch.arange(n)], preset)

    def _group_size(self, group: TensorData) -> int:
        path, sig = next(iter_leaves(self.shapesig_data))
        return tree_get(group.value, path).shape[sig.batch_index]

    def _read_lengths(self, validate: bool) -> dict[str, Tensor]:
        """Every item's size along each length label; checks ranks and fixed sizes."""
        lengths: dict[str, Tensor] = {}
        for path, sig in iter_leaves(self.shapesig_data):
            try:
                tensors = [tree_get(d.value, path) for d in self.data_list]
            except (KeyError, TypeError) as error:
                raise ValueError(
                    f"an item lacks key path {'/'.join(path)!r} of the annotation"
                ) from error
            item_dims = sig.item_dims()
            ranks = {t.dim() for t in tensors}
            if ranks != {len(item_dims)}:
                raise ValueError(
                    f"items at {'/'.join(path) or '(root)'} should have {len(item_dims)} dims "
                    f"for {sig} (without B), but have {sorted(ranks)}"
                )
            shapes = torch.tensor([tuple(t.shape) for t in tensors], dtype=torch.long)
            if shapes.dim() == 1:
                shapes = shapes.reshape(len(tensors), 0)
            for axis, dim in enumerate(item_dims):
                column = shapes[:, axis].contiguous()
                if dim.kind == LENGTH:
                    if dim.label in lengths and not torch.equal(lengths[dim.label], column):
                        bad = int((lengths[dim.label] != column).nonzero()[0])
                        raise ValueError(
                            f"item {bad}: length L_{dim.label} is {int(column[bad])} at "
                            f"{'/'.join(path)!r} but {int(lengths[dim.label][bad])} elsewhere"
                        )
                    lengths[dim.label] = column
                elif validate and len(column) and bool((column != column[0]).any()):
                    bad = int((column != column[0]).nonzero()[0])
                    raise ValueError(
                        f"item {bad} at {'/'.join(path) or '(root)'} has size {int(column[bad])} "
                        f"along {dim.render('data')}, but item 0 has {int(column[0])}; only L_ "
                        "dims may vary between items"
                    )
                elif validate and dim.kind == CONST and len(column) and int(column[0]) != dim.size:
                    raise ValueError(
                        f"items at {'/'.join(path) or '(root)'} have size {int(column[0])} where "
                        f"{sig} says {dim.size}"
                    )
        return lengths

    # ----------------------------------------------------------------- views and info
    @property
    def is_grouped(self) -> bool:
        return self.data_groups is not None

    def __len__(self) -> int:
        return len(self.data_list) if self.data_list is not None else sum(map(len, self._groups))

    @property
    def data_partition(self) -> list[list[int]] | None:
        """Item indices of each group (``None`` when ungrouped)."""
        return None if self._groups is None else [g.tolist() for g in self._groups]

    @property
    def length_info(self) -> dict[str, list[list[int]]] | None:
        """``{label: [[length of each item of group g] for g]}`` (``None`` when ungrouped)."""
        if self._groups is None:
            return None
        return {k: [v[g].tolist() for g in self._groups] for k, v in self._lengths.items()}

    @property
    def lengths(self) -> dict[str, Tensor]:
        """``{label: (n,) int64}``: every item's length, in the original item order."""
        return dict(self._lengths)

    def get_group_length_info(self, i: int) -> dict[str, list[int]]:
        self._need_grouped("get_group_length_info()")
        return {k: v[self._groups[i]].tolist() for k, v in self._lengths.items()}

    def _need_grouped(self, what: str) -> None:
        if not self.is_grouped:
            raise RuntimeError(f"{what} needs a grouped DataCollection; call group(grouper) first")

    def _padders(self, padding: Any) -> Any:
        if padding is not None and self.preset_padding is not None:
            raise ValueError(
                "this DataCollection already has padding set at construction; do not pass "
                "padding again"
            )
        if padding is not None:
            return _padding_tree(self.shapesig_data, padding)
        return self.preset_padding or _padding_tree(self.shapesig_data, None)

    def _lengths_for(self, sig: Signature, rows: Tensor | None = None) -> Tensor:
        columns = [self._lengths[label] for _, label in sig.length_dims()]
        if not columns:
            return torch.zeros((len(self), 0), dtype=torch.long)
        matrix = torch.stack(columns, dim=1)
        return matrix if rows is None else matrix[rows]

    # ----------------------------------------------------------------- grouping
    def group(self, grouper: Grouper, padding: Any = None, forget_order: bool = False) -> None:
        """Partition the items with ``grouper`` and pad each group to its own longest item."""
        if self.is_grouped:
            raise RuntimeError("already grouped; call ungroup() first, or regroup(grouper)")
        padders = self._padders(padding)
        plan = grouper.plan(self._lengths, len(self))
        full = {}
        for path, sig in iter_leaves(self.shapesig_data):
            items = [tree_get(d.value, path) for d in self.data_list]
            full[path] = pad_stack(items, sig, self._lengths_for(sig), tree_get(padders, path))
        self.data_list = None
        self._split(full, list(plan.groups), forget_order)
        self._active_padding = padders

    def _split(self, full: dict[tuple[str, ...], Tensor], groups: list[Tensor], forget: bool):
        """Cut full padded tensors (items in original order) into groups."""
        trivial = len(groups) == 1 and torch.equal(groups[0], torch.arange(len(groups[0])))
        per_group: list[dict] = [{} for _ in groups]
        for path, sig in iter_leaves(self.shapesig_data):
            tensor = full[path]
            b = sig.batch_index
            for g, idx in enumerate(groups):
                part = tensor  # narrow first, so the gather moves only the group's columns
                for pos, label in sig.length_dims():
                    size = int(self._lengths[label][idx].max()) if len(idx) else 0
                    if size < part.shape[pos]:
                        part = part.narrow(pos, 0, size)
                if not trivial:
                    part = part.index_select(b, idx.to(tensor.device))
                per_group[g][path] = part
        self.data_groups = [TensorData(self._assemble(parts)) for parts in per_group]
        if forget:
            order = torch.cat(groups)
            self._lengths = {k: v[order] for k, v in self._lengths.items()}
            bounds = torch.cumsum(torch.tensor([0, *map(len, groups)]), 0).tolist()
            groups = [torch.arange(a, b) for a, b in itertools.pairwise(bounds)]
        self._groups = groups
        self._dirty = False

    def _assemble(self, parts: dict[tuple[str, ...], Tensor]) -> Any:
        if () in parts:
            return parts[()]

        def build(tree: Any, prefix: tuple[str, ...]) -> Any:
            if isinstance(tree, Mapping):
                return {k: build(v, (*prefix, k)) for k, v in tree.items()}
            return parts[prefix]

        return build(self.shapesig_data, ())

    def _merge(self) -> dict[tuple[str, ...], Tensor]:
        """Full padded tensors, items in original order, padded positions reset to padding."""
        padders = self._active_padding or self._padders(None)
        trivial = len(self._groups) == 1 and torch.equal(
            self._groups[0], torch.arange(len(self._groups[0]))
        )
        order = torch.cat(self._groups)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        full = {}
        for path, sig in iter_leaves(self.shapesig_data):
            b = sig.batch_index
            tensors = [tree_get(g.value, path) for g in self.data_groups]
            padder = tree_get(padders, path)
            lens = sig.length_dims()
            target = {pos: int(self._lengths[label].max()) for pos, label in lens}
            target = {
                pos: max(size, *(t.shape[pos] for t in tensors)) for pos, size in target.items()
            }
            padded = [_pad_to(t, sig, target, padder) for t in tensors]
            merged = padded[0] if trivial else torch.cat(padded, dim=b)
            if not trivial:
                merged = merged.index_select(b, inverse.to(merged.device))
            if lens and self._dirty:
                mask = _place_mask(
                    length_mask(self._lengths_for(sig), [merged.shape[p] for p, _ in lens]),
                    sig,
                    merged.shape,
                )
                merged = torch.where(
                    mask.to(merged.device),
                    merged,
                    padder.background(merged.shape, sig, merged.dtype, merged.device),
                )
            full[path] = merged
        return full

    def ungroup(self) -> None:
        """Back to a list of items (unpadded, in the original order)."""
        self._need_grouped("ungroup()")
        n = len(self)
        items: list[dict] = [{} for _ in range(n)]
        for path, sig in iter_leaves(self.shapesig_data):
            b = sig.batch_index
            lens = sig.length_dims()
            for group, idx in zip(self.data_groups, self._groups, strict=False):
                tensor = tree_get(group.value, path)
                rows = tensor.unbind(b)
                length_rows = self._lengths_for(sig, idx).tolist()
                for row, item, row_lengths in zip(rows, idx.tolist(), length_rows, strict=False):
                    for (pos, _), size in zip(lens, row_lengths, strict=False):
                        row = row.narrow(pos - (pos > b), 0, size)
                    items[item][path] = row
        self.data_list = [TensorData(self._assemble(parts)) for parts in items]
        self.data_groups = None
        self._groups = None
        self._dirty = False
        self._active_padding = None

    def regroup(self, grouper: Grouper, padding: Any = None, forget_order: bool = False) -> None:
        """Group again with another grouper; from a grouped state this never builds items."""
        if not self.is_grouped:
            self.group(grouper, padding, forget_order)
            return
        if padding is not None:
            self.ungroup()
            self.group(grouper, padding, forget_order)
            return
        full = self._merge()
        plan = grouper.plan(self._lengths, len(self))
        self._split(full, list(plan.groups), forget_order)

    # ----------------------------------------------------------------- masks
    def get_mask(
        self, i: int, key_conv: KeyConversion | None = None, mask_hint: Any = "copy"
    ) -> Any:
        """The mask of group ``i``: True at real (not padded) positions.

        ``mask_hint="copy"``: a bool tensor shaped like every tensor (nested like the data);
        a list of length labels: one ``(n_g, L_a, L_b, ...)`` tensor. A position is real when it
        is inside the item along every length dim.
        """
        self._need_grouped("get_mask()")
        idx = self._groups[i]
        group = self.data_groups[i]
        if mask_hint == "copy":

            def leaf_mask(sig: Signature, tensor: Tensor) -> Tensor:
                lens = sig.length_dims()
                if not lens:
                    return torch.ones_like(tensor, dtype=torch.bool)
                base = length_mask(
                    self._lengths_for(sig, idx), [tensor.shape[p] for p, _ in lens], tensor.device
                )
                return _place_mask(base, sig, tensor.shape).contiguous()

            masks = map_tree(leaf_mask, self.shapesig_data, group.value)
            return convert_keys(masks, key_conv)
        if isinstance(mask_hint, str) or not isinstance(mask_hint, Sequence) or not mask_hint:
            raise ValueError(
                "mask_hint should be None, 'copy' or a non-empty list of length labels, but got "
                f"{mask_hint!r}"
            )
        unknown = [label for label in mask_hint if label not in self._lengths]
        if unknown:
            raise ValueError(
                f"mask_hint labels {unknown} are not length labels; known: {sorted(self._lengths)}"
            )
        matrix = torch.stack([self._lengths[label][idx] for label in mask_hint], dim=1)
        device = next(t for _, t in iter_leaves(group.value)).device
        return length_mask(matrix, matrix.max(0).values.tolist(), device).contiguous()

    # ----------------------------------------------------------------- modules
    def apply(
        self,
        module: nn.Module,
        mask_hint: Any = _FROM_MODULE,
        input_key_conv: KeyConversion | None = None,
        output_key_conv: KeyConversion | None = None,
    ) -> DataCollection:
        """Run ``module`` once per group; returns the grouped outputs as a new collection.

        ``mask_hint`` defaults to ``module.get_mask_hint()``; pass ``None``, ``"copy"`` or a
        list of (module or data) length labels to override it. ``input_key_conv`` /
        ``output_key_conv`` rename dict keys (``{old: (new, sub_conversion)}``) on the way in
        and out.
        """
        self._need_grouped("apply()")
        if not callable(getattr(module, "get_input_annot", None)):
            raise TypeError(
                f"apply() needs an AnnotatedModule (with get_input_annot/get_output_annot), got "
                f"{type(module).__name__}; for a plain nn.Module use grabkit.group.run_grouped"
            )
        inputs = convert_keys(self.shapesig_data, input_key_conv)
        out_sigs, binding = module.resolve(inputs)
        hint = module.get_mask_hint() if mask_hint is _FROM_MODULE else mask_hint
        if isinstance(hint, Sequence) and not isinstance(hint, str):
            hint = [self._data_label(label, binding) for label in hint]
        derived = {
            self._data_label(label, binding): fn
            for label, fn in (getattr(module, "get_output_lengths", dict)() or {}).items()
        }
        warn_if_batch_coupled(module, len(self.data_groups))
        new_lengths: dict[str, Tensor] = {}
        for label in _length_labels(out_sigs):
            base = self._lengths[label]
            if label in derived:
                base = torch.as_tensor(derived[label](base.clone())).to(torch.long).cpu()
                if base.shape != self._lengths[label].shape or bool((base < 0).any()):
                    raise ValueError(
                        f"get_output_lengths()[{label!r}] should map {len(self)} input lengths to "
                        f"as many non-negative output lengths, but gave {base.tolist()[:8]}..."
                    )
            new_lengths[label] = base
        outputs = []
        for i, group in enumerate(self.data_groups):
            value = convert_keys(group.value, input_key_conv)
            if hint is None:
                out = module(value)
            else:
                out = module(value, self.get_mask(i, key_conv=input_key_conv, mask_hint=hint))
            out = convert_keys(out, output_key_conv)
            self._check_output(
                out, convert_keys(out_sigs, output_key_conv), i, new_lengths, derived
            )
            outputs.append(TensorData(out))
        return DataCollection._grouped(
            convert_keys(out_sigs, output_key_conv),
            outputs,
            new_lengths,
            self._groups,
            dirty=True,
        )

    def _data_label(self, label: str, binding: Mapping[str, str]) -> str:
        if label in binding:
            return binding[label]
        if label in self._lengths:
            return label
        raise ValueError(
            f"length label {label!r} is neither a module label bound by the input annotation "
            f"({sorted(binding)}) nor a data label ({sorted(self._lengths)})"
        )

    def _check_output(
        self,
        out: Any,
        sigs: Any,
        i: int,
        lengths: Mapping[str, Tensor],
        derived: Mapping[str, Callable],
    ) -> None:
        idx = self._groups[i]
        for path, sig in iter_leaves(sigs):
            where = f"group {i} output {'/'.join(path) or '(root)'}"
            try:
                tensor = tree_get(out, path)
            except (KeyError, TypeError, IndexError) as error:
                raise AnnotationError(
                    f"{where}: missing, but the output annotation has it"
                ) from error
            if not isinstance(tensor, Tensor) or tensor.dim() != len(sig):
                got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise AnnotationError(f"{where}: expected a {len(sig)}-dim tensor {sig}, got {got}")
            for pos, dim in enumerate(sig.dims):
                size = tensor.shape[pos]
                if dim.kind == BATCH and size != len(idx):
                    raise AnnotationError(
                        f"{where}: batch dim has {size} rows for {len(idx)} items"
                    )
                if dim.kind == CONST and size != dim.size:
                    raise AnnotationError(f"{where}: dim {pos} is {size}, annotated {dim.size}")
                if dim.kind == LENGTH:
                    need = int(lengths[dim.label][idx].max()) if len(idx) else 0
                    padded = int(self._lengths[dim.label][idx].max()) if len(idx) else 0
                    if size < need or (dim.label not in derived and size != padded):
                        raise AnnotationError(
                            f"{where}: size {size} along L_{dim.label}, but the group is padded "
                            f"to {padded}; a module that changes a length should define "
                            "get_output_lengths() returning {label: fn(input_lengths)}"
                        )

    # ----------------------------------------------------------------- nesting
    def _nested_signatures(self, bdim_idx: int, new_ldim_label: str) -> Any:
        if new_ldim_label in self._lengths:
            raise ValueError(f"length label {new_ldim_label!r} is already in use")

        def convert(sig: Signature) -> Signature:
            dims = [Dim(LENGTH, new_ldim_label) if d.kind == BATCH else d for d in sig.dims]
            where = bdim_idx if bdim_idx >= 0 else bdim_idx + len(dims) + 1
            if not 0 <= where <= len(dims):
                raise ValueError(f"bdim_idx={bdim_idx} is out of range for {sig}")
            dims.insert(where, Dim(BATCH))
            return Signature(tuple(dims), "data")

        return map_tree(convert, self.shapesig_data)

    def groups_as_data(
        self, bdim_idx: int, new_ldim_label: str, padding: Any = None
    ) -> DataCollection:
        """A new (ungrouped) collection whose items are this collection's groups.

        The batch dim of each group becomes length dim ``L_<new_ldim_label>`` and a new batch
        dim is inserted at ``bdim_idx``: a ragged list of ragged items, ready to group again.
        """
        self._need_grouped("groups_as_data()")
        signatures = self._nested_signatures(bdim_idx, new_ldim_label)
        if padding is None and self.preset_padding is not None:
            padding = self.preset_padding
        return DataCollection(signatures, data_list=list(self.data_groups), padding=padding)

    def masks_as_data(
        self, bdim_idx: int, new_ldim_label: str, padding: Any = None
    ) -> DataCollection:
        """Like :meth:`groups_as_data`, with each group's ``'copy'`` masks as the items."""
        self._need_grouped("masks_as_data()")
        signatures = self._nested_signatures(bdim_idx, new_ldim_label)
        masks = [self.get_mask(i) for i in range(len(self.data_groups))]
        return DataCollection(signatures, data_list=masks, padding=padding)

    # ----------------------------------------------------------------- devices
    def _map_tensors(
        self, fn: Callable[[Tensor], Tensor], device: torch.device | str | None = None
    ) -> DataCollection:
        padding = self.preset_padding
        if padding is not None and device is not None:
            padding = map_tree(lambda p: p.to(device), padding)

        def move(data: TensorData) -> TensorData:
            return TensorData(map_tree(fn, data.value))

        if self.is_grouped:
            dc = DataCollection._grouped(
                self.shapesig_data,
                [move(g) for g in self.data_groups],
                dict(self._lengths),
                list(self._groups),
                padding,
                self._dirty,
            )
            active = self._active_padding
            if active is not None and device is not None:
                active = map_tree(lambda p: p.to(device), active)
            dc._active_padding = active
            return dc
        dc = DataCollection._grouped(self.shapesig_data, None, dict(self._lengths), None, padding)
        dc.data_list = [move(d) for d in self.data_list]
        return dc

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DataCollection:
        """A copy on ``device`` (lengths and partition stay on the CPU)."""
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking), device)

    def to_device(self, device: torch.device | str) -> DataCollection:
        return self.to(device)

    def pin_memory(self) -> DataCollection:
        """Page-locked copy, so ``DataLoader(pin_memory=True)`` and non-blocking copies work."""
        return self._map_tensors(lambda t: t.pin_memory())

    # ----------------------------------------------------------------- keys
    def __getitem__(self, key: str) -> DataCollection:
        if not isinstance(self.shapesig_data, Mapping):
            raise KeyError(f"this DataCollection holds tensors, not dicts; no key {key!r}")
        if key not in self.shapesig_data:
            raise KeyError(f"no key {key!r}; keys are {list(self.shapesig_data)}")
        signatures = self.shapesig_data[key]
        labels = _length_labels(signatures)
        lengths = {k: v for k, v in self._lengths.items() if k in labels}
        padding = None if self.preset_padding is None else self.preset_padding[key]
        if self.is_grouped:
            groups = [g[key] for g in self.data_groups]
            dc = DataCollection._grouped(
                signatures, groups, lengths, list(self._groups), padding, self._dirty
            )
            if self._active_padding is not None:
                dc._active_padding = self._active_padding[key]
            return dc
        dc = DataCollection._grouped(signatures, None, lengths, None, padding)
        dc.data_list = [d[key] for d in self.data_list]
        return dc

    def _same_grouping(self, other: DataCollection) -> bool:
        if self.is_grouped != other.is_grouped or len(self) != len(other):
            return False
        if not self.is_grouped:
            return True
        return len(self._groups) == len(other._groups) and all(
            torch.equal(a, b) for a, b in zip(self._groups, other._groups, strict=False)
        )

    def __setitem__(self, key: str, sub: DataCollection) -> None:
        if not isinstance(self.shapesig_data, Mapping):
            raise KeyError("this DataCollection holds tensors, not dicts; cannot set a key")
        if not self._same_grouping(sub):
            raise IncompatibleDataCollectionError(
                "the two DataCollections do not hold the same items in the same groups; group "
                "both with the same grouper first"
            )
        for label, values in sub._lengths.items():
            if label in self._lengths and not torch.equal(self._lengths[label], values):
                raise IncompatibleDataCollectionError(f"length label {label!r} disagrees")
        if self.is_grouped:
            for mine, theirs in zip(self.data_groups, sub.data_groups, strict=False):
                mine.value[key] = theirs.value
        else:
            for mine, theirs in zip(self.data_list, sub.data_list, strict=False):
                mine.value[key] = theirs.value
        self.shapesig_data[key] = sub.shapesig_data
        self._lengths.update(sub._lengths)
        self._dirty = self._dirty or sub._dirty
        others = {k: v for k, v in self.shapesig_data.items() if k != key}
        theirs = sub.preset_padding or _padding_tree(sub.shapesig_data, None)
        if self.preset_padding is not None or sub.preset_padding is not None:
            self.preset_padding = dict(self.preset_padding or _padding_tree(others, None))
            self.preset_padding[key] = theirs
        if self._active_padding is not None:
            self._active_padding = dict(self._active_padding)
            self._active_padding[key] = sub._active_padding or theirs

    @classmethod
    def from_dict(cls, collections: Mapping[str, DataCollection]) -> DataCollection:
        """Combine collections over the same items (and grouping) under new top-level keys."""
        if not collections:
            raise ValueError("from_dict needs at least one DataCollection")
        first, *rest = collections.values()
        for i, dc in enumerate(rest, start=2):
            if not first._same_grouping(dc):
                raise IncompatibleDataCollectionError(
                    f"collection {i} does not hold the same items in the same groups as the first"
                )
        combined = cls._grouped(
            {},
            [TensorData({}) for _ in first.data_groups] if first.is_grouped else None,
            {},
            None if first._groups is None else list(first._groups),
        )
        if not first.is_grouped:
            combined.data_list = [TensorData({}) for _ in range(len(first))]
        for key, dc in collections.items():
            combined[key] = dc
        return combined

    def __repr__(self) -> str:
        state = f"{len(self.data_groups)} groups" if self.is_grouped else "ungrouped"
        return f"DataCollection({len(self)} items, {state}, labels={sorted(self._lengths)})"


def _pad_to(tensor: Tensor, sig: Signature, target: Mapping[int, int], padder: Padder) -> Tensor:
    """Pad ``tensor`` along length positions to ``target`` sizes with ``padder``'s values."""
    if all(tensor.shape[p] == s for p, s in target.items()):
        return tensor
    shape = list(tensor.shape)
    for pos, size in target.items():
        shape[pos] = size
    out = padder.background(shape, sig, tensor.dtype, tensor.device)
    out[tuple(slice(0, s) for s in tensor.shape)] = tensor
    return out


def _place_mask(mask: Tensor, sig: Signature, shape: Sequence[int]) -> Tensor:
    """Lay a ``(n, L_1, ..., L_k)`` mask out as ``sig`` and broadcast it to ``shape``."""
    positions = [sig.batch_index] + [p for p, _ in sig.length_dims()]
    order = sorted(range(len(positions)), key=positions.__getitem__)
    mask = mask.permute(order)
    view = [1] * len(shape)
    for p in positions:
        view[p] = shape[p]
    return mask.reshape(view).expand(tuple(shape))
