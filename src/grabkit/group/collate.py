"""A ``collate_fn`` that plans groups on the CPU (in DataLoader workers) and pads once.

The minibatch is exactly the sampler's (any sampler, ``DistributedSampler`` included): only the
computation is split, so SGD semantics are unchanged. Items are padded directly in group order,
so on the device each group is a slice of one tensor and the merge is one gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from .annotation import BATCH, LENGTH, MODEL, Dim, Signature
from .grouped import GroupedBatch
from .planning import GroupPlan, plan_groups
from .plumbing import ConstantPadder, normalise_dims, pad_stack

__all__ = ["GroupingCollate"]


class GroupingCollate:
    """``collate_fn`` returning a :class:`GroupedBatch` (plus the other fields, collated).

    Args:
        length_dims: dims of each sequence tensor that vary between items (default: the first).
        key: where the sequence sits in a sample: ``None`` when the sample is the tensor itself,
            an int for a tuple/list sample, a str for a dict sample. Other fields are collated
            with ``default_collate`` in the original order and stored in ``extras`` (a single
            remaining field of a tuple sample is stored bare, e.g. the targets tensor).
        pad_value: value of padded positions.
        planning: keywords for :func:`plan_groups` (``cost``, ``alpha``, ``overhead``,
            ``max_group_cost``, ``length_buckets``, ``size_buckets``).
    """

    def __init__(
        self,
        length_dims: Sequence[int] = (0,),
        key: int | str | None = 0,
        pad_value: float = 0.0,
        **planning: Any,
    ) -> None:
        if not length_dims:
            raise ValueError("length_dims should name at least one dim of the sequence tensor")
        self.length_dims = tuple(length_dims)
        self.key = key
        self.pad_value = pad_value
        self.planning = planning
        plan_groups([1], **planning)  # validate options early

    def _split_sample(self, sample: Any) -> tuple[Tensor, Any]:
        if self.key is None:
            return sample, None
        if isinstance(sample, Mapping):
            rest = {k: v for k, v in sample.items() if k != self.key}
            return sample[self.key], rest
        if isinstance(sample, (tuple, list)):
            rest = [v for i, v in enumerate(sample) if i != self.key]
            return sample[self.key], rest
        raise TypeError(
            f"with key={self.key!r} each sample should be a tuple, list or dict, but got "
            f"{type(sample).__name__}; use key=None for bare tensors"
        )

    def _lengths(self, tensors: Sequence[Tensor]) -> tuple[tuple[int, ...], Tensor]:
        """The length dims (non-negative) and the ``(n, k)`` int64 lengths of the items."""
        rank = tensors[0].dim()
        if rank == 0:
            raise ValueError(f"length_dims {self.length_dims} do not fit items of rank 0")
        dims = normalise_dims(self.length_dims, rank, "each item")
        fixed = [d for d in range(rank) if d not in dims]
        first = [tensors[0].shape[d] for d in fixed]
        for i, t in enumerate(tensors):
            if t.dim() != rank or [t.shape[d] for d in fixed] != first:
                raise ValueError(
                    f"item {i} of the batch has shape {tuple(t.shape)} but item 0 has "
                    f"{tuple(tensors[0].shape)}: items may differ only along length_dims "
                    f"{dims}; pass length_dims= naming every dim that varies"
                )
        lengths = torch.tensor([[t.shape[d] for d in dims] for t in tensors], dtype=torch.long)
        return dims, lengths

    def _extras(self, rests: list[Any]) -> Any:
        """The other fields, collated in the original order (one tuple field stored bare)."""
        if self.key is None:
            return None
        if isinstance(rests[0], list) and len(rests[0]) == 1:
            rests = [rest[0] for rest in rests]
        return default_collate(rests)

    def __call__(self, samples: Sequence[Any]) -> GroupedBatch:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        split = [self._split_sample(s) for s in samples]
        tensors = [torch.as_tensor(t) for t, _ in split]
        _check_pad_value(self.pad_value, tensors[0].dtype)
        dims, lengths = self._lengths(tensors)
        plan: GroupPlan = plan_groups(lengths, **self.planning)
        signature = Signature(
            (
                Dim(BATCH),
                *(
                    Dim(LENGTH, f"l{d}") if d in dims else Dim(MODEL, f"m{d}")
                    for d in range(tensors[0].dim())
                ),
            )
        )
        ordered = lengths[plan.order]  # (n, k), rows in group order
        padded = pad_stack(
            [tensors[i] for i in plan.order.tolist()],
            signature,
            ordered,
            ConstantPadder(self.pad_value),
        )
        extras = self._extras([rest for _, rest in split])
        return GroupedBatch(
            padded, ordered, plan, tuple(d + 1 for d in dims), extras, self.pad_value
        )


def _check_pad_value(pad_value: float, dtype: torch.dtype) -> None:
    """Raise unless ``pad_value`` is stored exactly in ``dtype`` (an integer tensor would
    silently truncate 0.5 to 0, or fail deep inside padding on NaN)."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    value = float(pad_value)
    if not (value == value and abs(value) != float("inf") and value == int(value)):
        raise ValueError(
            f"pad_value={pad_value!r} cannot be stored in the items' dtype {dtype}; pass an "
            "integer pad_value (a padding token id) for integer items"
        )
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is not None and not info.min <= int(value) <= info.max:
        raise ValueError(f"pad_value={pad_value!r} lies outside the range of {dtype}")
