"""Agreement across ranks: every statistic a decision reads goes through one all-reduce.

Each rank folds its own microbatch; the decision to step must be identical on every rank or the
replicas diverge. So the wrapper never decides on a local number: it packs the statistics of one
microbatch into a small float64 vector and all-reduces it (SUM) before any rule reads it.

Gradient norms need to know how the gradient is laid out across ranks:

* ``"replicated"`` (DDP and friends): every rank holds the whole gradient. Under DDP the copies
  are equal after backward. Where they are not (a backward under DDP's ``no_sync()`` or
  accelerate's ``accumulate()``, or no DDP at all), the gradients were never reduced and folding
  them would make each rank's update its local gradient: a fingerprint of every microbatch's
  gradient travels in the same all-reduce (:func:`replica_fingerprint`), and where the ranks'
  fingerprints differ the wrapper averages the gradients over the ranks itself
  (:func:`average_over_ranks`), as DDP would have. Decisions and updates are then those of the
  global microbatches, at the price of one unbucketed all-reduce per such microbatch (so
  ``no_sync()`` saves nothing with an adaptive wrapper, which warns once).
* ``"sharded"`` (FSDP-style): every rank holds a disjoint shard; the squared norm of the whole
  gradient is the SUM of the shards' squared norms (the norm is sqrt(sum of squares)).

The wrapper reads the layout from the parameters unless told (:mod:`grabkit.sharding`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grabkit.sharding import GradientLayout
from grabkit.stats.transfer import to_device

__all__ = [
    "GradientLayout",
    "StatisticsReducer",
    "average_over_ranks",
    "held_by_fully_shard",
    "replica_fingerprint",
    "replicas_differ",
]


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


# |g|^2 fingerprints of bitwise-equal replicas agree to rounding (about 1e-8 relative); gradients
# that were never reduced differ by O(1)
_REPLICA_TOLERANCE = 1e-6
_GOLDEN = 0.6180339887498949


def replica_fingerprint(squares: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[F, F^2]`` of this rank's microbatch gradient, F = sum_p w_p |g_p|^2 (float64).

    ``squares`` (n,) are the squared norms of the gradients this rank holds, ``indices`` (n,) the
    positions of their parameters in the optimizer; the weights w_p in [1, 2) depend on the
    position only, so replicas of one gradient give the same F on every rank, while gradients
    that differ (not reduced, or held for other parameters) give different ones. Summed over
    ranks, the pair tells whether every rank had the same F (:func:`replicas_differ`).
    """
    positions = to_device(indices, squares.device).to(squares.dtype)
    weights = 1.0 + torch.remainder(positions * _GOLDEN, 1.0)
    fingerprint = (weights * squares).sum()
    return torch.stack([fingerprint, fingerprint.square()])


def replicas_differ(total: float, total_sq: float, world: int) -> bool:
    """Whether the ranks' fingerprints (summed: ``total``, ``total_sq``) were not all equal."""
    if total_sq <= 0.0 or total != total:  # zero gradients, or NaN (dropped as non-finite)
        return False
    mean = total / world
    spread_sq = max(total_sq / world - mean * mean, 0.0)
    return spread_sq**0.5 > _REPLICA_TOLERANCE * abs(mean)


def average_over_ranks(
    reducer: StatisticsReducer,
    params: list[torch.Tensor],
    grads: dict[torch.Tensor, torch.Tensor],
    inverse_scale: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, mean over ranks of the rank's gradient in true units)`` for every parameter that
    has a gradient on some rank (a rank without one adds zeros, as DDP does for a parameter it
    did not use); two collectives. New tensors: the ``.grad`` a user may hold is not changed.

    Sums are float32 for float16/bfloat16 gradients (and in the gradient's dtype otherwise);
    ``inverse_scale`` (a GradScaler's 1 / scale on this rank) is applied before the sum, so ranks
    whose scales differ still add true gradients.
    """
    device = next(iter(grads.values())).device
    present = torch.tensor([float(p in grads) for p in params], dtype=torch.float64)
    present = reducer.sum(to_device(present, device)).tolist()
    union = [p for p, n in zip(params, present, strict=True) if n > 0]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in union:
        dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        groups.setdefault((dtype, p.device), []).append(p)
    averaged = []
    for (dtype, device), members in groups.items():
        flat = torch.cat(
            [
                grads[p].reshape(-1).to(dtype)
                if p in grads
                else torch.zeros(p.numel(), dtype=dtype, device=device)
                for p in members
            ]
        )
        scale = to_device(torch.tensor(1.0 / reducer.world_size, dtype=torch.float64), device)
        if inverse_scale is not None:
            scale = scale * to_device(inverse_scale, device).to(torch.float64)
        flat.mul_(scale.to(dtype))
        if reducer.world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=reducer.process_group)
        for p, mean in zip(members, flat.split([p.numel() for p in members]), strict=True):
            averaged.append((p, mean.view(p.shape)))
    return averaged


def held_by_fully_shard(params: list[torch.Tensor]) -> bool:
    """Whether ``fully_shard`` (FSDP2) holds an unreduced gradient of one of ``params``.

    Under ``set_requires_gradient_sync(False)`` FSDP2 accumulates the unsharded gradient and
    writes nothing into the sharded ``.grad``, so a microbatch looks like one without backward;
    the gradient reaches ``.grad`` at the next synchronised backward, summed with that
    microbatch's. Read from FSDP2's per-module states (a private registry of torch; without it
    nothing is found).
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # pragma: no cover - a torch without FSDP2's registry
        return False
    wanted = set(params)
    for reference in list(_module_state_mapping.values()):
        state = reference() if callable(reference) else reference
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if fsdp_param.sharded_param not in wanted:
                continue
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None or (
                unsharded is not None and unsharded.grad is not None
            ):
                return True
    return False
