"""The collective pieces of distributed GraB: one agreement check, and the per-step gather.

Every rank holds the same sampler configuration and steps its own rows; ``gather_rows`` puts all
ranks' rows of a step into global visit order (rank r's row i is global position
(position_i) * W + r), after checking on every rank that the batch sizes, positions and gradient
widths agree (a width mismatch would otherwise abort inside ``all_gather``).
``check_agreement`` runs once, before anything is yielded, so ranks built with another seed or
ordering fail loudly instead of overlapping or blocking in a later collective.

How a ``GraBSampler`` runs on several ranks. It follows ``DistributedSampler``: the epoch's global
order is padded with examples drawn afresh each epoch from (seed, epoch) (or, with
``drop_last=True``, truncated) to a multiple of ``num_replicas``; rank r yields positions r, r + W,
... Every rank steps its own batch and the ranks all-gather the gradients, so all of them decide as
one process would on the global batch in global visit order. Padding duplicates are not balanced. In
hook mode the ranks exchange sketches (``statistics="sketch"``: (B, k) per rank, whatever the
model's size); exact hook statistics cannot be gathered, so that combination raises at construction.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch
import torch.distributed as dist

from grabkit.order.orderings.base import random_permutation
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch

__all__ = [
    "check_agreement",
    "fingerprint",
    "gather_rows",
    "global_rows",
    "padded_order",
    "process_group_matches",
]

#: epoch_generator purpose of the padding (distinct from the orderings' purposes)
_PURPOSE_PADDING = 5


def padded_order(order: torch.Tensor, total_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The global order padded to ``total_size`` with examples drawn afresh each epoch (from
    (seed, epoch), so every rank pads alike), as ``DistributedSampler``'s padding varies with
    its shuffle; or truncated (``drop_last``)."""
    extra = total_size - order.numel()
    if extra > 0:
        picks = random_permutation(order.numel(), seed, epoch, _PURPOSE_PADDING)
        repeats = math.ceil(extra / order.numel())
        order = torch.cat([order, order[picks.repeat(repeats)[:extra]]])
    return order[:total_size]


def process_group_matches(num_replicas: int) -> bool:
    """Whether an initialised process group of exactly ``num_replicas`` ranks is there."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == num_replicas


def fingerprint(config: dict[str, Any]) -> int:
    """A 62-bit hash of a plain configuration (the same on every rank and platform)."""
    text = json.dumps(config, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_agreement(config: dict[str, Any], num_replicas: int) -> None:
    """Raise on every rank unless all ranks hold the same configuration (one all_gather)."""
    mine = torch.tensor([fingerprint(config), int(config["seed"])], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(num_replicas)]
    dist.all_gather(everyone, mine)  # gloo and CPU tensors: the sampler's state lives on the CPU
    if len({int(t[0]) for t in everyone}) > 1:
        seeds = [int(t[1]) for t in everyone]
        raise ValueError(
            "the ranks built GraBSampler with different configurations (seed, balance_type, "
            f"options or dataset size; seeds by rank: {seeds}), so their orders would overlap "
            "and miss examples. Build the sampler with the same arguments on every rank."
        )


def gather_rows(
    batch: GradientBatch, positions: torch.Tensor, stepped: int, num_replicas: int
) -> tuple[DenseGradientBatch, torch.Tensor]:
    """All-gather the ranks' rows into the global batch, rows in global visit order.

    Args:
        batch: this rank's B rows: dense gradients, projected ones, or hook sketches
            (``statistics="sketch"``); exact hook statistics cannot be gathered.
        positions: (B,) this rank's local positions of those rows.
        stepped: the local position of the first row (must agree across ranks).
    Returns:
        the (W * B, d) global batch and its (W * B,) global positions.
    """
    X = batch.coordinates()
    if X is None:
        raise NotImplementedError(
            f"distributed GraB cannot gather a {type(batch).__name__}: exact hook statistics "
            "would need the (B, d) per-example gradients of every rank. Build the sampler "
            'with statistics="sketch" (the ranks exchange (B, k) sketches), or pass the '
            "dense (or projected) per-example gradients to step() on every rank."
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"num_replicas={num_replicas}: the ranks share gradients through "
            "torch.distributed, but no process group is initialised; call "
            "torch.distributed.init_process_group(...) before stepping."
        )
    W = num_replicas
    if dist.get_world_size() != W:
        raise ValueError(
            f"num_replicas={W}, but the process group has {dist.get_world_size()} ranks: the "
            "ranks exchange gradients over the default process group, so the sampler's "
            "num_replicas must be its world size (leave num_replicas and rank unset to take "
            "them from the group)."
        )
    shape = torch.tensor([X.shape[0], stepped, X.shape[1]], device=X.device)
    sizes = [torch.zeros(3, dtype=torch.int64, device=X.device) for _ in range(W)]
    dist.all_gather(sizes, shape)
    if any(not torch.equal(s, shape) for s in sizes):
        raise ValueError(
            "ranks called step() with different batch sizes, positions or gradient widths "
            f"({[tuple(s.tolist()) for s in sizes]} as (batch size, examples stepped, numbers "
            "per gradient)); every rank must step the same number of examples each time, with "
            "gradients of the same parameters (and the same projection)."
        )
    gathered = [torch.empty_like(X) for _ in range(W)]
    dist.all_gather(gathered, X.contiguous())
    rows = torch.stack(gathered, dim=1).reshape(X.shape[0] * W, X.shape[1])
    global_positions = (positions[:, None] * W + torch.arange(W)[None, :]).reshape(-1)
    return batch.derived(rows), global_positions


def global_rows(
    batch: GradientBatch, position: int, num_replicas: int, n: int, padded: torch.Tensor
) -> tuple[GradientBatch, torch.Tensor]:
    """A step's rows of all ranks without the padding, and their dataset indices.

    Args:
        position: this rank's local position of the batch's first row.
        padded: the epoch's (total_size,) padded global order.
    """
    positions = torch.arange(position, position + batch.size)
    if num_replicas > 1:
        batch, global_positions = gather_rows(batch, positions, position, num_replicas)
    else:
        global_positions = positions
    keep = global_positions < n  # padding repeats examples: not balanced twice
    indices = padded[global_positions[keep]]
    if not bool(keep.all()):
        batch = batch.derived(batch.coordinates()[keep.to(batch.device)])
    return batch, indices
