"""One step's unbiased (|G|^2, tr Sigma) from microbatch norms, on one rank or several.

A step averages microbatch gradients g_{r,k} (rank r, microbatch k, n_{r,k} examples each, an
unbiased mean gradient with E |g_{r,k}|^2 = |G|^2 + tr(Sigma) / n_{r,k}) into the step gradient

    G_step = sum_{r,k} a_{r,k} g_{r,k},       sum_{r,k} a_{r,k} = 1,

with weights set by how the loop combines them: losses scaled by their share of the rank's batch
and DDP / FSDP averaging the ranks give a_{r,k} = n_{r,k} / (R B_r); an adaptive accumulation
window weighted by counts c_k over R averaging ranks gives a_{r,k} = c_k / (C R). For independent
microbatches, the identities of :mod:`grabkit.noise.identities` hold with

* small: S = sum a_{r,k} |g_{r,k}|^2, E S = |G|^2 + tr(Sigma) sum a/n, so b_small = 1 / sum a/n;
* big: E |G_step|^2 = |G|^2 + tr(Sigma) sum a^2/n, so b_big = 1 / sum a^2/n,

and b_small < b_big whenever two or more microbatches share the step (each a < 1). With one rank
and weights n_k / B this is the familiar b_small = B / K, b_big = B; with one microbatch per rank
it is ``DDPNoiseScale``'s harmonic-mean rule.

Every rank computes its own sums (:func:`rank_terms`); with several ranks they are all-gathered
(one small vector per rank and step) and combined alike on every rank (:func:`combine`). |G_step|^2
is read from the reduced gradient: whole on every rank (``"replicated"``, DDP: the ranks' copies
must agree, which also proves that the step's gradients were synchronised) or one shard per rank
(``"sharded"``, FSDP2: the squared norm is the sum of the shards').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grabkit.noise.identities import two_batch_estimates
from grabkit.sharding import GradientLayout
from grabkit.stats.transfer import to_device

__all__ = ["combine", "gather_terms", "rank_terms"]

# |G_step|^2 of a replicated gradient is computed by the same code from the same reduced values
# on every rank; copies further apart than this were not synchronised
_REPLICA_TOLERANCE = 1e-6

_SCALARS = 5  # weight, sum a/n, sum a^2/n, examples, microbatches


def rank_terms(
    norms_sq: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor,
    step_norm_sq: torch.Tensor,
) -> torch.Tensor:
    """This rank's sums as one float64 vector ``[S (P), sum a, sum a/n, sum a^2/n, sum n, K,
    |G_step|^2 measured here (P)]``.

    Args:
        norms_sq: (K, P) |g_k|^2 per block of this rank's microbatch mean gradients.
        counts: (K,) n_k, the examples (or tokens) of each.
        weights: (K,) a_k, each microbatch's weight in the step gradient.
        step_norm_sq: (P,) |G_step|^2 per block as this rank holds it (whole or its shard).
    """
    norms_sq, counts, weights = (t.to(torch.float64) for t in (norms_sq, counts, weights))
    scalars = torch.stack(
        [
            weights.sum(),
            (weights / counts).sum(),
            (weights.square() / counts).sum(),
            counts.sum(),
            to_device(torch.tensor(float(len(counts)), dtype=torch.float64), counts.device),
        ]
    )
    small = (weights[:, None] * norms_sq).sum(0)
    return torch.cat([small, scalars, step_norm_sq.to(torch.float64).reshape(-1)])


def gather_terms(terms: torch.Tensor, process_group: object, world: int) -> torch.Tensor:
    """Every rank's ``rank_terms`` as a (R, len) matrix (collective; (1, len) for one rank)."""
    if world == 1:
        return terms[None]
    parts = [torch.empty_like(terms) for _ in range(world)]
    dist.all_gather(parts, terms, group=process_group)
    return torch.stack(parts)


def _step_norm_sq(big: torch.Tensor, layout: GradientLayout, names: tuple[str, ...]):
    if layout == "sharded":
        return big.sum(0)
    spread = (big - big[0]).abs().amax(0)
    scale = big[0].abs().clamp_min(torch.finfo(torch.float64).tiny)
    unsynced = (spread > _REPLICA_TOLERANCE * scale).nonzero().flatten().tolist()
    if unsynced:
        block = unsynced[0]
        values = ", ".join(f"{v:.6g}" for v in big[:, block].tolist())
        raise RuntimeError(
            f"the step's gradient differs across ranks (|grad|^2 of {names[block]!r}: {values} "
            "by rank), so it was not averaged over the ranks: the noise scale needs the "
            "synchronised step gradient. Close the step after the backward that synchronises "
            "(the last microbatch outside DistributedDataParallel.no_sync(), or when "
            "accelerate's sync_gradients is True), on a DistributedDataParallel or fully_shard "
            "model; to measure each process on its own, pass process_group=dist.new_group([rank])"
        )
    return big[0]


def combine(
    rows: torch.Tensor, layout: GradientLayout, names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(|G|^2, tr Sigma) per block and the step's examples from every rank's ``rank_terms``;
    None when the whole step holds fewer than two microbatches (no noise information)."""
    blocks = len(names)
    small_sum = rows[:, :blocks].sum(0)
    weight, inv, sq_inv, examples, microbatches = rows[:, blocks : blocks + _SCALARS].sum(0)
    if float(microbatches) < 2:
        return None
    big = _step_norm_sq(rows[:, blocks + _SCALARS :], layout, names)
    weight = float(weight)
    small = small_sum / weight
    b_small, b_big = weight / float(inv), weight**2 / float(sq_inv)
    grad_norm, trace = two_batch_estimates(small, b_small, big, b_big)
    return grad_norm, trace, float(examples)
