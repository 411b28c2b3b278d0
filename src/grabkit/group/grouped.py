"""Run any ``nn.Module`` group by group on a padded batch, no annotations needed.

``run_grouped(module, padded, lengths)`` plans groups on the CPU, runs ``module`` once per group
on a gather of the rows narrowed to the group's longest item, and merges the outputs back into
the original order. Output dims whose size differs between groups are zero-padded on merge; with
``return_lengths=True`` every item's output lengths are inferred by shape propagation on the
``meta`` device (so derived lengths such as ``(L - k) // s + 1`` need no declaration).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grabkit.stats.rows import grouped_run

from .coupling import warn_if_batch_coupled
from .distributed import data_parallel
from .planning import GroupPlan, as_length_matrix, plan_groups
from .plumbing import length_mask, merge_groups, narrow_gather, normalise_dims

__all__ = [
    "GroupedBatch",
    "backward_by_group",
    "group_batch",
    "infer_output_lengths",
    "run_grouped",
]

_probe_cache: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _check_length_dims(length_dims: Sequence[int], rank: int) -> tuple[int, ...]:
    """Length dims as non-negative positions of a rank-``rank`` tensor; never dim 0, no repeats."""
    dims = normalise_dims(length_dims, rank, "the padded tensor")
    if 0 in dims:
        raise ValueError("the batch dim (0) cannot also be a length dim; fix length_dims")
    return dims


def _check_plan(plan: GroupPlan, matrix: Tensor) -> None:
    """``plan`` must hold every item once and pad each group at least to its longest item."""
    plan.check_covers(len(matrix))
    for g, idx in enumerate(plan.groups):
        sizes = torch.as_tensor(plan.lengths[g], dtype=torch.long).reshape(-1)
        if len(sizes) != matrix.shape[1]:
            raise ValueError(
                f"the plan gives group {g} {len(sizes)} padded lengths for "
                f"{matrix.shape[1]} length dims; build the plan from these lengths"
            )
        short = (matrix[idx] > sizes).nonzero()
        if len(short):
            row, k = short[0].tolist()
            raise ValueError(
                f"the plan pads group {g} to {int(sizes[k])} along length dim {k}, but item "
                f"{int(idx[row])} has length {int(matrix[idx[row], k])}; build the plan from "
                "these lengths"
            )


def _call(module: Callable, x: Tensor, mask: Tensor | None, args: tuple, kwargs: dict) -> Tensor:
    out = module(x, mask, *args, **kwargs) if mask is not None else module(x, *args, **kwargs)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"run_grouped merges one output tensor per group, but the module returned "
            f"{type(out).__name__}; wrap it to return a single tensor"
        )
    return out


@dataclass
class GroupedBatch:
    """A padded batch (batch dim 0) and the plan that splits it into groups.

    ``padded``: rows in ``plan.order`` when ``rows_sorted`` (each group is then a slice, a
    view; what :class:`GroupingCollate` builds), else in the original item order (each group is
    one gather of the rows, narrowed first so only the group's columns move); ``lengths``:
    ``(n, k)`` int64 CPU in the same row order; ``plan``: groups of original item indices;
    ``length_dims``: the padded tensor's length dims; ``extras``: whatever else the collate
    function produced, in the original item order (targets, ids).
    """

    padded: Tensor
    lengths: Tensor
    plan: GroupPlan
    length_dims: tuple[int, ...] = (1,)
    extras: Any = None
    pad_value: float = 0.0
    rows_sorted: bool = True

    def __len__(self) -> int:
        return self.plan.size

    def group_inputs(self) -> list[Tensor]:
        """One view per group: a row slice narrowed (or padded) to the group's shape."""
        out = []
        for g, (start, stop) in enumerate(self.plan.slices):
            sizes = dict(zip(self.length_dims, self.plan.lengths[g], strict=True))
            if self.rows_sorted:
                part = narrow_gather(self.padded, 0, sizes, None)[start:stop]
            else:
                part = narrow_gather(self.padded, 0, sizes, self.plan.groups[g])
            grow = {d: size - part.shape[d] for d, size in sizes.items() if size > part.shape[d]}
            grow[0] = self.plan.rows[g] - (stop - start)
            if any(grow.values()):
                spec: list[int] = []
                for d in range(part.dim() - 1, -1, -1):
                    spec += [0, grow.get(d, 0)]
                part = F.pad(part, spec, value=self.pad_value)
            out.append(part)
        return out

    def group_masks(self) -> list[Tensor]:
        """``(rows_g, *L_g)`` bool masks, True at real positions (AND over length dims)."""
        out = []
        for g, (start, stop) in enumerate(self.plan.slices):
            sizes, rows = self.plan.lengths[g], self.plan.rows[g]
            lengths = (
                self.lengths[start:stop] if self.rows_sorted else self.lengths[self.plan.groups[g]]
            )
            if rows > stop - start:
                lengths = F.pad(lengths, (0, 0, 0, rows - (stop - start)))
            out.append(length_mask(lengths, sizes, self.padded.device))
        return out

    def merge(self, outputs: Sequence[Tensor]) -> Tensor:
        """Group outputs (batch dim 0) -> one batch in the original item order.

        ``outputs[g]`` holds one row per row of group ``g``'s input (``plan.rows[g]``, padding
        rows of bucketed sizes included, or just its items); anything else raises, since its
        rows could not be told apart (a transposed or batch-reduced output).
        """
        if len(outputs) != len(self.plan):
            raise ValueError(
                f"merge got {len(outputs)} outputs for a plan of {len(self.plan)} groups; pass "
                "one output per group, in the order of group_inputs()"
            )
        trimmed = [
            check_group_rows(o, g, stop - start, self.plan.rows[g])[: stop - start]
            for g, (o, (start, stop)) in enumerate(zip(outputs, self.plan.slices, strict=True))
        ]
        shapes = {tuple(o.shape[1:]) for o in trimmed}
        ragged = []
        if len(shapes) > 1:
            ranks = {len(s) for s in shapes}
            if len(ranks) != 1:
                raise ValueError(f"group outputs have different ranks: {sorted(shapes)}")
            ragged = [
                d + 1 for d, sizes in enumerate(zip(*shapes, strict=False)) if len(set(sizes)) > 1
            ]
        return merge_groups(trimmed, self.plan.inverse_order, 0, ragged)

    def run(
        self, module: Callable[..., Tensor], pass_mask: bool = False, *args: Any, **kwargs: Any
    ) -> Tensor:
        """``module`` on every group, outputs merged into the original order.

        Each call is announced to ``grabkit.stats`` (the items its rows hold), so per-example
        statistics and hook-mode GraB of a model called inside describe the batch's items in
        its order. An empty batch has no groups: ``module`` then runs once on the empty padded
        batch (with a ``(0, *L)`` mask), which is exactly the ungrouped result.
        """
        parallel = data_parallel(module)  # DDP / fully_shard: see group/distributed.py
        if parallel is not None:
            return parallel.run(self, pass_mask, *args, **kwargs)
        if len(self) == 0:
            sizes = [self.padded.shape[d] for d in self.length_dims]
            mask = length_mask(self.lengths, sizes, self.padded.device) if pass_mask else None
            return _call(module, self.padded, mask, args, kwargs)
        if isinstance(module, nn.Module):
            warn_if_batch_coupled(module, len(self.plan))
        masks = self.group_masks() if pass_mask else [None] * len(self.plan)
        outputs = []
        with grouped_run(len(self)) as run:
            for g, (x, m) in enumerate(zip(self.group_inputs(), masks, strict=False)):
                with run.group(self.plan.groups[g], self.plan.rows[g], (x, m)):
                    outputs.append(_call(module, x, m, args, kwargs))
        return self.merge(outputs)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> GroupedBatch:
        """A copy with ``fn`` applied to the padded tensor and tensor extras (not the plan)."""
        return replace(self, padded=fn(self.padded), extras=_map_tensors(self.extras, fn))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> GroupedBatch:
        """The padded tensor (and tensor extras) on ``device``; plan and lengths stay on the CPU."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> GroupedBatch:
        """Page-locked copy, so ``DataLoader(pin_memory=True)`` and non-blocking copies work."""
        return self._map(lambda t: t.pin_memory())

    def padding_efficiency(self) -> float:
        """Real elements over computed elements (1.0 means no padding)."""
        return float(self.lengths.prod(1).sum()) / max(1, self.plan.padded_elements())


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def group_batch(
    padded: Tensor,
    lengths: Tensor | Sequence[int],
    plan: GroupPlan | None = None,
    length_dims: Sequence[int] = (1,),
    pad_value: float = 0.0,
    **planning: Any,
) -> GroupedBatch:
    """Plan groups (unless ``plan`` is given) for a padded batch (batch dim 0) in item order.

    Item i occupies the first ``lengths[i]`` positions of each length dim (right padding);
    each group is narrowed to its longest item, so a left-padded batch would lose real values.

    Nothing moves yet: each group is later one gather of its rows from the narrowed batch.
    ``planning`` keywords go to :func:`plan_groups` (``cost``, ``alpha``, ``overhead``,
    ``max_group_cost``, ``length_buckets``, ``size_buckets``).
    """
    length_dims = _check_length_dims(length_dims, padded.dim())
    matrix = as_length_matrix(lengths, k=len(length_dims))
    if len(matrix) != padded.shape[0]:
        raise ValueError(f"lengths has {len(matrix)} rows for a batch of {padded.shape[0]}")
    for k, d in enumerate(length_dims):
        if len(matrix) and int(matrix[:, k].max()) > padded.shape[d]:
            raise ValueError(
                f"a length {int(matrix[:, k].max())} exceeds the padded size {padded.shape[d]} "
                f"of dim {d}"
            )
    if plan is None:
        plan = plan_groups(matrix, **planning)
    elif planning:
        raise ValueError("give either a plan or planning options, not both")
    else:
        _check_plan(plan, matrix)
    return GroupedBatch(padded, matrix, plan, length_dims, None, pad_value, rows_sorted=False)


def run_grouped(
    module: Callable[..., Tensor],
    padded: Tensor,
    lengths: Tensor | Sequence[int],
    *args: Any,
    plan: GroupPlan | None = None,
    length_dims: Sequence[int] = (1,),
    pass_mask: bool = False,
    return_lengths: bool = False,
    pad_value: float = 0.0,
    planning: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, dict[int, Tensor]]:
    """``module(padded)`` computed group by group, with the same result at every real position.

    Args:
        module: any callable taking a ``(n_g, ...)`` tensor (and a ``(n_g, *L)`` bool mask
            when ``pass_mask``) and returning one tensor with batch dim 0.
        padded: ``(n, ...)`` padded batch, each item at the start of its row along every
            length dim (right padding); ``lengths``: ``(n,)`` or ``(n, k)`` per
            ``length_dims``. A left-padded batch is cut at the wrong end (its values beyond the
            lengths cannot be told from padding): pad on the right.
        plan: a :class:`GroupPlan`; default: :func:`plan_groups` with ``planning`` options.
        return_lengths: also return ``{output_dim: (n,) lengths}`` for output dims that
            depend on the input length, inferred per distinct input length.
        *args: passed to every call of ``module`` unchanged.
        **kwargs: passed to every call of ``module`` unchanged.

    Positions beyond an item's (output) length are unspecified, as in the padded run.
    """
    batch = group_batch(padded, lengths, plan, length_dims, pad_value, **dict(planning or {}))
    output = batch.run(module, pass_mask, *args, **kwargs)
    if not return_lengths:
        return output
    matrix = as_length_matrix(lengths, k=len(batch.length_dims))
    example = padded[:1]
    return output, infer_output_lengths(
        module, example, matrix, batch.length_dims, output.shape, pass_mask, args, kwargs
    )


def _meta_call(module: Any, x: Tensor, mask: Tensor | None, args: tuple, kwargs: dict) -> Tensor:
    if isinstance(module, nn.Module):
        state = {
            name: torch.empty_like(t, device="meta")
            for name, t in (*module.named_parameters(), *module.named_buffers())
        }
        call_args = (x, mask, *args) if mask is not None else (x, *args)
        return torch.func.functional_call(module, state, call_args, kwargs)
    return _call(module, x, mask, args, kwargs)


def _probe_shape(
    module: Any,
    example: Tensor,
    sizes: tuple[int, ...],
    length_dims: tuple[int, ...],
    pass_mask: bool,
    args: tuple,
    kwargs: dict,
) -> tuple[int, ...]:
    """Output shape for one item whose length dims have ``sizes``."""
    shape = list(example.shape)
    for d, s in zip(length_dims, sizes, strict=False):
        shape[d] = s
    try:
        x = torch.zeros(shape, dtype=example.dtype, device="meta")
        mask = torch.ones((1, *sizes), dtype=torch.bool, device="meta") if pass_mask else None
        return tuple(_meta_call(module, x, mask, args, kwargs).shape)
    except Exception:  # an op without a meta kernel: run one real item instead
        x = torch.zeros(shape, dtype=example.dtype, device=example.device)
        mask = (
            torch.ones((1, *sizes), dtype=torch.bool, device=example.device) if pass_mask else None
        )
        with torch.no_grad():
            return tuple(_call(module, x, mask, args, kwargs).shape)


def infer_output_lengths(
    module: Any,
    example: Tensor,
    lengths: Tensor,
    length_dims: Sequence[int],
    output_shape: Sequence[int],
    pass_mask: bool = False,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
) -> dict[int, Tensor]:
    """Per-item output lengths for the output dims that vary with the input length.

    Each distinct input length tuple is propagated once through ``module`` on the ``meta``
    device (falling back to one real item for ops without meta kernels); results are cached
    per module. Returns ``{output_dim: (n,) int64}`` for every dim where some item's size is
    below ``output_shape``.
    """
    length_dims = tuple(length_dims)
    lengths = as_length_matrix(lengths, k=len(length_dims))
    if len(lengths) == 0:
        return {}  # no item: no dim has a size below the batch output's
    kwargs = dict(kwargs or {})
    cache = _probe_cache.setdefault(module, {}) if isinstance(module, nn.Module) else {}
    fixed = tuple(-1 if d in length_dims else size for d, size in enumerate(example.shape))
    signature = (fixed, example.dtype, length_dims, pass_mask)
    distinct, index = torch.unique(lengths, dim=0, return_inverse=True)
    shapes = []
    for sizes in map(tuple, distinct.tolist()):
        key = (signature, sizes)
        if key not in cache:
            cache[key] = _probe_shape(module, example, sizes, length_dims, pass_mask, args, kwargs)
        shapes.append(cache[key])
    table = torch.tensor(shapes, dtype=torch.long)[index]
    if table.shape[1] != len(output_shape):
        raise ValueError(
            f"a single item gives an output of rank {table.shape[1]} but the batch output has "
            f"rank {len(output_shape)}"
        )
    return {
        d: table[:, d]
        for d in range(1, len(output_shape))
        if bool((table[:, d] != output_shape[d]).any())
    }


def backward_by_group(
    module: Callable[..., Tensor],
    batch: GroupedBatch,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    pass_mask: bool = False,
    reduction: str = "mean",
) -> Tensor:
    """Forward and backward one group at a time; peak activations are the largest group's.

    ``loss_fn(output_g, items_g)`` returns the per-item losses ``(n_g,)`` of group ``g``, where
    ``items_g`` are the original item indices (to pick targets). The accumulated gradient is
    that of the whole batch's ``mean`` (or ``sum``) loss, which is returned detached.

    The groups are announced to ``grabkit.stats`` as in ``GroupedBatch.run``: the statistics
    read after the call (and a hook-mode GraB ``step()``) describe the whole batch's items in
    its order, not the last group's.

    An empty batch with ``reduction="sum"`` returns a zero loss and touches no gradient; with
    ``"mean"`` it raises ``ValueError``, since a mean over no items is undefined (NaN).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction should be 'mean' or 'sum', but got {reduction!r}")
    parallel = data_parallel(module)  # DDP / fully_shard: see group/distributed.py
    if parallel is not None:
        return parallel.backward_by_group(batch, loss_fn, pass_mask, reduction)
    if len(batch) == 0:
        if reduction == "mean":
            raise ValueError(
                "backward_by_group got an empty batch: the mean loss over 0 items is undefined; "
                "skip the batch, or pass reduction='sum' (a zero loss and no gradient)"
            )
        return torch.zeros(())
    if isinstance(module, nn.Module):
        warn_if_batch_coupled(module, len(batch.plan))
    scale = 1.0 / len(batch) if reduction == "mean" else 1.0
    masks = batch.group_masks() if pass_mask else [None] * len(batch.plan)
    total: Tensor | None = None
    groups = zip(batch.group_inputs(), masks, batch.plan.groups, batch.plan.rows, strict=True)
    with grouped_run(len(batch), reduction) as run:
        for g, (x, mask, items, rows) in enumerate(groups):
            with run.group(items, rows, (x, mask)):
                out = _call(module, x, mask, (), {})
                out = check_group_rows(out, g, len(items), rows)[: len(items)]  # padding rows
                with run.group(items):  # what loss_fn computes holds the items' rows only
                    loss = _group_loss(out, items, loss_fn) * scale
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()  # no host sync
    return total if total is not None else torch.zeros(())


def check_group_rows(out: Tensor, group: int, items: int, rows: int) -> Tensor:
    """``out``, a group's output, after checking that it has a row per input row (``rows``,
    bucketed padding rows included) or per item (``items``)."""
    if out.dim() == 0 or out.shape[0] not in (items, rows):
        shape = tuple(out.shape)
        raise ValueError(
            f"group {group} ran on {rows} rows ({items} items) but its output has shape "
            f"{shape}: grouping needs one output row per input row, batch dim first (a module "
            "that reduces over the batch or moves the batch dim cannot be grouped)"
        )
    return out


def _group_loss(out: Tensor, items: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The summed per-item losses of one group's output ``out`` (its items' rows)."""
    losses = loss_fn(out, items)
    if losses.shape != (len(items),):
        raise ValueError(
            f"loss_fn should return per-item losses of shape ({len(items)},), but returned "
            f"{tuple(losses.shape)}"
        )
    return losses.sum()
