"""``DataCollection``: a batch of variable-length (possibly nested) items, grouped by length.

Ungrouped, it is a list of items (each a tensor or nested dict of tensors) with a shape
annotation. Grouped, it holds a :class:`Grouping`: padded group tensors, the partition that says
which item sits in which row, and the padders used, so module outputs can be put back in the
original order. Padding, splitting and merging are vectorised (see ``plumbing``).

A collection never mutates a container it may share with another (``to``, ``pin_memory`` and
``[key]`` return collections sharing tensors and signature dicts): ``__setitem__`` builds new
dicts, so setting a key on a copy leaves the original untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from .annotation import (
    KeyConversion,
    convert_keys,
    iter_leaves,
    map_tree,
    parse_annotation,
    tree_get,
)
from .application import FROM_MODULE, apply_module
from .groupers import Grouper
from .items import (
    Grouping,
    TensorData,
    as_tensor_data,
    assemble,
    consecutive,
    copy_masks,
    group_size,
    grouped_lengths,
    label_mask,
    length_labels,
    lengths_for,
    nested_signatures,
    pad_to,
    padded_lengths,
    padding_tree,
    place_mask,
    read_item_lengths,
)
from .planning import GroupPlan
from .plumbing import length_mask, merge_groups, narrow_gather, pad_stack

__all__ = [
    "DataCollection",
    "IncompatibleDataCollectionError",
    "TensorData",
]

Leaves = dict[tuple[str, ...], Tensor]  # key path -> full padded tensor, items in original order


class IncompatibleDataCollectionError(ValueError):
    """Two collections do not share items or grouping, so they cannot be combined."""


class DataCollection:
    """Variable-length items with a shape annotation; group, apply modules, ungroup.

    Args:
        shape_annot: data-side annotation, e.g. ``"(B, L_seq, M_feat)"`` or a nested dict.
        data_list: the items; each a tensor (or nested dict) shaped like the annotation
            without ``B``.
        data_groups: build an already grouped collection instead, from these groups (with
            ``length_info`` and ``data_partition``).
        length_info: ``length_info[label][g][j]`` is the length of the ``j``-th item of group
            ``g`` (with ``data_groups``).
        data_partition: ``data_partition[g]`` are group ``g``'s item indices, consecutive by
            default (with ``data_groups``).
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
        signatures = parse_annotation(shape_annot, "data", "shape_annot")
        preset = None if padding is None else padding_tree(signatures, padding)
        if data_list is not None:
            if data_groups is not None or length_info is not None or data_partition is not None:
                raise ValueError("give either data_list or data_groups with length_info, not both")
            items = as_tensor_data(data_list)
            if not items:
                raise ValueError("data_list should hold at least one item, but it is empty")
            lengths = read_item_lengths(signatures, items, validate)
            self._init(signatures, preset, lengths, items=items)
        elif data_groups is not None:
            if length_info is None:
                raise ValueError("data_groups needs length_info (label -> per-group lengths)")
            groups = as_tensor_data(data_groups)
            partition = (
                consecutive([group_size(signatures, g) for g in groups])
                if data_partition is None
                else [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in data_partition]
            )
            lengths = grouped_lengths(signatures, groups, partition, length_info)
            self._init(signatures, preset, lengths, grouping=Grouping(groups, partition))
        else:
            raise ValueError("give data_list, or data_groups with length_info")

    def _init(
        self,
        signatures: Any,
        preset_padding: Any,
        lengths: dict[str, Tensor],
        items: list[TensorData] | None = None,
        grouping: Grouping | None = None,
    ) -> None:
        """Every field, in one place: exactly one of ``items`` and ``grouping`` is given."""
        self.shapesig_data = signatures
        self.preset_padding = preset_padding
        self._lengths = lengths
        self._items = items
        self._grouping = grouping

    @classmethod
    def _make(
        cls, signatures: Any, preset_padding: Any, lengths: dict[str, Tensor], **form: Any
    ) -> DataCollection:
        """A collection from parsed parts, unchecked; ``form`` is ``items=`` or ``grouping=``."""
        dc = cls.__new__(cls)
        dc._init(signatures, preset_padding, lengths, **form)
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
        data = TensorData(padded)
        table = padded_lengths(signatures, data, lengths)
        preset = None if padding is None else padding_tree(signatures, padding)
        grouping = Grouping([data], [torch.arange(group_size(signatures, data))])
        return cls._make(signatures, preset, table, grouping=grouping)

    # ----------------------------------------------------------------- views and info
    @property
    def is_grouped(self) -> bool:
        return self._grouping is not None

    @property
    def data_list(self) -> list[TensorData] | None:
        """The items (``None`` when grouped)."""
        return self._items

    @property
    def data_groups(self) -> list[TensorData] | None:
        """One padded tree per group (``None`` when ungrouped)."""
        return None if self._grouping is None else self._grouping.data

    @property
    def partition(self) -> list[Tensor]:
        """Item indices (int64 CPU) of each group; raises when ungrouped."""
        return self._need_grouped("partition").partition

    def __len__(self) -> int:
        if self._items is not None:
            return len(self._items)
        return sum(map(len, self._grouping.partition))

    @property
    def data_partition(self) -> list[list[int]] | None:
        """Item indices of each group (``None`` when ungrouped)."""
        return None if self._grouping is None else [g.tolist() for g in self.partition]

    @property
    def length_info(self) -> dict[str, list[list[int]]] | None:
        """``{label: [[length of each item of group g] for g]}`` (``None`` when ungrouped)."""
        if self._grouping is None:
            return None
        return {k: [v[g].tolist() for g in self.partition] for k, v in self._lengths.items()}

    @property
    def lengths(self) -> dict[str, Tensor]:
        """``{label: (n,) int64}``: every item's length, in the original item order."""
        return dict(self._lengths)

    def get_group_length_info(self, i: int) -> dict[str, list[int]]:
        idx = self._need_grouped("get_group_length_info()").partition[i]
        return {k: v[idx].tolist() for k, v in self._lengths.items()}

    def _need_grouped(self, what: str) -> Grouping:
        if self._grouping is None:
            raise RuntimeError(f"{what} needs a grouped DataCollection; call group(grouper) first")
        return self._grouping

    def _padders(self, padding: Any) -> Any:
        if padding is not None and self.preset_padding is not None:
            raise ValueError(
                "this DataCollection already has padding set at construction; do not pass "
                "padding again"
            )
        if padding is not None:
            return padding_tree(self.shapesig_data, padding)
        return self.preset_padding or padding_tree(self.shapesig_data, None)

    # ----------------------------------------------------------------- grouping
    def group(self, grouper: Grouper, padding: Any = None, forget_order: bool = False) -> None:
        """Partition the items with ``grouper`` and pad each group to its own longest item."""
        if self.is_grouped:
            raise RuntimeError("already grouped; call ungroup() first, or regroup(grouper)")
        padders = self._padders(padding)
        plan = self._plan(grouper)
        full = {}
        for path, sig in iter_leaves(self.shapesig_data):
            items = [tree_get(d.value, path) for d in self._items]
            full[path] = pad_stack(
                items, sig, lengths_for(self._lengths, sig, len(self)), tree_get(padders, path)
            )
        self._split(full, list(plan.groups), forget_order, padders)

    def _plan(self, grouper: Grouper) -> GroupPlan:
        plan = grouper.plan(self._lengths, len(self))
        plan.check_covers(len(self), f"{type(grouper).__name__}.plan()")
        return plan

    def _split(self, full: Leaves, partition: list[Tensor], forget: bool, padders: Any) -> None:
        """Cut full padded tensors (items in original order) into groups; become grouped."""
        trivial = Grouping([], partition).is_identity
        per_group: list[dict] = [{} for _ in partition]
        for path, sig in iter_leaves(self.shapesig_data):
            for g, idx in enumerate(partition):
                sizes = {
                    pos: int(self._lengths[label][idx].max()) if len(idx) else 0
                    for pos, label in sig.length_dims()
                }
                rows = None if trivial else idx
                per_group[g][path] = narrow_gather(full[path], sig.batch_index, sizes, rows)
        data = [TensorData(assemble(self.shapesig_data, parts)) for parts in per_group]
        if forget:
            order = torch.cat(partition)
            self._lengths = {k: v[order] for k, v in self._lengths.items()}
            partition = consecutive(list(map(len, partition)))
        self._items = None
        self._grouping = Grouping(data, partition, dirty=False, padding=padders)

    def _merge(self) -> Leaves:
        """Full padded tensors, items in original order, padded positions reset to padding."""
        grouping = self._grouping
        padders = grouping.padding or self._padders(None)
        inverse = None if grouping.is_identity else torch.argsort(torch.cat(grouping.partition))
        full = {}
        for path, sig in iter_leaves(self.shapesig_data):
            tensors = [tree_get(g.value, path) for g in grouping.data]
            padder = tree_get(padders, path)
            lens = sig.length_dims()
            target = {
                pos: max(int(self._lengths[label].max()), *(t.shape[pos] for t in tensors))
                for pos, label in lens
            }
            padded = [pad_to(t, sig, target, padder) for t in tensors]
            merged = merge_groups(padded, inverse, sig.batch_index)
            if lens and grouping.dirty:
                sizes = [merged.shape[p] for p, _ in lens]
                mask = place_mask(
                    length_mask(lengths_for(self._lengths, sig, len(self)), sizes),
                    sig,
                    merged.shape,
                )
                background = padder.background(merged.shape, sig, merged.dtype, merged.device)
                merged = torch.where(mask.to(merged.device), merged, background)
            full[path] = merged
        return full

    def ungroup(self) -> None:
        """Back to a list of items (unpadded, in the original order)."""
        grouping = self._need_grouped("ungroup()")
        items: list[dict] = [{} for _ in range(len(self))]
        for path, sig in iter_leaves(self.shapesig_data):
            b = sig.batch_index
            lens = sig.length_dims()
            for group, idx in zip(grouping.data, grouping.partition, strict=False):
                rows = tree_get(group.value, path).unbind(b)
                length_rows = lengths_for(self._lengths, sig, len(self), idx).tolist()
                for row, item, row_lengths in zip(rows, idx.tolist(), length_rows, strict=False):
                    for (pos, _), size in zip(lens, row_lengths, strict=False):
                        row = row.narrow(pos - (pos > b), 0, size)
                    items[item][path] = row
        self._items = [TensorData(assemble(self.shapesig_data, parts)) for parts in items]
        self._grouping = None

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
        plan = self._plan(grouper)
        self._split(full, list(plan.groups), forget_order, self._grouping.padding)

    # ----------------------------------------------------------------- masks
    def get_mask(
        self, i: int, key_conv: KeyConversion | None = None, mask_hint: Any = "copy"
    ) -> Any:
        """The mask of group ``i``: True at real (not padded) positions.

        ``mask_hint="copy"``: a bool tensor shaped like every tensor (nested like the data);
        a list of length labels: one ``(n_g, L_a, L_b, ...)`` tensor. A position is real when it
        is inside the item along every length dim.
        """
        grouping = self._need_grouped("get_mask()")
        idx, group = grouping.partition[i], grouping.data[i]
        if mask_hint == "copy":
            masks = copy_masks(self.shapesig_data, self._lengths, idx, group)
            return convert_keys(masks, key_conv)
        return label_mask(self._lengths, idx, group, mask_hint)

    # ----------------------------------------------------------------- modules
    def apply(
        self,
        module: nn.Module,
        mask_hint: Any = FROM_MODULE,
        input_key_conv: KeyConversion | None = None,
        output_key_conv: KeyConversion | None = None,
    ) -> DataCollection:
        """Run ``module`` once per group; returns the grouped outputs as a new collection.

        ``mask_hint`` defaults to ``module.get_mask_hint()``; pass ``None``, ``"copy"`` or a
        list of (module or data) length labels to override it. ``input_key_conv`` /
        ``output_key_conv`` rename dict keys (``{old: (new, sub_conversion)}``) on the way in
        and out. See :mod:`grabkit.group.application` for the output checks.
        """
        grouping = self._need_grouped("apply()")
        sigs, outputs, lengths = apply_module(
            self, module, mask_hint, input_key_conv, output_key_conv
        )
        result = Grouping(outputs, list(grouping.partition), dirty=True)
        return DataCollection._make(sigs, None, lengths, grouping=result)

    # ----------------------------------------------------------------- nesting
    def groups_as_data(
        self, bdim_idx: int, new_ldim_label: str, padding: Any = None
    ) -> DataCollection:
        """A new (ungrouped) collection whose items are this collection's groups.

        The batch dim of each group becomes length dim ``L_<new_ldim_label>`` and a new batch
        dim is inserted at ``bdim_idx``: a ragged list of ragged items, ready to group again.
        """
        grouping = self._need_grouped("groups_as_data()")
        signatures = nested_signatures(self.shapesig_data, self._lengths, bdim_idx, new_ldim_label)
        if padding is None and self.preset_padding is not None:
            padding = self.preset_padding
        return DataCollection(signatures, data_list=list(grouping.data), padding=padding)

    def masks_as_data(
        self, bdim_idx: int, new_ldim_label: str, padding: Any = None
    ) -> DataCollection:
        """Like :meth:`groups_as_data`, with each group's ``'copy'`` masks as the items."""
        grouping = self._need_grouped("masks_as_data()")
        signatures = nested_signatures(self.shapesig_data, self._lengths, bdim_idx, new_ldim_label)
        masks = [self.get_mask(i) for i in range(len(grouping.data))]
        return DataCollection(signatures, data_list=masks, padding=padding)

    # ----------------------------------------------------------------- copies
    def _derive(
        self,
        leaf: Callable[[TensorData], TensorData],
        padding: Callable[[Any], Any],
        signatures: Any = None,
        lengths: dict[str, Tensor] | None = None,
    ) -> DataCollection:
        """A new collection: ``leaf`` maps every item or group, ``padding`` each padder tree.

        The copy gets its own lists and dicts; tensors and signatures are shared, which is safe
        because no method mutates them in place.
        """
        preset = None if self.preset_padding is None else padding(self.preset_padding)
        signatures = self.shapesig_data if signatures is None else signatures
        lengths = dict(self._lengths) if lengths is None else lengths
        if self._grouping is None:
            items = [leaf(d) for d in self._items]
            return DataCollection._make(signatures, preset, lengths, items=items)
        g = self._grouping
        active = None if g.padding is None else padding(g.padding)
        grouping = Grouping([leaf(d) for d in g.data], list(g.partition), g.dirty, active)
        return DataCollection._make(signatures, preset, lengths, grouping=grouping)

    def _map_tensors(
        self, fn: Callable[[Tensor], Tensor], device: torch.device | str | None = None
    ) -> DataCollection:
        def move_padding(tree: Any) -> Any:
            return tree if device is None else map_tree(lambda p: p.to(device), tree)

        return self._derive(lambda d: TensorData(map_tree(fn, d.value)), move_padding)

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
        labels = length_labels(signatures)
        lengths = {k: v for k, v in self._lengths.items() if k in labels}
        return self._derive(lambda d: d[key], lambda tree: tree[key], signatures, lengths)

    def _same_grouping(self, other: DataCollection) -> bool:
        if self.is_grouped != other.is_grouped or len(self) != len(other):
            return False
        if not self.is_grouped:
            return True
        mine, theirs = self.partition, other.partition
        return len(mine) == len(theirs) and all(
            torch.equal(a, b) for a, b in zip(mine, theirs, strict=False)
        )

    def _check_compatible(self, sub: DataCollection) -> None:
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

    def __setitem__(self, key: str, sub: DataCollection) -> None:
        """Put ``sub``'s data under ``key``; new dicts throughout, so copies stay independent."""
        self._check_compatible(sub)
        theirs = sub.preset_padding or padding_tree(sub.shapesig_data, None)
        if self.preset_padding is not None or sub.preset_padding is not None:
            others = {k: v for k, v in self.shapesig_data.items() if k != key}
            mine = self.preset_padding or padding_tree(others, None)
            self.preset_padding = {**mine, key: theirs}
        self.shapesig_data = {**self.shapesig_data, key: sub.shapesig_data}
        self._lengths = {**self._lengths, **sub._lengths}
        if self._grouping is None:
            pairs = zip(self._items, sub._items, strict=False)
            self._items = [mine.with_key(key, other.value) for mine, other in pairs]
            return
        g, h = self._grouping, sub._grouping
        pairs = zip(g.data, h.data, strict=False)
        data = [mine.with_key(key, other.value) for mine, other in pairs]
        active = None if g.padding is None else {**g.padding, key: h.padding or theirs}
        self._grouping = replace(g, data=data, dirty=g.dirty or h.dirty, padding=active)

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
        if first.is_grouped:
            empty = Grouping([TensorData({}) for _ in first.partition], list(first.partition))
            combined = cls._make({}, None, {}, grouping=empty)
        else:
            combined = cls._make({}, None, {}, items=[TensorData({}) for _ in range(len(first))])
        for key, dc in collections.items():
            combined[key] = dc
        return combined

    def __repr__(self) -> str:
        state = f"{len(self.data_groups)} groups" if self.is_grouped else "ungrouped"
        return f"DataCollection({len(self)} items, {state}, labels={sorted(self._lengths)})"
