"""Lightning ``Callback``s: GraB ordering, adaptive accumulation and noise-scale logging.

``pip install grabkit[lightning]``; each capability is one callback::

    sampler = GraBSampler(dataset, model=model)           # hook mode on the LightningModule
    loader = DataLoader(dataset, sampler=sampler, batch_size=16)
    trainer = L.Trainer(callbacks=[GraBCallback(sampler)])

* ``GraBCallback``: ``sampler.step()`` after every backward (each microbatch under
  ``accumulate_grad_batches``); its state goes into Lightning's checkpoint through
  ``Callback.state_dict``, taken with the prefetched batches handed back, so a mid-epoch resume
  (``trainer.fit(..., ckpt_path=...)``) trains exactly the rest of the epoch in GraB's order.
  Under more than one process it raises: Lightning would wrap the sampler in
  ``DistributedSamplerWrapper``, whose order no longer follows GraB and whose ranks would
  credit gradients to the wrong examples.
* ``AdaptiveAccumulationCallback``: for a LightningModule whose ``configure_optimizers`` returns
  an ``AdaptiveAccumulationWrapper`` (a GQC wrapper). It passes each batch's ``count`` to the
  wrapper, moves ``gradient_clip_val`` from Lightning (which would clip every microbatch) to the
  wrapper (which clips the averaged gradient), and lets step-interval LR schedulers advance only
  on real updates. Keep ``accumulate_grad_batches=1``: the wrapper decides the window.
* ``NoiseScaleCallback``: ``AccumulationNoiseScale`` with Lightning's ``accumulate_grad_batches``
  windows, closed in ``on_before_optimizer_step`` (before Lightning clips) and logged with
  ``pl_module.log`` as ``noise_scale/*``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.integrations.resume import rewound_state
from grabkit.integrations.schedule import RealUpdateSchedule
from grabkit.noise.accumulation import AccumulationNoiseScale
from grabkit.order import GraBBatchSampler, GraBSampler

__all__ = ["AdaptiveAccumulationCallback", "GraBCallback", "NoiseScaleCallback", "batch_count"]


def batch_count(batch: Any) -> float:
    """The examples in a batch: dim 0 of its first tensor (dicts, lists and tuples searched)."""
    if isinstance(batch, torch.Tensor):
        return float(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for value in values:
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return float(value.shape[0])
    raise ValueError(
        f"cannot count the examples of a {type(batch).__name__} batch; pass count_fn= to the "
        "callback (batch -> number of examples or tokens)."
    )


def _single_process(trainer: Any, what: str) -> None:
    if trainer.world_size > 1:
        raise NotImplementedError(
            f"{what} runs in one process only, but this Trainer has world_size="
            f"{trainer.world_size}: Lightning would wrap the GraB sampler in a "
            "DistributedSamplerWrapper, whose order no longer follows GraB, and every rank would "
            "credit its gradients to the wrong examples. Train with devices=1, or use "
            "GraBSampler with dense per-example gradients in your own DDP loop."
        )


class GraBCallback(Callback):
    """Step a hook-mode ``GraBSampler`` after every backward; its state in the checkpoint.

    Args:
        sampler: the ``GraBSampler`` of the train ``DataLoader`` (built with ``model=`` the
            LightningModule or its network).
    """

    def __init__(self, sampler: GraBSampler | GraBBatchSampler) -> None:
        if isinstance(sampler, GraBBatchSampler):
            sampler = sampler.sampler  # the state and the steps are its sampler's
        if not isinstance(sampler, GraBSampler):
            raise TypeError(f"GraBCallback needs a GraBSampler, but got {type(sampler).__name__}")
        self.sampler = sampler

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            _single_process(trainer, "GraBCallback")

    def on_train_start(self, trainer, pl_module) -> None:
        loader = trainer.train_dataloader
        samplers = [getattr(loader, "sampler", None)]
        samplers.append(getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        if not any(s is self.sampler for s in samplers):
            raise ValueError(
                "GraBCallback: the train DataLoader does not draw from this callback's "
                f"GraBSampler (it uses {type(samplers[0]).__name__}); pass the same sampler to "
                "DataLoader(sampler=...) and to GraBCallback, and keep Trainer("
                "use_distributed_sampler=...) from replacing it."
            )

    def on_after_backward(self, trainer, pl_module) -> None:
        self.sampler.step()  # this microbatch's examples, with their own gradients

    def state_dict(self) -> dict[str, Any]:
        # Lightning prefetches a batch: hand the in-flight examples back to the sampler
        return {"sampler": rewound_state(self.sampler.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict["sampler"])


def _hand_clipping_to(wrapper: AdaptiveAccumulationWrapper, trainer: Any) -> None:
    """Lightning would clip every microbatch; the wrapper clips the averaged gradient instead."""
    clip = trainer.gradient_clip_val
    if not clip:
        return
    by_norm = trainer.gradient_clip_algorithm in (None, "norm")
    if not by_norm or wrapper.clip_grad_norm not in (None, float(clip)):
        raise ValueError(
            f"AdaptiveAccumulationCallback: Trainer(gradient_clip_val={clip}, "
            f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}) cannot be handed to "
            f"the wrapper (clip_grad_norm={wrapper.clip_grad_norm}); clip by norm, or set "
            "clipping on the wrapper only."
        )
    wrapper.clip_grad_norm = float(clip)
    trainer.gradient_clip_val = None


class AdaptiveAccumulationCallback(Callback):
    """Wire an ``AdaptiveAccumulationWrapper`` optimizer into Lightning's automatic optimization.

    Args:
        count_fn: batch -> its weight (examples, or tokens); default :func:`batch_count`.
    """

    def __init__(self, count_fn: Any = batch_count) -> None:
        self.count_fn = count_fn
        self.wrapper: AdaptiveAccumulationWrapper | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        wrappers = [o for o in trainer.optimizers if isinstance(o, AdaptiveAccumulationWrapper)]
        if len(wrappers) != 1 or len(trainer.optimizers) != 1:
            raise ValueError(
                "AdaptiveAccumulationCallback: configure_optimizers should return exactly one "
                "optimizer, an AdaptiveAccumulationWrapper (e.g. OptimizerWrapperGNTS(AdamW(...)))"
                "; "
                f"got {[type(o).__name__ for o in trainer.optimizers]}."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "AdaptiveAccumulationCallback: the wrapper decides when to step, so "
                "Trainer(accumulate_grad_batches=...) should be 1, but got "
                f"{trainer.accumulate_grad_batches}."
            )
        self.wrapper = wrapper = wrappers[0]
        _hand_clipping_to(wrapper, trainer)
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, RealUpdateSchedule):
                config.scheduler = RealUpdateSchedule(config.scheduler, wrapper)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.wrapper.default_count = self.count_fn(batch)  # the weight of this step() call

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("grabkit/optimizer_updates", float(self.wrapper.num_steps))


class NoiseScaleCallback(Callback):
    """Log the gradient noise scale of Lightning's ``accumulate_grad_batches`` windows.

    Each microbatch's loss must be its mean (Lightning divides it by ``accumulate_grad_batches``,
    so the accumulated gradient is the window's mean). Needs ``accumulate_grad_batches >= 2``.

    Args:
        count_fn: batch -> examples; default :func:`batch_count`.
        per_block: also log ``noise_scale/b_simple/<parameter>`` for every parameter tensor
            (one ``log`` entry each, which Lightning makes costly on small models).
        **options: ``AccumulationNoiseScale`` keywords (``update_rate``, ``window``, ...).
    """

    def __init__(
        self, count_fn: Any = batch_count, per_block: bool = False, **options: Any
    ) -> None:
        self.count_fn, self.per_block, self.options = count_fn, per_block, options
        self.estimator: AccumulationNoiseScale | None = None
        self.result = None
        self._count = 0.0
        self._pending_state: dict | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.accumulate_grad_batches < 2:
            raise ValueError(
                "NoiseScaleCallback compares microbatch gradients with their mean, so it needs "
                "Trainer(accumulate_grad_batches >= 2), but got "
                f"{trainer.accumulate_grad_batches}."
            )
        if self.estimator is None:
            self.estimator = AccumulationNoiseScale(pl_module, **self.options)
        if self._pending_state is not None:
            self.estimator.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._count = self.count_fn(batch)

    def on_after_backward(self, trainer, pl_module) -> None:
        self.estimator.end_microbatch(self._count)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.result = self.estimator.end_step()  # before Lightning clips
        if self.result is not None:
            values = self.result.as_dict()
            if not self.per_block:
                values = {k: v for k, v in values.items() if "/" not in k}
            pl_module.log_dict({f"noise_scale/{k}": v for k, v in values.items()})

    def state_dict(self) -> dict[str, Any]:
        return {} if self.estimator is None else {"estimator": self.estimator.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "estimator" in state_dict:
            if self.estimator is None:
                self._pending_state = state_dict["estimator"]
            else:
                self.estimator.load_state_dict(state_dict["estimator"])
