"""How a parameter's gradient is laid out across ranks: whole on every rank, or one shard each.

* **replicated**: plain tensors. One process, or ``DistributedDataParallel``: every rank holds
  the whole gradient (equal on all ranks once DDP has averaged it).
* **sharded**: ``torch.distributed.fsdp.fully_shard`` (FSDP2). Parameters and their gradients
  are ``DTensor``\\ s; a rank holds one disjoint shard, so a squared norm is the SUM over ranks
  of the local shards' squared norms, and arithmetic on a gradient is arithmetic on its local
  shard (``local``).

``FullyShardedDataParallel`` (FSDP1) flattens a module's parameters into ``FlatParameter``\\ s
whose gradients are padded slices of a concatenation of many parameters; grabkit's per-parameter
blocks, hooks and statistics do not map onto them, so :func:`refuse_flat_parameters` raises at
construction and names FSDP2 as the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "GradientLayout",
    "dtensor_like",
    "gradient_layout_of",
    "is_sharded",
    "local",
    "refuse_flat_parameters",
    "world_size",
]

GradientLayout = Literal["replicated", "sharded"]

try:  # torch >= 2.4; older releases kept DTensor private
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the installed torch
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None  # type: ignore[assignment,misc]


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a ``DTensor`` (an FSDP2 parameter or gradient): this rank holds a shard."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``tensor``: its local shard for a ``DTensor`` (sharing storage, so
    in-place arithmetic on it changes the ``DTensor``), the tensor itself otherwise."""
    return tensor._local_tensor if is_sharded(tensor) else tensor


def dtensor_like(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``shard`` (this rank's local part) as a tensor laid out like ``like``: a ``DTensor`` with
    ``like``'s mesh and placements when ``like`` is one, ``shard`` itself otherwise."""
    if not is_sharded(like):
        return shard
    return DTensor.from_local(
        shard,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _is_flat_parameter(tensor: torch.Tensor) -> bool:
    # FSDP1 marks its FlatParameters and, with use_orig_params=True, the original parameters
    # that became views into them
    return bool(getattr(tensor, "_fsdp_flattened", False))


def refuse_flat_parameters(params: Iterable[torch.Tensor], where: str) -> None:
    """Raise ``NotImplementedError`` if any of ``params`` belongs to an FSDP1 wrapper."""
    if any(_is_flat_parameter(p) for p in params):
        raise NotImplementedError(
            f"{where} got parameters of a FullyShardedDataParallel (FSDP1) model, which "
            "flattens parameters into padded FlatParameter shards that grabkit cannot split "
            "back into parameters; shard the model with torch.distributed.fsdp.fully_shard "
            "(FSDP2), which grabkit supports, or use DistributedDataParallel"
        )


def gradient_layout_of(params: Iterable[torch.Tensor], where: str) -> GradientLayout:
    """``"sharded"`` when every parameter is a ``DTensor``, ``"replicated"`` when none is.

    A mix (some parameters left out of ``fully_shard``) has no single rule to combine norms
    across ranks, so it raises; FSDP1 parameters raise too (see :func:`refuse_flat_parameters`).
    """
    params = list(params)
    refuse_flat_parameters(params, where)
    sharded = [is_sharded(p) for p in params]
    if all(sharded) and sharded:
        return "sharded"
    if not any(sharded):
        return "replicated"
    raise ValueError(
        f"{where} got {sum(sharded)} sharded (DTensor) and {len(sharded) - sum(sharded)} plain "
        "parameters: shard every trainable parameter with fully_shard, or pass only one kind"
    )


def world_size(process_group: object = None) -> int:
    """Ranks in ``process_group`` (the world by default); 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)
