"""The gradient noise scale of Hugging Face Trainer's steps, measured as Trainer weights them.

Measuring never changes training: Trainer's loss scaling is left as it is, and the measurement
follows it. Trainer weights the microbatches of a window in one of two ways (``training_step``):

* ``"items"``: the loss of each microbatch is its label-token sum over ``num_items_in_batch``, the
  window's label tokens (models that take loss kwargs: causal and masked LMs, ...). Microbatch k
  contributes t_k / N of the window's gradient, so each is counted by its label tokens (counted as
  Trainer counts them, shifted for causal LMs): the estimate is **per label token** (per example
  for a classifier, whose labels are one per example).
* ``"steps"``: each microbatch's mean loss is divided by the window's K microbatches (models
  without loss kwargs, ``loss_is_scaled_for_ga=False``): shares 1 / K, so the microbatches are
  counted in examples and the estimate is **per example**. A window whose microbatches differ in
  size is not weighted by size, so it is left out (``discard_step``).

Under ``fp16=True`` Trainer multiplies each loss by its ``GradScaler``'s scale before the
backward and unscales the gradients only at the optimizer step, after the window was measured:
the scale is divided out of every microbatch's norms (it changes between windows, growth and
back-off), and an overflowing window (gradients not finite, the update skipped) is skipped.

One process: ``AccumulationNoiseScale`` (microbatch norms against the window's; needs
``gradient_accumulation_steps >= 2``). Several processes: ``DDPNoiseScale`` on the DDP-wrapped
model (each rank's local window gradient against the all-reduced one, measured in DDP's
communication hook), counted in each rank's local examples or tokens; a window in which a rank's
local gradient is not its own mean (``"items"`` with ``average_tokens_across_devices`` when the
ranks hold different token counts, ``"steps"`` with microbatches of different sizes) is left out
on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from grabkit.noise.accumulation import AccumulationNoiseScale
from grabkit.noise.ddp import DDPNoiseScale
from grabkit.noise.result import NoiseScaleResult

__all__ = ["TrainerNoiseScale"]


class TrainerNoiseScale:
    """One estimator for Trainer's windows, on one process or several (see the module doc).

    Args:
        model: the (unwrapped) model, for the one-process estimator.
        options: ``AccumulationNoiseScale`` / ``DDPNoiseScale`` keywords.
        world_size: Trainer's processes; several: the estimator is built on the DDP model at the
            first microbatch.
    """

    def __init__(self, model: nn.Module, options: Mapping[str, Any], world_size: int) -> None:
        self.options, self.world_size = dict(options), int(world_size)
        self.estimator: AccumulationNoiseScale | DDPNoiseScale | None = None
        if self.world_size == 1:
            self.estimator = AccumulationNoiseScale(model, **self.options)
        self._counts: list[float] = []
        self._pending_state: dict | None = None
        self._device = torch.device("cpu")

    def attach(self, model: nn.Module) -> None:
        """Several processes: build ``DDPNoiseScale`` on the DDP ``model`` now, before its first
        backward (its communication hook must see every synchronised one); one process: nothing
        to do."""
        if self.estimator is None:
            self.estimator = self._ddp_estimator(model)

    def microbatch(
        self, model: nn.Module, count: float, weighting: str, window_items: float | None,
        last: bool, grad_scaler: Any = None,
    ) -> None:  # fmt: skip
        """After microbatch ``count``'s backward; ``last``: the window's synchronising one.

        ``window_items``: Trainer's ``num_items_in_batch`` (with ``"items"`` weighting).
        ``grad_scaler``: the ``torch.amp.GradScaler`` that scaled this backward's loss
        (Trainer's ``fp16=True``: ``accelerator.scaler``), read before its ``update()``; its
        scale is divided out of the measured norms (a ``grad_scaler`` in the options wins).
        """
        self.attach(model)
        if "grad_scaler" not in self.options:
            self.estimator.grad_scaler = grad_scaler
        self._counts.append(float(count))
        if isinstance(self.estimator, AccumulationNoiseScale):
            self.estimator.end_microbatch(count)
        if not last:
            return
        counts, self._counts = self._counts, []
        exact = self._exact(counts, weighting, window_items)
        if isinstance(self.estimator, AccumulationNoiseScale):
            if exact:
                self.estimator.end_step()
            else:
                self.estimator.discard_step()
            return
        if self._everywhere(exact):
            self.estimator.observe_step(sum(counts))
        else:
            self.estimator.discard_step()

    def discard_window(self) -> None:
        """Close the window whose last (synchronising) backward just ran without measuring it,
        as ``microbatch(..., last=True)`` would close it; every rank must discard the same one."""
        self._counts = []
        if self.estimator is not None:
            self.estimator.discard_step()

    def _exact(self, counts: list[float], weighting: str, window_items: float | None) -> bool:
        """Whether the window's gradient is weighted as the counts say (this rank)."""
        if weighting == "steps":
            return len(set(counts)) == 1
        if window_items is None:
            return True
        if self.world_size == 1:
            if abs(sum(counts) - window_items) > 0.5:
                raise ValueError(
                    f"GrabkitTrainer: Trainer divided this window's loss by num_items_in_batch="
                    f"{window_items:g} label tokens but the microbatches hold {sum(counts):g}; the "
                    'noise scale cannot weight them. Pass count="tokens" (counted as Trainer '
                    "counts them) or report the mismatch."
                )
            return True
        # num_items_in_batch is the ranks' total: a local gradient is the local mean only when
        # this rank holds its 1 / W share of the window's tokens
        return (
            abs(sum(counts) * self.world_size - window_items) <= 0.5
            or abs(sum(counts) - window_items) <= 0.5
        )

    def _everywhere(self, exact: bool) -> bool:
        """Whether every rank's window is exact (one all-reduce of a flag)."""
        flag = torch.tensor([0.0 if exact else 1.0], device=self._device)
        dist.all_reduce(flag, group=self.estimator.process_group)
        return float(flag) == 0.0

    def _ddp_estimator(self, model: nn.Module) -> DDPNoiseScale:
        if not isinstance(model, DistributedDataParallel):
            raise NotImplementedError(
                f"GrabkitTrainer: noise_scale= with {self.world_size} processes measures local "
                "against all-reduced gradients in DistributedDataParallel's communication hook "
                f"(DDPNoiseScale), but Trainer wrapped the model in {type(model).__name__} (FSDP "
                "or DeepSpeed); train with plain DDP, or without noise_scale=."
            )
        estimator = DDPNoiseScale(model, **self.options)
        self._device = next(model.parameters()).device  # where the backend reduces (nccl: GPU)
        if self._pending_state is not None:
            estimator.load_state_dict(self._pending_state)
            self._pending_state = None
        return estimator

    @property
    def result(self) -> NoiseScaleResult | None:
        """The estimate so far (under DDP: including the last step's all-reduce)."""
        return None if self.estimator is None else self.estimator.estimate

    def state_dict(self) -> dict:
        if self.estimator is None:
            return {} if self._pending_state is None else self._pending_state
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._counts = []  # a loaded state starts at a window's start
        if self.estimator is None:
            self._pending_state = state
        else:
            self.estimator.load_state_dict(state)
