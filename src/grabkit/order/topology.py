"""``DistributedSampler``'s replica arithmetic (which positions of an epoch each rank takes), and
the ``Setting`` the sampler hands to its parts."""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grabkit.validation import check_int_in_range, check_positive_int

__all__ = ["Setting", "Topology", "dataset_size"]


def dataset_size(data_source: object) -> int:
    """``len(data_source)``, which must exist and be positive: only map-style datasets reorder."""
    if not isinstance(data_source, Sized):
        raise TypeError(
            "GraBSampler needs a dataset with len(), but got "
            f"{type(data_source).__name__}; iterable-style datasets cannot be reordered."
        )
    n = len(data_source)
    if n == 0:
        raise ValueError("GraBSampler got an empty dataset (len 0); there is nothing to order.")
    return n


@dataclass(frozen=True)
class Topology:
    """``DistributedSampler``'s layout: rank r of W takes ``num_samples`` of the ``total_size``
    padded (or, with ``drop_last``, truncated) positions: r, r + W, r + 2W, ..."""

    num_replicas: int
    rank: int
    num_samples: int
    total_size: int

    @classmethod
    def of(cls, n: int, num_replicas: int | None, rank: int | None, drop_last: bool) -> Topology:
        """The layout of n examples; ``num_replicas`` / ``rank`` default to the initialised
        process group (else 1 and 0)."""
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        check_positive_int("num_replicas", num_replicas)
        check_int_in_range("rank", rank, 0, num_replicas - 1)
        if drop_last and n % num_replicas:
            num_samples = n // num_replicas
        else:
            num_samples = math.ceil(n / num_replicas)
        if num_samples == 0:
            raise ValueError(
                f"drop_last=True with {n} examples and num_replicas={num_replicas} leaves no "
                "example for any rank; use drop_last=False or a larger dataset."
            )
        return cls(num_replicas, rank, num_samples, num_samples * num_replicas)

    def local_positions(self, start: int, count: int) -> slice | torch.Tensor:
        """Where this rank's visit positions start .. start + count - 1 sit in the padded
        global order: a slice on one process, an int64 tensor on several."""
        if self.num_replicas == 1:
            return slice(start, start + count)
        return torch.arange(start, start + count) * self.num_replicas + self.rank


@dataclass(frozen=True)
class Setting:
    """What the sampler's parts (gradient source, transforms) may need to know about it: the
    dataset size, the seed that every random choice derives from, and the rank layout."""

    n: int
    seed: int
    topology: Topology
