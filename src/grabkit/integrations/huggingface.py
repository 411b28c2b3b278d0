"""Hugging Face ``Trainer`` with GraB ordering, adaptive accumulation, noise-scale logging and
length grouping.

One subclass, each capability one keyword (``pip install grabkit[huggingface]``)::

    trainer = GrabkitTrainer(model, args, train_dataset=ds, grab={"balance_type": "mean"})
    trainer = GrabkitTrainer(model, args, train_dataset=ds,
                             accumulation=lambda opt: OptimizerWrapperGNTS(opt, norm_threshold=0.5))
    trainer = GrabkitTrainer(model, args, train_dataset=ds, noise_scale={"update_rate": 0.05})
    trainer = GrabkitTrainer(model, args, train_dataset=ds, grouping=True)

What it wires, and why plain callbacks cannot:

* ``grab``: the ``GraBSampler`` (hook mode on the model) is the train sampler
  (``_get_train_sampler``); ``sampler.step()`` runs after *every* microbatch's backward
  (``training_step``), so each example is balanced with its own gradient under gradient
  accumulation. Its state is written into every checkpoint (``grabkit_sampler.pt``) and, on
  ``train(resume_from_checkpoint=...)``, restored so that Trainer's own data skipping replays the
  interrupted epoch's order, and a checkpoint at an epoch's last step resumes with the next epoch
  (``grabkit.integrations.resume``): the resumed run equals the uninterrupted one. Under several
  processes (``torchrun``, ``accelerate launch``) the sampler needs ``"statistics": "sketch"``:
  it splits every epoch across the ranks itself (accelerate is told to keep that split,
  ``shard_by_sampler``) and the ranks gather (B, k) sketches, deciding as one process would.
  ``train_sampling_strategy="group_by_length"`` would replace GraB's order and is refused.
* ``accumulation``: a factory ``optimizer -> AdaptiveAccumulationWrapper`` (any GQC wrapper).
  Each Trainer step is one microbatch (``gradient_accumulation_steps`` must be 1: the wrapper
  decides the window); ``max_grad_norm`` moves from Trainer (which would clip every microbatch
  before the wrapper sees it) to the wrapper (which clips the averaged gradient); the microbatch's
  ``count`` reaches the wrapper; the window still open at the last microbatch is applied there
  (``flush``), before the LR schedule takes its last step. The LR schedule is counted as Trainer
  counts it, in microbatches (``max_steps``): each real update uses the schedule's value at the
  microbatch where it happens, so warm-up and decay follow the data consumed and a linear
  schedule ends at 0. ``state.global_step`` counts microbatches; the real updates are logged as
  ``grabkit/optimizer_updates``.
* ``noise_scale``: the gradient noise scale of Trainer's accumulation windows, closed after each
  window's last backward, *before* Trainer clips, logged as ``noise_scale/*``. Trainer's loss
  scaling is left as it is (measuring never changes training; under ``fp16`` its GradScaler's
  scale is divided out of each microbatch's norms); the microbatches are weighted as
  Trainer weights them, so the estimate is per label token for models whose loss Trainer
  normalizes by ``num_items_in_batch`` (causal LMs) and per example otherwise
  (``grabkit.integrations.trainer_noise``); a model that Trainer takes to normalize so but
  that returns its own mean (``BertForSequenceClassification``) is seen to on the first
  microbatch, and weighted as Trainer then weights it, by equal shares. One process:
  ``gradient_accumulation_steps >= 2``; several: ``DDPNoiseScale`` on the DDP model.
* ``grouping``: each padded batch runs through the model's body one length group at a time
  (``GroupedForward``, planning options as a dict), with the padded run's loss and gradients.
* ``count``: the weight of a microbatch for the wrapper and the noise scale: ``"auto"`` (what
  Trainer's loss averages: label tokens when it normalizes by ``num_items_in_batch``, counted as
  Trainer counts them, else examples), ``"tokens"`` or ``"examples"``.

``ExampleGradientNormsCallback`` logs quantiles of the per-example gradient norms.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.integrations.accelerate import grab_sampler_of, shard_by_sampler
from grabkit.integrations.example_norms import DEFAULT_QUANTILES, ExampleGradientNorms
from grabkit.integrations.grouped_forward import GroupedForward, check_padded_labels
from grabkit.integrations.resume import replay_state
from grabkit.integrations.scaled_step import step_sampler
from grabkit.integrations.trainer_noise import TrainerNoiseScale
from grabkit.order import GraBSampler

__all__ = ["ExampleGradientNormsCallback", "GrabkitTrainer", "microbatch_count"]

SAMPLER_FILE = "grabkit_sampler.pt"
NOISE_FILE = "grabkit_noise_scale.pt"
_COUNTS = ("auto", "examples", "tokens")


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


def _uses_group_by_length(args: Any) -> bool:
    strategy = getattr(args, "train_sampling_strategy", None)
    return strategy == "group_by_length" or bool(getattr(args, "group_by_length", False))


def _syncs_each_batch(args: Any) -> bool:
    """accelerate's ``sync_each_batch``: DDP all-reduces every microbatch of a window."""
    config = getattr(args, "accelerator_config", None)
    kwargs = getattr(config, "gradient_accumulation_kwargs", None) or {}
    return bool(kwargs.get("sync_each_batch", False))


def _epoch_over(state: Any) -> bool:
    """Trainer has trained its epoch's last batch: ``state.epoch`` (epoch + batches trained /
    batches in the epoch) is whole, and a resume starts the next epoch (``global_step // steps
    per epoch``), whether or not the loader dropped a partial last batch."""
    epoch = state.epoch
    return bool(epoch) and float(epoch).is_integer()


class _CheckpointFiles(TrainerCallback):
    """Write the sampler's and the estimator's state into each Trainer checkpoint folder."""

    def __init__(self, trainer: GrabkitTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:  # every rank's state is the same (collective steps)
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        sampler = self.trainer.grab_sampler
        if sampler is not None:
            # an epoch Trainer ended before the sampler's last example (dataloader_drop_last):
            # Trainer resumes with the next epoch, and so must the sampler
            ended = {"ended": True} if _epoch_over(state) else {}
            torch.save({**sampler.state_dict(), **ended}, os.path.join(folder, SAMPLER_FILE))
        if self.trainer.noise_scale is not None:
            torch.save(self.trainer.noise_scale.state_dict(), os.path.join(folder, NOISE_FILE))


class _FlushLastWindow(TrainerCallback):
    """Apply the adaptive wrapper's open window at the last microbatch (before the scheduler's
    last step), or at train end when training stopped early (before the best checkpoint is
    loaded, with ``load_best_model_at_end``: ``GrabkitTrainer._load_best_model``)."""

    def __init__(self, trainer: GrabkitTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 >= state.max_steps:
            self._flush()

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()

    def _flush(self) -> None:
        wrapper = self.trainer._adaptive_wrapper()
        if wrapper is not None:
            wrapper.flush()


class ExampleGradientNormsCallback(TrainerCallback):
    """Log quantiles of the per-example gradient norms |g_i| of the steps since the last log.

    Logged as ``grad_norm_per_example/{min,q10,median,q90,max,mean,count}``: the norms of the
    examples' gradients as Trainer backpropagates them (its division by the accumulation steps or
    by the window's label tokens included; ``grabkit.integrations.example_norms``);
    ``callback.norms.take()`` gives the raw values instead. With a ``GrabkitTrainer`` every reporter
    receives them; with a plain ``Trainer`` they reach ``state.log_history`` and the callbacks
    after this one (Trainer runs its reporters first). Under several processes each rank measures
    its own examples and rank 0's are reported. A GraB sampler's statistics on the model are
    shared (one set of hooks; a sketching sampler's give estimated norms). Under ``fp16=True``
    the GradScaler's scale is divided out of each backward's norms, which needs a
    ``GrabkitTrainer`` (it hands the callback the scaler after each backward; a plain ``Trainer``
    exposes no scaler to callbacks, so there it raises rather than log scaled norms).

    Args:
        quantiles: in [0, 1]; loss_reduction: how each microbatch's loss reduces its examples
            (None: a shared sampler's statistics' own, else "mean").
    """

    def __init__(
        self, quantiles: Sequence[float] = DEFAULT_QUANTILES, loss_reduction: str | None = None
    ) -> None:
        self.quantiles, self.loss_reduction = tuple(quantiles), loss_reduction
        self.norms: ExampleGradientNorms | None = None
        self.scaler_handed = False  # a GrabkitTrainer hands the GradScaler after each backward
        ExampleGradientNorms.check_quantiles(self.quantiles)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if getattr(args, "fp16", False) and not self.scaler_handed:
            raise ValueError(
                "ExampleGradientNormsCallback under fp16=True: Trainer multiplies each loss by "
                "its GradScaler's scale, which changes during training, and a plain Trainer "
                "gives callbacks no access to it, so the logged norms would be scaled. Use "
                "grabkit.integrations.huggingface.GrabkitTrainer (it divides the scale out), "
                "or bf16=True."
            )
        if self.norms is None:
            sampler = grab_sampler_of(train_dataloader)
            stats = None if sampler is None else sampler.stats
            self.norms = ExampleGradientNorms(model, stats, self.loss_reduction, self.quantiles)

    def after_backward(self, grad_scaler: Any) -> None:
        """Keep this backward's norms now, before the optimizer step updates ``grad_scaler``
        (Trainer's fp16 GradScaler, or None), whose scale is divided out."""
        if self.norms is not None:
            self.norms.grad_scaler = grad_scaler
            self.norms.capture()

    def summary(self) -> dict[str, float]:
        return {} if self.norms is None else self.norms.summary()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logged = logs is None or any(k.startswith("grad_norm_per_example/") for k in logs)
        if not logged and "loss" in logs:  # a plain Trainer: not merged by GrabkitTrainer.log
            summary = self.summary()
            logs.update(summary)
            if state.log_history:
                state.log_history[-1].update(summary)

    def on_train_end(self, args, state, control, **kwargs):
        if self.norms is not None:
            self.norms.close()
            self.norms = None


class GrabkitTrainer(Trainer):
    """``transformers.Trainer`` with grabkit's capabilities as keywords (see the module doc).

    Args (beyond ``Trainer``'s):
        grab: ``GraBSampler`` keywords (``{}`` for vanilla GraB; several processes:
            ``{"statistics": "sketch"}``); ``seed`` defaults to ``args.seed``. The sampler is
            ``trainer.grab_sampler`` once training starts.
        accumulation: ``optimizer -> AdaptiveAccumulationWrapper`` (e.g. a GQC wrapper class
            with its options bound); or pass the wrapper itself in ``optimizers=(wrapper, None)``.
        noise_scale: ``AccumulationNoiseScale`` keywords (``{}`` for the defaults); the last
            result is ``trainer.noise_scale_result``.
        grouping: True, or ``plan_groups`` options: run each batch's body by length groups.
        count: ``"auto"``, ``"examples"`` or ``"tokens"``: the weight of a microbatch for the
            wrapper and the noise scale.
    """

    def __init__(
        self,
        *args: Any,
        grab: Mapping[str, Any] | None = None,
        accumulation: Callable[[torch.optim.Optimizer], AdaptiveAccumulationWrapper] | None = None,
        noise_scale: Mapping[str, Any] | None = None,
        grouping: bool | Mapping[str, Any] | None = None,
        count: str = "auto",
        **kwargs: Any,
    ) -> None:
        if count not in _COUNTS:
            raise ValueError(f"`count` should be one of {_COUNTS}, but got count={count!r}")
        super().__init__(*args, **kwargs)
        self.grab_options = None if grab is None else dict(grab)
        self.grouping_options = (
            None if grouping in (None, False) else ({} if grouping is True else dict(grouping))
        )
        self.accumulation = accumulation
        self.count = count
        self.grab_sampler: GraBSampler | None = None
        self.noise_scale: TrainerNoiseScale | None = None
        self.grouped_forward: GroupedForward | None = None  # while (and after) training
        self._resume_folder: str | None = None
        self._wrapper_clip: float | None = None  # max_grad_norm, moved to the wrapper
        self._items_followed: bool | None = None  # the loss follows num_items_in_batch
        # while train() runs: grabkit's states when Trainer's training loop first started
        # (auto_find_batch_size starts it again after an out-of-memory error)
        self._loop_start: dict[str, Any] | None = None
        self._check_combination(noise_scale)
        if self.grouping_options is not None:
            GroupedForward(self.model, **self.grouping_options)  # options checked now
        if noise_scale is not None:
            self.noise_scale = TrainerNoiseScale(self.model, noise_scale, self.args.world_size)
        if self._adaptive():
            self._hand_clipping_to_wrapper()
        self.add_callback(_CheckpointFiles(self))
        self.add_callback(_FlushLastWindow(self))

    @property
    def noise_scale_result(self):
        """The noise-scale estimate so far (None before the first measured window)."""
        return None if self.noise_scale is None else self.noise_scale.result

    # -- configuration checks ------------------------------------------------------------------
    def _adaptive(self) -> bool:
        return self.accumulation is not None or isinstance(
            self.optimizer, AdaptiveAccumulationWrapper
        )

    def _check_combination(self, noise_scale: Mapping[str, Any] | None) -> None:
        self._check_grab()
        accumulation_steps = self.args.gradient_accumulation_steps
        if self._adaptive() and accumulation_steps != 1:
            raise ValueError(
                "GrabkitTrainer: an adaptive accumulation wrapper decides when to step, so "
                "TrainingArguments.gradient_accumulation_steps should be 1, but got "
                f"{accumulation_steps}; set it to 1 (the wrapper's max_batch_draws bounds the "
                "window)."
            )
        if noise_scale is not None and self._adaptive():
            raise NotImplementedError(
                "GrabkitTrainer: noise_scale= measures Trainer's fixed accumulation windows; with "
                "accumulation= the windows are the wrapper's. Use the wrapper's statistics() (or "
                "NoiseScaleController) instead."
            )
        several = self.args.world_size > 1 and accumulation_steps > 1
        if noise_scale is not None and several and _syncs_each_batch(self.args):
            raise ValueError(
                "GrabkitTrainer: noise_scale= on several processes reads each rank's own window "
                "gradient in DDP's all-reduce at the window's last microbatch, but "
                "accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': True}} "
                "all-reduces every microbatch, so no rank holds its own window gradient; leave "
                "sync_each_batch off with noise_scale=."
            )
        if noise_scale is not None and accumulation_steps < 2 and self.args.world_size == 1:
            raise ValueError(
                "GrabkitTrainer: noise_scale= on one process compares microbatch gradients with "
                "their mean, so it needs TrainingArguments.gradient_accumulation_steps >= 2, but "
                f"got {accumulation_steps}."
            )

    def _check_grab(self) -> None:
        if self.grab_options is None:
            return
        world = self.args.world_size
        if world > 1 and self.grab_options.get("statistics", "exact") != "sketch":
            raise ValueError(
                f"GrabkitTrainer: grab= with {world} processes decides from every rank's "
                "per-example gradients, which the ranks exchange as sketches; exact hook "
                'statistics stay on their rank. Pass grab={..., "statistics": "sketch"} '
                "(sketch_dim=1024 by default; see GraBSampler)."
            )
        if _uses_group_by_length(self.args):
            raise ValueError(
                "GrabkitTrainer: grab= orders the examples by their gradients, and "
                'train_sampling_strategy="group_by_length" would reorder them by length, '
                "silently dropping GraB's order. Use the default random sampling strategy with "
                "grab= (GraB's batches then keep their padding)."
            )
        if self.grouping_options is not None:
            raise NotImplementedError(
                "GrabkitTrainer: grab= reads per-example statistics from one call of each layer "
                "per backward, and grouping= calls the model once per length group; use one of "
                "them."
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
            self._restore_sampler(self._resume_folder)
            self._resume_folder = None
        return self.grab_sampler

    def _restore_sampler(self, folder: str) -> None:
        path = os.path.join(folder, SAMPLER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"GrabkitTrainer: resuming from {folder}, which has no {SAMPLER_FILE}; it was not "
                "saved by a GrabkitTrainer with grab=, so the GraB order cannot be restored."
            )
        sampler = self.grab_sampler
        state = replay_state(torch.load(path, weights_only=True), sampler.num_samples)
        sampler.load_state_dict(state)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.grab_sampler is not None:
            shard_by_sampler(loader)  # the sampler splits the epoch across ranks, not accelerate
        self._start_training_loop()
        return loader

    def _start_training_loop(self) -> None:
        """Trainer's training loop builds its loader first: keep grabkit's states as they are
        then, or, when the loop starts again within one ``train()``, restore them.

        ``auto_find_batch_size`` runs the loop again with half the batch size after an
        out-of-memory error, from the first batch of the (resumed) data: the GraB sampler's epoch
        must start again as well (else the retry's iter() would finish the epoch the failed
        attempt began and start another), and the noise scale must not keep the failed
        attempt's microbatches, whose gradients Trainer zeroed, nor the per-example norms be
        logged twice for the examples trained again. Neither must an adaptive wrapper
        that applied no update in the failed attempt (its window holds only such microbatches);
        one that did has moved the model, as Trainer's optimizer would have, and keeps its state.
        """
        if self._loop_start is None:  # outside train()
            return
        wrapper = self._adaptive_wrapper()
        owners = {"sampler": self.grab_sampler, "noise_scale": self.noise_scale, "wrapper": wrapper}
        owners = {name: owner for name, owner in owners.items() if owner is not None}
        if not self._loop_start.get("started"):  # the first start
            self._loop_start["started"] = True
            for name, owner in owners.items():
                self._keep_loop_start(name, owner)
            return
        if wrapper is not None and wrapper.num_steps != self._loop_start.get("updates"):
            owners.pop("wrapper")
        for callback in self.callback_handler.callbacks:  # norms the retry measures again
            if isinstance(callback, ExampleGradientNormsCallback) and callback.norms is not None:
                callback.norms.take()
        for name, owner in owners.items():
            if self._loop_start.get(name):  # {}: a DDP noise scale not built yet, nothing to undo
                owner.load_state_dict(copy.deepcopy(self._loop_start[name]))

    def _keep_loop_start(self, name: str, owner: Any) -> None:
        """Keep ``owner``'s state as the training loop's first start found it (the wrapper's
        when Trainer creates it, after the loader)."""
        if self._loop_start is None or name in self._loop_start:
            return
        self._loop_start[name] = copy.deepcopy(owner.state_dict())
        if name == "wrapper":
            self._loop_start["updates"] = owner.num_steps

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
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ExampleGradientNormsCallback):
                callback.scaler_handed = True  # training_step: after_backward(scaler)
        if self.grouping_options is not None:
            if any(
                isinstance(c, ExampleGradientNormsCallback) for c in self.callback_handler.callbacks
            ):
                raise NotImplementedError(
                    "GrabkitTrainer: grouping= calls the model once per length group, and "
                    "ExampleGradientNormsCallback reads per-example statistics from one call of "
                    "each layer per backward; use one of them."
                )
            self.grouped_forward = GroupedForward(self.model, **self.grouping_options).attach()
        self._loop_start = {}
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self._loop_start = None
            if self.grouped_forward is not None:
                self.grouped_forward.detach()

    # -- adaptive accumulation -------------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        # Trainer keeps its optimizer when its training loop starts again (auto_find_batch_size):
        # then accelerate's AcceleratedOptimizer around the wrapper, which must not be wrapped twice
        if self.accumulation is not None and self._adaptive_wrapper() is None:
            wrapper = self.accumulation(optimizer)
            if not isinstance(wrapper, AdaptiveAccumulationWrapper):
                raise TypeError(
                    "GrabkitTrainer: accumulation= should return an AdaptiveAccumulationWrapper "
                    f"(e.g. OptimizerWrapperGNTS(optimizer)), but returned {type(wrapper).__name__}"
                )
            self.optimizer = wrapper
        wrapper = self._adaptive_wrapper()
        if wrapper is not None:
            self._configure_wrapper(wrapper)
            self._keep_loop_start("wrapper", wrapper)
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

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        wrapper = self._adaptive_wrapper()
        if checkpoint is not None and wrapper is not None and wrapper.continues_a_flush:
            wrapper.continues_a_flush = False  # said here, in Trainer's terms
            warnings.warn(
                f"GrabkitTrainer: the run that saved {checkpoint} ended there and applied its "
                "open accumulation window early (its last microbatches, as its final model "
                "needs); continuing from it is not the uninterrupted run, which would have "
                "accumulated on, but has that one update more. For an exact continuation, "
                "resume from a checkpoint saved before the run's last step.",
                UserWarning,
                stacklevel=2,
            )

    def _load_best_model(self) -> None:
        """Apply the open window first (training stopped inside it): Trainer loads the best
        checkpoint before its train-end callbacks, where the window would land on it."""
        wrapper = self._adaptive_wrapper()
        if wrapper is not None:
            wrapper.flush()
        super()._load_best_model()

    def _adaptive_wrapper(self) -> AdaptiveAccumulationWrapper | None:
        optimizer = self.optimizer
        while optimizer is not None and not isinstance(optimizer, AdaptiveAccumulationWrapper):
            optimizer = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        return optimizer

    # -- every microbatch ------------------------------------------------------------------------
    def _weighting(self, num_items_in_batch: Any) -> str:
        """How Trainer weights this microbatch in its window, as its ``training_step`` decides:
        ``"items"`` (its loss over the window's ``num_items_in_batch``) or ``"steps"`` (its mean
        loss over the window's microbatches)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        return "items" if scaled else "steps"

    def _microbatch_count(self, inputs: Mapping[str, Any], weighting: str) -> float:
        shifted = bool(getattr(self, "_loss_shifts_labels", False))  # as num_items_in_batch
        unit = self.count
        if unit == "auto":
            unit = "tokens" if weighting == "items" and "labels" in inputs else "examples"
        count = microbatch_count(inputs, unit, shifted)
        if self.noise_scale is not None and weighting == "items" and unit == "examples":
            tokens = microbatch_count(inputs, "tokens", shifted)
            if tokens != count:
                raise ValueError(
                    "GrabkitTrainer: Trainer averages this model's loss over the window's "
                    f"label tokens (num_items_in_batch), so a microbatch's share of the gradient "
                    f"is its {tokens:g} tokens, not its {count:g} examples, and noise_scale= "
                    'with count="examples" would misweight it. Use count="auto" or "tokens" (the '
                    "estimate is then per token)."
                )
        return count

    def compute_loss(self, model, inputs, *args: Any, **kwargs: Any):
        if self.grouping_options is not None:
            check_padded_labels(inputs.get("labels"), inputs.get("attention_mask"))
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _loss_follows_items(self, model, inputs, num_items_in_batch) -> bool | None:
        """Whether the model's loss is normalized by ``num_items_in_batch``, as Trainer assumes.

        Trainer decides from the forward's signature (``**kwargs``) that the model divides its
        loss by the window's labels, and then does not divide it by the accumulation steps. A
        model that computes its own microbatch mean anyway (``BertForSequenceClassification``)
        is trained on the sum of its microbatch means: equal shares, whatever their sizes. Two
        forwards without gradients, with ``num_items_in_batch`` and twice it, from one random
        state (dropout alike), the random state and the model's buffers (a BatchNorm's running
        statistics) restored after, so training is unchanged: a loss that follows them halves.
        None: a zero loss, nothing to compare.
        """
        device = next(model.parameters()).device
        devices = [device] if device.type == "cuda" else []
        buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
        losses = []
        try:
            for items in (num_items_in_batch, num_items_in_batch * 2):
                with (
                    torch.random.fork_rng(devices=devices),
                    torch.no_grad(),
                    self.compute_loss_context_manager(),
                ):
                    loss = self.compute_loss(model, inputs, num_items_in_batch=items)
                losses.append(float(loss.detach().float().mean()))
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        if losses[0] == 0.0:
            return None
        return abs(losses[0] - 2.0 * losses[1]) <= 1e-3 * abs(losses[0])

    def training_step(self, model, inputs, num_items_in_batch=None):
        weighting = self._weighting(num_items_in_batch)
        if self.noise_scale is not None and weighting == "items" and self._items_followed is None:
            self._items_followed = self._loss_follows_items(model, inputs, num_items_in_batch)
        if self._items_followed is False:
            weighting = "steps"  # Trainer sums the model's own means: equal shares
        count = self._microbatch_count(inputs, weighting)
        wrapper = self._adaptive_wrapper()
        if count <= 0 and (wrapper is not None or self.noise_scale is not None):
            raise ValueError(
                "GrabkitTrainer: a microbatch has no label tokens to weigh it by (every label "
                "is -100): accumulation= and noise_scale= weigh each microbatch by its label "
                "tokens and cannot take one of weight 0. Drop examples without trained labels "
                "from the training set."
            )
        if wrapper is not None:
            wrapper.default_count = count  # the weight of the step() Trainer calls next
        if self.noise_scale is not None:  # several processes: DDP's hook must see this backward
            self.noise_scale.attach(model)
        loss = super().training_step(model, inputs, num_items_in_batch)
        scaler = getattr(self.accelerator, "scaler", None)  # fp16: the scale divided out
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ExampleGradientNormsCallback):
                callback.after_backward(scaler)
        if self.grab_sampler is not None:
            # this microbatch's examples, with their own gradients (fp16: the scale divided out)
            step_sampler(self.grab_sampler, scaler)
        if self.noise_scale is not None:
            items = None if num_items_in_batch is None else float(num_items_in_batch)
            last = self.accelerator.sync_gradients  # the window's last microbatch: before clipping
            self.noise_scale.microbatch(model, count, weighting, items, last, scaler)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        wrapper = self._adaptive_wrapper()
        if wrapper is not None:
            logs["grabkit/optimizer_updates"] = wrapper.num_steps
        if "loss" in logs:
            result = self.noise_scale_result
            if result is not None:
                logs.update({f"noise_scale/{k}": v for k, v in result.as_dict().items()})
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ExampleGradientNormsCallback):
                    logs.update(callback.summary())
        super().log(logs, start_time)
