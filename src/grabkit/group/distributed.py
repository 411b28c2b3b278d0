"""Grouped runs of a data-parallel model: one reduction per batch, the same collectives per rank.

A grouped run calls the module once per group. A data-parallel wrapper expects one call:

* ``DistributedDataParallel`` sets up its gradient all-reduce in its forward. Calls on
  ``ddp.module`` skip it, so each rank keeps its own gradient and the replicas drift apart
  silently; calls on the wrapper are one DDP forward each (a buffer broadcast each), and ranks
  with different numbers of groups then issue different numbers of collectives.
* ``fully_shard`` (FSDP2) all-gathers the parameters in every forward (and again in backward
  when it resharded after forward): ranks with different numbers of groups deadlock.

So ``GroupedBatch.run`` / ``run_grouped`` / ``backward_by_group`` given such a model (the DDP
wrapper, or its ``.module``, whose wrapper is found) run it this way:

* DDP: every group runs inside **one** DDP forward, DDP's own set-up before the first group and
  after the last, on the merged output (one buffer broadcast, one reduction over the graph of
  every group), exactly as DDP runs one call. ``backward_by_group`` runs every group but the last
  on the inner module (its backward accumulates locally, as under ``no_sync()``) and the last one
  inside a DDP forward, whose backward all-reduces the accumulated gradient: one reduction per
  batch, whatever the number of groups on each rank.
* ``fully_shard``: the ranks agree on the largest number of groups any of them has (one
  all-reduce of one number per batch) and each rank makes up the difference with calls on an
  empty batch (with ``backward_by_group``, an empty forward and backward each), so that FSDP's
  collectives pair up. Their outputs are empty and add exactly zero; the module must accept an
  empty batch, as it must for an empty grouped batch.
* ``FullyShardedDataParallel`` (FSDP1) is refused.

With one process (or no process group) nothing of this runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from grabkit.sharding import refuse_flat_parameters, world_size

from .coupling import warn_if_batch_coupled
from .plumbing import length_mask

if TYPE_CHECKING:
    from .grouped import GroupedBatch

__all__ = ["data_parallel"]

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without fully_shard
    FSDPModule = None  # type: ignore[assignment,misc]

# set while a data-parallel run calls the plain grouped code on the model itself
_INSIDE = contextvars.ContextVar("grabkit_group_data_parallel", default=False)
# module -> the DDP wrapper around it (None: none), found once per module
_OWNERS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def data_parallel(module: object) -> _DDPGroups | _ShardedGroups | None:
    """How to run groups through ``module``: None for a plain module or a single process."""
    if _INSIDE.get() or not isinstance(module, nn.Module) or world_size() == 1:
        return None
    refuse_flat_parameters(module.parameters(), "a grouped run")
    if isinstance(module, DistributedDataParallel):
        return _DDPGroups(module)
    if FSDPModule is not None and any(isinstance(m, FSDPModule) for m in module.modules()):
        return _ShardedGroups(module)
    owner = _owning_ddp(module)
    return None if owner is None else _DDPGroups(owner)


def _owning_ddp(module: nn.Module) -> DistributedDataParallel | None:
    """The live ``DistributedDataParallel`` whose ``.module`` is ``module`` (one heap scan per
    module, remembered)."""
    if module not in _OWNERS:
        owner = next(
            (
                o
                for o in gc.get_objects()
                if isinstance(o, DistributedDataParallel) and o.module is module
            ),
            None,
        )
        _OWNERS[module] = None if owner is None else weakref.ref(owner)
    ref = _OWNERS[module]
    return None if ref is None else ref()


@contextlib.contextmanager
def _plain():
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


class _DDPGroups:
    """Groups inside one DDP forward (DDP's pre- and post-forward around them)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def _forward(self, body: Callable[..., Tensor], *inputs: Any, **kwargs: Any) -> Tensor:
        """``body(*inputs, **kwargs)`` as the body of one DDP forward (inputs moved by DDP)."""
        ddp = self.ddp
        inputs, kwargs = ddp._pre_forward(*inputs, **kwargs)
        inside = getattr(ddp, "_inside_ddp_forward", contextlib.nullcontext)
        with inside(), _plain():
            output = body(*inputs, **kwargs)
        return ddp._post_forward(output)

    def run(self, batch: GroupedBatch, pass_mask: bool, *args: Any, **kwargs: Any) -> Tensor:
        def groups(padded: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            moved = batch if padded is batch.padded else replace(batch, padded=padded)
            return moved.run(self.ddp.module, pass_mask, *args, **kwargs)

        return self._forward(groups, batch.padded, *args, **kwargs)

    def backward_by_group(
        self, batch: GroupedBatch, loss_fn: Callable, pass_mask: bool, reduction: str
    ) -> Tensor:
        from .grouped import backward_by_group

        calls = max(len(batch.plan), 1)
        made = 0

        def module(*inputs: Any, **kwargs: Any) -> Tensor:
            nonlocal made
            made += 1
            if made < calls:  # accumulates locally: no DDP forward, so no reduction
                return self.ddp.module(*inputs, **kwargs)
            return self._forward(self.ddp.module, *inputs, **kwargs)

        if len(batch) == 0 and reduction == "sum":  # still take part in the reduction
            _call_empty(module, batch, pass_mask).sum().backward()
            return torch.zeros(())
        warn_if_batch_coupled(self.ddp.module, len(batch.plan))
        with _plain():
            return backward_by_group(module, batch, loss_fn, pass_mask, reduction)


def _call_empty(module: Callable, batch: GroupedBatch, pass_mask: bool) -> Tensor:
    """``module`` on no items: a (0, ...) slice of the padded batch (and its (0, *L) mask)."""
    empty = batch.padded[:0]
    if not pass_mask:
        return module(empty)
    sizes = [batch.padded.shape[d] for d in batch.length_dims]
    return module(empty, length_mask(batch.lengths[:0], sizes, batch.padded.device))


def _most_calls(calls: int) -> int:
    """The largest ``calls`` over the ranks (one all-reduce of one number)."""
    agreed = torch.tensor([calls], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed)


class _ShardedGroups:
    """``fully_shard``: as many calls on every rank, the extra ones on an empty batch."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def run(self, batch: GroupedBatch, pass_mask: bool, *args: Any, **kwargs: Any) -> Tensor:
        calls = max(len(batch.plan), 1)
        extra = _most_calls(calls) - calls
        with _plain():
            output = batch.run(self.module, pass_mask, *args, **kwargs)
            for _ in range(extra):
                filler = _call_empty(lambda *a: self.module(*a, *args, **kwargs), batch, pass_mask)
                output = output + filler.sum()  # an exact zero that keeps the call in the graph
        return output

    def backward_by_group(
        self, batch: GroupedBatch, loss_fn: Callable, pass_mask: bool, reduction: str
    ) -> Tensor:
        from .grouped import backward_by_group

        calls = len(batch.plan) if len(batch) else 0
        extra = _most_calls(calls) - calls
        with _plain():
            loss = backward_by_group(self.module, batch, loss_fn, pass_mask, reduction)
            for _ in range(extra):
                _call_empty(self.module, batch, pass_mask).sum().backward()
        return loss
