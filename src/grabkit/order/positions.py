"""Which positions of the epoch a ``step()`` or ``skip()`` covers, checked before anything moves.

Positions are this rank's visit positions 0 .. num_samples - 1 of the epoch; ``stepped`` is
how many were balanced or skipped so far, ``yielded`` how many were handed out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from grabkit.validation import check_non_negative_int

__all__ = ["first_position", "skip_count"]


def first_position(
    B: int,
    stepped: int,
    yielded: int,
    num_samples: int,
    batch_size: int,
    epoch: int,
    *,
    local: Callable[[], torch.Tensor] | None,
    indices: torch.Tensor | Iterable[int] | None,
    hook: bool,
) -> int:
    """Where a step's B examples start (>= ``stepped``).

    Args:
        local: the rank's (num_samples,) dataset indices in visit order, when ``indices`` (the
            B dataset indices the caller says the gradients belong to) are given.
        hook: hook mode without indices: the B examples must end a batch of ``batch_size``
            (or the epoch) and, once the epoch was iterated, lie among the yielded examples (a
            backward over part of a batch would otherwise shift every later attribution).
    """
    left = num_samples - stepped
    if left < B:
        raise ValueError(
            f"step() got gradients of {B} examples but epoch {epoch} has only {left} "
            f"of its {num_samples} examples left to step on this rank. Call "
            "iter(sampler) (start the next epoch) before stepping its batches, and pass one "
            "gradient per example yielded."
        )
    if indices is not None and local is not None:
        return _locate(local(), indices, B, stepped, num_samples, epoch)
    end = stepped + B
    if not hook and yielded and end > yielded:  # yielded 0: driven by its order, not iterated
        raise ValueError(
            f"step() got gradients of {B} examples, but only {yielded - stepped} of the "
            f"examples yielded in epoch {epoch} were not stepped yet (positions "
            f"{stepped}..{end - 1} were not all handed out); step each batch after the loader "
            "yielded it (iter(sampler) starts the epoch), with one gradient per example."
        )
    mid_batch = end % batch_size and end < num_samples
    if hook and B and ((yielded and end > yielded) or mid_batch):  # yielded 0: not iterated
        raise ValueError(
            f"hook mode: the backward(s) since the last step() covered {B} examples, but "
            f"positions {stepped}..{end - 1} are not a whole number of the "
            f"{yielded - stepped} yielded, unstepped examples in batches of {batch_size}; run "
            "the backward over the whole yielded batch (pass the loader's batch_size to the "
            "sampler so it can check), or pass indices=."
        )
    return stepped


def _locate(
    local: torch.Tensor,
    indices: torch.Tensor | Iterable[int],
    B: int,
    stepped: int,
    num_samples: int,
    epoch: int,
) -> int:
    wanted = torch.as_tensor(indices)
    if wanted.is_floating_point() or wanted.is_complex() or wanted.dtype == torch.bool:
        raise TypeError(
            f"step(indices=...) should hold integer dataset indices, but got dtype "
            f"{wanted.dtype}; pass the indices as yielded (e.g. the batch's idx column, .long())."
        )
    wanted = wanted.reshape(-1).to(torch.int64)
    if wanted.numel() != B:
        raise ValueError(
            f"step() got {wanted.numel()} indices for the gradients of {B} examples; pass "
            "one dataset index per gradient row."
        )
    for start in range(stepped, num_samples - B + 1):
        if torch.equal(local[start : start + B], wanted):
            return start
    raise ValueError(
        f"step(indices={wanted.tolist()}): these are not the next examples of epoch {epoch} "
        f"in visit order on this rank (after the {stepped} stepped); pass the indices exactly "
        "as the sampler yielded them, once."
    )


def skip_count(
    count: int | None, kept: int, stepped: int, num_samples: int, batch_size: int
) -> int:
    """How many examples ``skip(count)`` passes over: ``count``, or (None) the rest of the
    current batch of ``batch_size`` (covering the ``kept`` hook-mode examples)."""
    if count is None:
        if batch_size == 1 and not kept:
            raise ValueError(
                "skip() needs the number of examples to skip, skip(len(batch)): this "
                "sampler does not know the loader's batch size (pass batch_size= to it)."
            )
        end = stepped + max(kept, 1)
        count = min(math.ceil(end / batch_size) * batch_size, num_samples) - stepped
    check_non_negative_int("count", count)
    if count > num_samples - stepped:
        raise ValueError(
            f"skip({count}) but the epoch has only {num_samples - stepped} examples left to "
            "step on this rank."
        )
    return count
