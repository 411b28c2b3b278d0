"""Agreement across ranks: every statistic a decision reads goes through one all-reduce.

Each rank folds its own microbatch; the decision to step must be identical on every rank or the
replicas diverge. So the wrapper never decides on a local number: it packs the statistics of one
microbatch into a small float64 vector and all-reduces it (SUM) before any rule reads it.

Gradient norms need to know how the gradient is laid out across ranks:

* ``"replicated"`` (DDP and friends): every rank holds the whole gradient. Under DDP the copies
  are equal after backward; without DDP they may differ, and the *average* of the per-rank
  squared norms is used so that every rank reads the same number.
* ``"sharded"`` (FSDP-style): every rank holds a disjoint shard; the squared norm of the whole
  gradient is the SUM of the shards' squared norms (the norm is sqrt(sum of squares)).

The wrapper reads the layout from the parameters unless told (:mod:`grabkit.sharding`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grabkit.sharding import GradientLayout

__all__ = ["GradientLayout", "StatisticsReducer"]


class StatisticsReducer:
    """Sum small statistic vectors over a process group; a no-op without torch.distributed."""

    def __init__(self, process_group=None, gradient_layout: GradientLayout = "replicated") -> None:
        if gradient_layout not in ("replicated", "sharded"):
            raise ValueError(
                "gradient_layout should be 'replicated' or 'sharded', but got "
                f"gradient_layout={gradient_layout!r}"
            )
        self.process_group = process_group
        self.gradient_layout = gradient_layout

    @property
    def world_size(self) -> int:
        """Number of ranks that must agree (1 when torch.distributed is not initialised)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) a 1-D float64 vector in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.process_group)
        return values

    def norm_sq_scale(self) -> float:
        """Factor turning a SUM of per-rank squared norms into the squared norm to decide on."""
        return 1.0 if self.gradient_layout == "sharded" else 1.0 / self.world_size
