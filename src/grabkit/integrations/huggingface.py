"""Hugging Face ``Trainer`` with GraB ordering, adaptive accumulation and noise-scale logging.

One subclass, each capability one keyword (``pip install grabkit[huggingface]``)::

    trainer = GrabkitTrainer(model, args, train_dataset=ds, grab={"balance_type": "mean"})
    trainer = GrabkitTrainer(model, args, train_dataset=ds,
                             accumulation=lambda opt: OptimizerWrapperGNTS(opt, norm_threshold=0.5))
    trainer = GrabkitTrainer(model, args, train_dataset=ds, noise_scale={"update_rate": 0.05})

What it wires, and why plain callbacks cannot:

* ``grab``: the ``GraBSampler`` (hook mode on the model) is the train sampler
  (``_get_train_sampler``); ``sampler.step()`` runs after *every* microbatch's backward
  (``training_step``), so each example is balanced with its own gradient under gradient
  accumulation. Its state is written into every checkpoint (``grabkit_sampler.pt``) and, on
  ``train(resume_from_checkpoint=...)``, restored so that Trainer's own data skipping replays the
  interrupted epoch's order: the resumed run equals the uninterrupted one.
* ``accumulation``: a factory ``optimizer -> AdaptiveAccumulationWrapper`` (any GQC wrapper).
  Each Trainer step is one microbatch (``gradient_accumulation_steps`` must be 1: the wrapper
  decides the window); ``max_grad_norm`` moves from Trainer (which would clip every microbatch
  before the wrapper sees it) to the wrapper (which clips the averaged gradient); the microbatch's
  ``count`` (examples, or tokens with ``count="tokens"``) reaches the wrapper; the LR schedule
  advances on real updates only. ``state.global_step`` keeps counting microbatches (Trainer's
  data position and checkpoints depend on it); the real updates are logged as
  ``grabkit/optimizer_updates`` and shape the schedule.
* ``noise_scale``: ``AccumulationNoiseScale`` options; the step's estimate is closed after the
  last microbatch's backward, *before* Trainer clips, and ``noise_scale/*`` values go through
  ``Trainer.log``. Needs ``gradient_accumulation_steps >= 2`` (the microbatches are the small
  batches of the two-batch identity).

``accumulation`` sets ``args.max_grad_norm`` to 0 on the Trainer's own ``TrainingArguments``
(the value moves to the wrapper); ``noise_scale`` with ``count="examples"`` sets
``model_accepts_loss_kwargs = False`` so that each microbatch's mean loss is divided by the
accumulation steps (see ``_scale_losses_by_share``).

Single process only for ``grab`` and ``noise_scale`` (hook-mode GraB does not distribute yet):
a distributed run raises instead of letting accelerate shard the GraB order silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.integrations.resume import adopt_rank, replay_state
from grabkit.integrations.schedule import RealUpdateSchedule
from grabkit.noise.accumulation import AccumulationNoiseScale
from grabkit.order import GraBSampler

__all__ = ["GrabkitTrainer", "microbatch_count"]

SAMPLER_FILE = "grabkit_sampler.pt"
NOISE_FILE = "grabkit_noise_scale.pt"
_COUNTS = ("examples", "tokens")


def microbatch_count(inputs: Mapping[str, Any], count: str, shifted: bool = False) -> float:
    """Examples in a collated batch, or its label tokens (``labels != -100``) for ``"tokens"``.

    ``shifted``: the loss predicts token t + 1 from token t (causal LMs), so the first label of
    each row is no target: count ``labels[..., 1:]`` (or the collator's ``shift_labels``), as
    Trainer's ``num_items_in_batch`` does.
    """
    if count == "tokens":
        labels = inputs.get("shift_labels", inputs.get("labels"))
        if shifted and "shift_labels" not in inputs and labels is not None:
            labels = labels[..., 1:]
        if labels is None:
            raise ValueError(
                'count="tokens" counts the batch\'s label tokens, but the batch has no "labels"; '
                'use count="examples" or add labels to the collated batch.'
            )
        return float(labels.ne(-100).sum())
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return float(value.shape[0])
    raise ValueError("cannot count the examples of a batch without tensors; pass count='tokens'")


class _CheckpointFiles(TrainerCallback):
    """Write the sampler's and the estimator's state into each Trainer checkpoint folder."""

    def __init__(self, trainer: GrabkitTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.trainer.grab_sampler is not None:
            torch.save(self.trainer.grab_sampler.state_dict(), os.path.join(folder, SAMPLER_FILE))
        if self.trainer.noise_scale is not None:
            torch.save(self.trainer.noise_scale.state_dict(), os.path.join(folder, NOISE_FILE))


class GrabkitTrainer(Trainer):
    """``transformers.Trainer`` with grabkit's capabilities as keywords (see the module doc).

    Args (beyond ``Trainer``'s):
        grab: ``GraBSampler`` keywords (``{}`` for vanilla GraB); ``seed`` defaults to
            ``args.seed``. The sampler is ``trainer.grab_sampler`` once training starts.
        accumulation: ``optimizer -> AdaptiveAccumulationWrapper`` (e.g. a GQC wrapper class
            with its options bound); or pass the wrapper itself in ``optimizers=(wrapper, None)``.
        noise_scale: ``AccumulationNoiseScale`` keywords (``{}`` for the defaults); the last
            result is ``trainer.noise_scale_result``.
        count: ``"examples"`` or ``"tokens"``: the weight of a microbatch for the wrapper and the
            noise scale (tokens: ``labels != -100``; match how your loss is averaged).
    """

    def __init__(
        self,
        *args: Any,
        grab: Mapping[str, Any] | None = None,
        accumulation: Callable[[torch.optim.Optimizer], AdaptiveAccumulationWrapper] | None = None,
        noise_scale: Mapping[str, Any] | None = None,
        count: str = "examples",
        **kwargs: Any,
    ) -> None:
        if count not in _COUNTS:
            raise ValueError(f"`count` should be one of {_COUNTS}, but got count={count!r}")
        super().__init__(*args, **kwargs)
        self.grab_options = None if grab is None else dict(grab)
        self.accumulation = accumulation
        self.count = count
        self.grab_sampler: GraBSampler | None = None
        self.noise_scale: AccumulationNoiseScale | None = None
        self.noise_scale_result = None
        self._resume_folder: str | None = None
        self._wrapper_clip: float | None = None  # max_grad_norm, moved to the wrapper
        self._check_combination(noise_scale)
        if noise_scale is not None:
            self.noise_scale = AccumulationNoiseScale(self.model, **dict(noise_scale))
            self._scale_losses_by_share()
        if accumulation is not None or isinstance(self.optimizer, AdaptiveAccumulationWrapper):
            self._hand_clipping_to_wrapper()
        self.add_callback(_CheckpointFiles(self))

    # -- configuration checks ------------------------------------------------------------------
    def _check_combination(self, noise_scale: Mapping[str, Any] | None) -> None:
        adaptive = self.accumulation is not None or isinstance(
            self.optimizer, AdaptiveAccumulationWrapper
        )
        if (self.grab_options is not None or noise_scale is not None) and self.args.world_size > 1:
            raise NotImplementedError(
                f"GrabkitTrainer: grab= and noise_scale= run in one process only, but this run has "
                f"world_size={self.args.world_size}; accelerate would shard the GraB order across "
                "ranks and credit gradients to the wrong examples. Train on one process, or use "
                "GraBSampler with dense gradients in your own DDP loop."
            )
        if adaptive and self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "GrabkitTrainer: an adaptive accumulation wrapper decides when to step, so "
                "TrainingArguments.gradient_accumulation_steps should be 1, but got "
                f"{self.args.gradient_accumulation_steps}; set it to 1 (the wrapper's "
                "max_batch_draws bounds the window)."
            )
        if noise_scale is not None and adaptive:
            raise NotImplementedError(
                "GrabkitTrainer: noise_scale= measures Trainer's fixed accumulation windows; with "
                "accumulation= the windows are the wrapper's. Use the wrapper's statistics() (or "
                "NoiseScaleController) instead."
            )
        if noise_scale is not None and self.args.gradient_accumulation_steps < 2:
            raise ValueError(
                "GrabkitTrainer: noise_scale= compares microbatch gradients with their mean, so it "
                "needs TrainingArguments.gradient_accumulation_steps >= 2, but got "
                f"{self.args.gradient_accumulation_steps}."
            )

    def _scale_losses_by_share(self) -> None:
        """Make ``.grad`` the window's mean gradient, as the noise-scale identity needs.

        Counting examples: each microbatch's mean loss divided by the accumulation steps (Trainer
        does this when the model takes no loss kwargs; models that accept ``**kwargs`` but
        ignore ``num_items_in_batch``, such as BERT classifiers, would otherwise sum the
        microbatch means). Counting tokens: the model must divide its token sum by
        ``num_items_in_batch``, the window's tokens.
        """
        if self.count == "examples":
            self.model_accepts_loss_kwargs = False
        elif not self.model_accepts_loss_kwargs:
            raise ValueError(
                'GrabkitTrainer: noise_scale= with count="tokens" needs a model whose loss takes '
                "num_items_in_batch (the window's label tokens), but this model takes no loss "
                'kwargs; use count="examples", or a model/compute_loss_func that accepts it.'
            )

    def _hand_clipping_to_wrapper(self) -> None:
        """Trainer would clip every microbatch; the wrapper clips the averaged gradient instead."""
        self._wrapper_clip = self.args.max_grad_norm if self.args.max_grad_norm > 0 else None
        self.args.max_grad_norm = 0.0

    # -- GraB ------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        if self.grab_options is None:
            return super()._get_train_sampler(train_dataset)
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.grab_sampler is None:
            options = {"seed": self.args.seed, **self.grab_options}
            self.grab_sampler = GraBSampler(dataset, model=self.model, **options)
        if self._resume_folder is not None:
            path = os.path.join(self._resume_folder, SAMPLER_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"GrabkitTrainer: resuming from {self._resume_folder}, which has no "
                    f"{SAMPLER_FILE}; it was not saved by a GrabkitTrainer with grab=, so the GraB "
                    "order cannot be restored."
                )
            state = torch.load(path, weights_only=True)
            sampler = self.grab_sampler
            state = replay_state(state, sampler.num_samples)  # "ended" at an epoch's end
            sampler.load_state_dict(adopt_rank(state, sampler.num_replicas, sampler.rank))
            self._resume_folder = None
        return self.grab_sampler

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """``Trainer.train``; also restores grabkit's state from the checkpoint."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, str):
            if self.grab_options is not None and self.args.ignore_data_skip:
                raise ValueError(
                    "GrabkitTrainer: grab= resumes the interrupted epoch through Trainer's own "
                    "data skipping (the sampler replays the epoch's order, Trainer skips what "
                    "was trained), but TrainingArguments.ignore_data_skip=True would train those "
                    "examples twice; set ignore_data_skip=False."
                )
            self._resume_folder = folder if self.grab_options is not None else None
            noise_path = os.path.join(folder, NOISE_FILE)
            if self.noise_scale is not None and os.path.isfile(noise_path):
                self.noise_scale.load_state_dict(torch.load(noise_path, weights_only=True))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    # -- adaptive accumulation -------------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.accumulation is not None and not isinstance(optimizer, AdaptiveAccumulationWrapper):
            wrapper = self.accumulation(optimizer)
            if not isinstance(wrapper, AdaptiveAccumulationWrapper):
                raise TypeError(
                    "GrabkitTrainer: accumulation= should return an AdaptiveAccumulationWrapper "
                    f"(e.g. OptimizerWrapperGNTS(optimizer)), but returned {type(wrapper).__name__}"
                )
            self.optimizer = wrapper
        if isinstance(self.optimizer, AdaptiveAccumulationWrapper):
            self._configure_wrapper(self.optimizer)
        return self.optimizer

    def _configure_wrapper(self, wrapper: AdaptiveAccumulationWrapper) -> None:
        clip = self._wrapper_clip
        if clip is not None:
            if wrapper.clip_grad_norm not in (None, clip):
                raise ValueError(
                    f"GrabkitTrainer: TrainingArguments.max_grad_norm={clip} and the wrapper's "
                    f"clip_grad_norm={wrapper.clip_grad_norm} disagree; set one of them (use "
                    "max_grad_norm=0 to keep the wrapper's)."
                )
            wrapper.clip_grad_norm = clip

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        wrapper = self._adaptive_wrapper()
        if wrapper is not None and not isinstance(scheduler, RealUpdateSchedule):
            self.lr_scheduler = RealUpdateSchedule(scheduler, wrapper)
        return self.lr_scheduler

    def _adaptive_wrapper(self) -> AdaptiveAccumulationWrapper | None:
        optimizer = self.optimizer
        while optimizer is not None and not isinstance(optimizer, AdaptiveAccumulationWrapper):
            optimizer = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        return optimizer

    # -- every microbatch ------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        wrapper = self._adaptive_wrapper()
        shifted = bool(getattr(self, "_loss_shifts_labels", False))  # as num_items_in_batch
        count = microbatch_count(inputs, self.count, shifted)
        if wrapper is not None:
            wrapper.default_count = count  # the weight of the step() Trainer calls next
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.grab_sampler is not None:
            self.grab_sampler.step()  # this microbatch's examples, with their own gradients
        if self.noise_scale is not None:
            self.noise_scale.end_microbatch(count)
            if self.accelerator.sync_gradients:  # the window's last microbatch: before clipping
                self.noise_scale_result = self.noise_scale.end_step()
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        wrapper = self._adaptive_wrapper()
        if wrapper is not None:
            logs["grabkit/optimizer_updates"] = wrapper.num_steps
        if self.noise_scale_result is not None and "loss" in logs:
            values = self.noise_scale_result.as_dict()
            logs.update({f"noise_scale/{k}": v for k, v in values.items()})
        super().log(logs, start_time)
