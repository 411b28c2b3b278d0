"""Noise scale under DistributedDataParallel, for free: local norms against the all-reduced norm.

DDP already computes both gradients of the two-batch identity. Before the all-reduce, each bucket
holds the rank's local mean gradient g_r over its n_r examples; after it, the average
G_R = (1/R) sum_r g_r. Averaging |g_r|^2 over ranks gives E = |G|^2 + tr(Sigma) / H with H the
harmonic mean of the n_r, and E |G_R|^2 = |G|^2 + tr(Sigma) / (R H), so
``two_batch_estimates(mean_r |g_r|^2, H, |G_R|^2, R H)`` is unbiased.

A DDP communication hook takes the squared norms of each bucket's parameters before and after the
all-reduce (which it performs as DDP's default hook does: divide by the world size, then SUM,
since gloo has no AVG). ``observe_step`` then all-reduces one small vector per step (one entry per
parameter block, plus the example counts) asynchronously, overlapping the next step; nothing of
gradient size is communicated beyond DDP's own all-reduce. Under ``no_sync`` the hook does not run
and gradients accumulate locally; the next synchronised backward carries the whole local
accumulation, so pass the examples of all those microbatches as the step's count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grabkit.noise.blocks import named_trainable_parameters
from grabkit.noise.identities import loss_scale_squared, two_batch_estimates
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.tracker import TrackedEstimator
from grabkit.stats.transfer import to_device
from grabkit.validation import check_positive

__all__ = ["DDPNoiseScale"]


class DDPNoiseScale(TrackedEstimator):
    """Gradient noise scale of a ``DistributedDataParallel`` model via a communication hook.

    Usage (every rank)::

        model = DistributedDataParallel(net)
        gns = DDPNoiseScale(model, update_rate=0.01)    # registers the comm hook
        for x, y in loader:
            loss_fn(model(x), y).backward()              # mean loss over the local batch
            gns.observe_step(len(x))                     # local examples of this step
            optimizer.step(); optimizer.zero_grad()
        print(gns.estimate.b_simple)

    Args:
        model: the DDP-wrapped model (its comm hook slot must be free: DDP allows one hook).
        update_rate: EMA weight of the newest step, as in ``MicrobatchNoiseScale``.
        window: ``"steps"`` or ``"examples"``, the unit of ``update_rate``.
        confidence: coverage of the reported interval for B_simple.
        population_size: the data set size N when steps draw without replacement (see
            ``NoiseScaleTracker``).
        grad_scaler: a ``torch.amp.GradScaler`` multiplying the losses; its scale is divided out
            (call ``observe_step`` before ``grad_scaler.update()``).

    The loss must be the mean over each rank's local examples (DDP then averages the ranks).
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        grad_scaler: torch.amp.GradScaler | None = None,
        population_size: int | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"DDPNoiseScale expects a DistributedDataParallel model, but got "
                f"{type(model).__name__}; wrap it first, or use AccumulationNoiseScale(model), "
                "which also measures fully_shard (FSDP2) models and one process"
            )
        self.process_group = model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        if self.world_size < 2:
            raise ValueError(
                f"DDPNoiseScale needs at least 2 processes, but the process group has "
                f"{self.world_size}; use AccumulationNoiseScale in a single process"
            )
        named = named_trainable_parameters(model.module, "DDPNoiseScale")
        self.block_names = tuple(name for name, _ in named)
        self._block_of = {id(p): i for i, (_, p) in enumerate(named)}
        self._device = named[0][1].device
        super().__init__(update_rate, window, confidence, self.block_names, population_size)
        self.grad_scaler = grad_scaler
        # (block indices, squared norms) per bucket; appended from hook and callback threads
        self._local: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._reduced: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hook_calls: dict[int, int] = {}  # bucket index -> hook runs since observe_step
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # the previous step's small all-reduce, still in flight: (work, summed, reduced, scale^2)
        self._pending: tuple[dist.Work, torch.Tensor, torch.Tensor, float] | None = None
        model.register_comm_hook(state=None, hook=self._hook)

    @staticmethod
    def _squares(views: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.dot(v.reshape(-1), v.reshape(-1)) for v in views]).double()

    def _block_index(self, params: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(id(p) for p in params)
        index = self._index_cache.get(key)
        if index is None:
            blocks = [self._block_of[id(p)] for p in params]
            index = self._index_cache[key] = to_device(torch.tensor(blocks), self._device)
        return index

    # no annotations: DDP compares them to the real classes, and postponed ones are strings
    def _hook(self, _state, bucket):  # (None, dist.GradBucket) -> Future[torch.Tensor]
        params = bucket.parameters()
        index = self._block_index(params)
        self._hook_calls[bucket.index()] = self._hook_calls.get(bucket.index(), 0) + 1
        self._local.append((index, self._squares(bucket.gradients())))
        numels = [p.numel() for p in params]
        buffer = bucket.buffer()
        buffer.div_(self.world_size)  # gloo has no AVG: divide, then SUM
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)

        def record(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()[0]
            self._reduced.append((index, self._squares(list(reduced.split(numels)))))
            return reduced

        return work.get_future().then(record)

    def _per_block(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        out = torch.zeros(len(self.block_names), dtype=torch.float64, device=self._device)
        for index, values in parts:
            out.index_add_(0, index, values)
        return out

    def observe_step(self, count: float) -> NoiseScaleResult | None:
        """Start folding in the step whose synchronised backward just ran (``count``: local
        examples) and return the estimate up to the previous step.

        The step's few scalars are all-reduced asynchronously, overlapping the next step; they are
        folded in at the next ``observe_step`` or when ``estimate`` is read. Collective: every
        rank must call it, once per synchronised backward. Steps with non-finite norms (an
        overflowing loss scale) are skipped. Returns None until a step was folded in.
        """
        count = check_positive("count", count)
        if not self._reduced:
            raise RuntimeError(
                "no synchronised backward since the last observe_step(); call it after the "
                "backward that ran outside no_sync()"
            )
        repeats = max(self._hook_calls.values())
        local, reduced = self._per_block(self._local), self._per_block(self._reduced)
        self._local, self._reduced, self._hook_calls = [], [], {}
        if repeats > 1:
            raise RuntimeError(
                f"DDP synchronised gradients {repeats} times since the last observe_step(); "
                "call observe_step(count) after every synchronised backward, and run both "
                "forward and backward of accumulated microbatches inside no_sync()"
            )
        scale_sq = loss_scale_squared(self.grad_scaler)
        extra = to_device(torch.tensor([1.0 / count, count], dtype=torch.float64), self._device)
        summed = torch.cat([local, extra])
        work = dist.all_reduce(summed, group=self.process_group, async_op=True)
        self._fold_pending()
        self._pending = (work, summed, reduced, scale_sq)
        return super().estimate

    def discard_step(self) -> None:
        """Close the step whose synchronised backward just ran without measuring it (where
        ``observe_step`` would go), e.g. when its local gradients are not each rank's mean over
        its examples. Every rank must discard the same step (no collective runs)."""
        self._local, self._reduced, self._hook_calls = [], [], {}

    def _fold_pending(self) -> None:
        if self._pending is None:
            return
        work, summed, reduced, scale_sq = self._pending
        self._pending = None
        work.wait()
        mean_local = summed[:-2] / self.world_size / scale_sq
        harmonic = self.world_size / float(summed[-2])  # of the ranks' example counts
        grad_norm, trace = two_batch_estimates(
            mean_local, harmonic, reduced / scale_sq, self.world_size * harmonic
        )
        self.fold(grad_norm, trace, float(summed[-1]))

    @property
    def estimate(self) -> NoiseScaleResult | None:
        """The current ``NoiseScaleResult`` including the last observed step (waits for its
        all-reduce), or None before the first finite step."""
        self._fold_pending()
        return super().estimate

    def observe(self, count: float) -> NoiseScaleResult | None:
        """``observe_step``: the step of ``count`` examples whose gradients DDP reduced."""
        return self.observe_step(count)

    def state_dict(self) -> dict[str, Any]:
        """The averages, the last observed step included (waits for its all-reduce)."""
        self._fold_pending()
        return super().state_dict()
