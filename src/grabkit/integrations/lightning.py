"""Lightning ``Callback``s: GraB ordering, adaptive accumulation and noise-scale logging.

``pip install grabkit[lightning]``; each capability is one callback::

    sampler = GraBSampler(dataset, model=model)           # hook mode on the LightningModule
    loader = DataLoader(dataset, sampler=sampler, batch_size=16)
    trainer = L.Trainer(callbacks=[GraBCallback(sampler)])

* ``GraBCallback``: ``sampler.step()`` after every backward (each microbatch under
  ``accumulate_grad_batches``); its state goes into Lightning's checkpoint through
  ``Callback.state_dict``, taken with the prefetched batches handed back, so a mid-epoch resume
  (``trainer.fit(..., ckpt_path=...)``) trains exactly the rest of the epoch in GraB's order.
  Under DDP (``strategy="ddp"`` / ``"ddp_spawn"``) build the sampler with
  ``statistics="sketch"`` in ``setup()``, pass ``Trainer(use_distributed_sampler=False)`` and
  ``GraBCallback()`` (see the class); any other sampler, or Lightning's
  ``DistributedSamplerWrapper`` around it, raises at fit start.
* ``AdaptiveAccumulationCallback``: for a LightningModule whose ``configure_optimizers`` returns
  an ``AdaptiveAccumulationWrapper`` (a GQC wrapper). It passes each batch's ``count`` to the
  wrapper, moves ``gradient_clip_val`` from Lightning (which would clip every microbatch) to the
  wrapper (which clips the averaged gradient), lets step-interval LR schedulers advance only
  on real updates, and applies the window still open at train end. Keep
  ``accumulate_grad_batches=1``: the wrapper decides the window. Under DDP every rank decides
  as one process on the global microbatch; the ranks must count the same weight per microbatch
  (the wrapper raises where they do not).
* ``NoiseScaleCallback``: the gradient noise scale of Lightning's optimizer steps, closed
  before Lightning unscales ("16-mixed") and clips, and logged with ``pl_module.log`` as
  ``noise_scale/*``: one process, ``AccumulationNoiseScale`` over the
  ``accumulate_grad_batches`` windows (a window that is not its examples' mean left out);
  under DDP (``strategy="ddp"`` / ``"ddp_spawn"``), ``DDPNoiseScale``, each rank's local
  window gradient against the all-reduced one.
* ``GroupingCallback``: the transformers models of the LightningModule run each right-padded
  batch by length groups (``GroupedForward``), with the padded run's loss and gradients.
* ``ExampleGradientNormsCallback``: quantiles (and a TensorBoard histogram) of the per-example
  gradient norms of every optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DistributedSampler

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.integrations.example_norms import DEFAULT_QUANTILES, ExampleGradientNorms
from grabkit.integrations.grouped_forward import GroupedForward
from grabkit.integrations.resume import rewound_state
from grabkit.integrations.scaled_step import step_sampler
from grabkit.integrations.schedule import RealUpdateSchedule
from grabkit.integrations.trainer_noise import TrainerNoiseScale
from grabkit.noise.accumulation import AccumulationNoiseScale
from grabkit.order import GraBBatchSampler, GraBSampler

__all__ = [
    "AdaptiveAccumulationCallback",
    "ExampleGradientNormsCallback",
    "GraBCallback",
    "GroupingCallback",
    "NoiseScaleCallback",
    "batch_count",
]


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


def _as_grab_sampler(sampler: Any) -> GraBSampler:
    if isinstance(sampler, GraBBatchSampler):
        sampler = sampler.sampler  # the state and the steps are its sampler's
    if not isinstance(sampler, GraBSampler):
        raise TypeError(f"GraBCallback needs a GraBSampler, but got {type(sampler).__name__}")
    return sampler


_BUILD_IN_SETUP = (
    "build it in the LightningModule's (or DataModule's) setup(), where the process group is up "
    'and GraBSampler takes num_replicas and rank from it, with statistics="sketch" (hook '
    "statistics the ranks can exchange), and use GraBCallback() without a sampler"
)


def _topology_error(sampler: GraBSampler, trainer: Any) -> str | None:
    """Why ``sampler`` cannot serve this rank of the Trainer, or None."""
    world, rank = trainer.world_size, trainer.global_rank
    if sampler.num_replicas != world:
        return (
            f"GraBCallback: the Trainer runs {world} process(es) but the GraBSampler was built "
            f"with num_replicas={sampler.num_replicas} (statistics={sampler.statistics!r}), so the "
            "ranks would visit overlapping examples and credit gradients to the wrong ones; "
            + (_BUILD_IN_SETUP if world > 1 else "build it with num_replicas=1")
            + "."
        )
    if sampler.rank != rank:
        return (
            f"GraBCallback: this process is rank {rank} but its GraBSampler was built with "
            f"rank={sampler.rank}, so two ranks would visit the same examples; leave "
            f"num_replicas and rank to the process group: {_BUILD_IN_SETUP}."
        )
    return None


def _held_samplers(*owners: Any) -> list[GraBSampler]:
    """The distinct GraB samplers held as attributes of the LightningModule / DataModule."""
    found: list[GraBSampler] = []
    for owner in owners:
        for value in vars(owner).values() if owner is not None else ():
            if isinstance(value, (GraBSampler, GraBBatchSampler)):
                sampler = _as_grab_sampler(value)
                if not any(sampler is s for s in found):
                    found.append(sampler)
    return found


def _drawn_samplers(loader: Any) -> list[Any]:
    """The samplers a DataLoader draws its indices from: its ``sampler`` and its batch
    sampler's ``sampler`` (None where it has none)."""
    batches = getattr(loader, "batch_sampler", None)
    return [getattr(loader, "sampler", None), getattr(batches, "sampler", None)]


def _loader_error(loader: Any, sampler: GraBSampler, overfit_batches: float = 0) -> str | None:
    """Why the train DataLoader does not draw from ``sampler`` (with the fix), or None."""
    if isinstance(loader, (Mapping, list, tuple)):  # several loaders: a CombinedLoader
        return (
            f"GraBCallback: the Trainer trains on {len(loader)} loaders at once (a "
            "CombinedLoader); GraBCallback steps the GraBSampler after every backward with the "
            "examples of one batch of its loader, and a backward over batches of several "
            "loaders would credit their gradients to the sampler's examples. Train on the one "
            "loader that draws from the GraBSampler."
        )
    drawn = getattr(loader, "sampler", None)
    if any(s is sampler for s in _drawn_samplers(loader)):
        return None
    inner = getattr(getattr(drawn, "dataset", None), "_sampler", None)  # Lightning's wrapper
    if isinstance(drawn, DistributedSampler) and inner is sampler:
        return (
            f"GraBCallback: Lightning wrapped the GraBSampler in {type(drawn).__name__}, whose "
            "order no longer follows GraB and whose ranks would credit gradients to the wrong "
            "examples; pass Trainer(use_distributed_sampler=False): the GraBSampler already "
            "splits every epoch across the ranks."
        )
    if overfit_batches:
        return (
            f"GraBCallback: Trainer(overfit_batches={overfit_batches}) replaced the GraBSampler "
            f"of the train DataLoader with a {type(drawn).__name__} (it trains on a fixed set "
            "of batches in a fixed order, which GraB does not choose); overfit without "
            "GraBCallback, or train with GraB without overfit_batches."
        )
    if any(isinstance(s, (GraBSampler, GraBBatchSampler)) for s in _drawn_samplers(loader)):
        return (
            "GraBCallback: the train DataLoader draws from another GraBSampler than the one "
            "this callback steps (a train_dataloader() that builds a new one, called again at "
            "each reload_dataloaders_every_n_epochs?); the callback would credit gradients to "
            "the other sampler's examples. Build the sampler once (in setup()) and return a "
            "DataLoader over it from train_dataloader()."
        )
    return (
        "GraBCallback: the train DataLoader does not draw from this callback's GraBSampler (it "
        f"uses {type(drawn).__name__}); pass the same sampler to DataLoader(sampler=...) and to "
        "GraBCallback (or hold it on the LightningModule and use GraBCallback()); under several "
        "processes pass Trainer(use_distributed_sampler=False) so that Lightning keeps it."
    )


def _is_stateful(loader: Any) -> bool:
    """Whether Lightning saves and restores the loader's own position (torchdata's
    ``StatefulDataLoader``, or any loader with ``state_dict`` / ``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _lightning_epoch_over(trainer: Any) -> bool:
    """Lightning has trained its epoch's last batch, so its resume starts the next epoch.

    Its epoch is ``trainer.num_training_batches`` batches (after ``limit_train_batches`` and the
    loader's ``drop_last``), which may end before the sampler's last example; a checkpoint taken
    after that batch (``on_train_batch_end``, ``on_validation_end``, ``on_train_epoch_end``)
    resumes with the next epoch, whatever the sampler stepped.
    """
    if trainer is None:
        return False
    total = trainer.num_training_batches
    trained = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return total != float("inf") and trained >= total


def _loaders_of(loaders: Any) -> list[Any]:
    """The DataLoaders of a Trainer's loader attribute: one, a list / tuple, a mapping, or None."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _evaluation_error(stage: str, loaders: Any, samplers: list[GraBSampler]) -> str | None:
    """Why an evaluation loop (``stage``: validation, test, predict) must not run over
    ``loaders``, or None: one of them draws from a GraB sampler that trains.

    Its ``iter()`` would begin a new pass of the sampler: inside a training epoch (a
    ``val_check_interval`` validation) that pass ends the epoch's own, and the epoch's untrained
    rest is never trained; between epochs or fits it begins an epoch of the sampler that trains
    nothing and yields GraB's training order, not the dataset's, to the evaluation.
    """
    for loader in _loaders_of(loaders):
        if any(s is sampler for s in _drawn_samplers(loader) for sampler in samplers):
            return (
                f"GraBCallback: the {stage} DataLoader draws from the GraBSampler of training; "
                f"each {stage} pass would call its iter(), which ends the training epoch's pass "
                "under way (the rest of that epoch would never be trained) or begins an epoch "
                "of the sampler that trains nothing. Evaluate over a DataLoader of its own: "
                "DataLoader(dataset, batch_size=...), without the GraBSampler."
            )
    return None


def _renumbered_rest_error(trainer: Any, state: dict[str, Any]) -> str | None:
    """Why Lightning cannot continue the epoch that ``state`` (a loaded, unfinished sampler
    state) was saved inside, or None.

    A checkpoint saved at the end of a fit that ``max_steps`` (or ``should_stop``) ended inside
    an epoch (``ModelCheckpoint`` at the epoch's end, ``trainer.save_checkpoint`` after the fit)
    counts that epoch as processed. Continued with ``max_steps`` (iteration-based training),
    Lightning trains the epoch's rest but calls ``set_epoch`` with the processed count, one
    above the epoch's number, there and at every later epoch; the sampler then abandons the
    saved epoch's rest (a loop numbering the next epoch), and balances the batches Lightning
    trains as the epoch's rest as an epoch of their own. Told by the numbers themselves: the
    epoch Lightning continues (its processed count) is not the state's.
    """
    loop = trainer.fit_loop
    progress = loop.epoch_progress.current
    if state.get("ended") or not state.get("started") or not loop.restarting:
        return None
    epoch = int(state.get("epoch", progress.processed))
    if progress.processed == epoch or _lightning_epoch_over(trainer):
        return None
    trained = loop.epoch_loop.batch_progress.current.ready
    return (
        f"GraBCallback: this run continues, with max_steps, from a checkpoint saved at the end "
        f"of a fit that ended inside epoch {epoch} (max_steps reached, or "
        f"trainer.should_stop, after {trained} of its {trainer.num_training_batches} "
        "batches): Lightning trains the "
        f"epoch's rest but numbers it, and every later epoch, one above the uninterrupted run "
        f"(set_epoch({progress.processed})), and the GraBSampler would abandon the epoch's "
        "rest and balance those batches as a new epoch. Continue from a checkpoint saved "
        "after the batch (ModelCheckpoint(every_n_train_steps=...) at that step, which resumes "
        "exactly), or with max_steps=-1 and max_epochs (Lightning then starts the next epoch, "
        "and so does the sampler)."
    )


def _batch_past_the_epoch_error(trainer: Any, batch_idx: int) -> str | None:
    """Why Lightning must not train batch ``batch_idx``, or None: it lies past the epoch's end.

    A fit continued with ``max_steps`` from a checkpoint saved after an epoch's last batch (at
    the end of a fit that ``max_steps`` ended there: ``ModelCheckpoint`` at the epoch's end,
    ``trainer.save_checkpoint`` after the fit) makes Lightning continue that finished epoch: it
    restarts the loader and trains one batch more (checked with Lightning 2.6, a plain
    ``DataLoader`` too), which the uninterrupted run never trains. The GraBSampler, whose state
    says the epoch is over, would hand it the next epoch's first examples.
    """
    total = trainer.num_training_batches
    if total == float("inf") or batch_idx < total:
        return None
    return (
        f"GraBCallback: Lightning is training batch {batch_idx} of an epoch of {int(total)} "
        "batches, past the epoch's end: this run continues, with max_steps, from a checkpoint "
        "saved after an epoch's last batch at the end of a fit (max_steps reached there; "
        "ModelCheckpoint at the epoch's end, or trainer.save_checkpoint after the fit), and "
        "Lightning trains one batch more of that finished epoch, which the uninterrupted run "
        "never trains (a plain DataLoader would repeat its first batch; the GraBSampler would "
        "give the next epoch's first examples). Continue with max_steps=-1 and max_epochs "
        "(Lightning then starts the next epoch, and so does the sampler), or from a checkpoint "
        "saved after the batch (ModelCheckpoint(every_n_train_steps=...)), which resumes exactly."
    )


class GraBCallback(Callback):
    """Step a hook-mode ``GraBSampler`` after every backward; its state in the checkpoint.

    One process: pass the sampler of the train ``DataLoader`` (built with ``model=`` the
    LightningModule or its network). Several processes (``strategy="ddp"`` / ``"ddp_spawn"``):
    build the sampler with ``statistics="sketch"`` in the LightningModule's (or DataModule's)
    ``setup()``, where the process group is up (it takes ``num_replicas`` and ``rank`` from it),
    hold it as an attribute, return a ``DataLoader`` over it from ``train_dataloader()``, pass
    ``Trainer(use_distributed_sampler=False)`` and ``GraBCallback()``: at fit start the callback
    finds the one ``GraBSampler`` the module (or DataModule) holds. Every rank then steps its
    local batch after every backward (hooks on the network inside DDP), the ranks all-gather
    their sketches and decide as one process on the global batch (``grabkit.order.distributed``).

    Raised at fit start (on every rank): a sampler whose ``num_replicas`` / ``rank`` are not the
    Trainer's (exact hook statistics cannot be gathered, so an exact-mode sampler is a
    one-process sampler), no sampler or several, and at train start a loader that does not draw
    from it (Lightning's ``DistributedSamplerWrapper`` included), and again at each epoch's
    start (``reload_dataloaders_every_n_epochs`` builds a new loader); at the start of a validation
    (sanity check included), test or predict loop, a loader of it that draws from the sampler
    (its ``iter()`` would end the training epoch's pass, or begin an epoch that trains nothing).

    Checkpoints. The state is taken with the prefetched batches handed back (yielded :=
    stepped), at an optimizer step; a state saved after an epoch's last step is marked as ended
    and resumes with the next epoch, as Lightning does (``grabkit.integrations.resume``), and so
    is one saved after the last batch of an epoch that Lightning ends before the sampler's last
    example (``limit_train_batches``, a ``DataLoader(drop_last=True)`` whose last batch is
    partial): the rest of that epoch is never trained, as in the uninterrupted run. So is one
    saved at the end of an epoch that Lightning ended early (``should_stop`` from
    ``EarlyStopping`` or ``Timer(max_time)``, ``-1`` from ``on_train_batch_start``): Lightning
    resumes it with the next epoch whole, and so does the sampler (decided at train start from
    ``fit_loop.restarting``; iteration-based training, ``max_steps``, continues the epoch: from
    the checkpoint saved at the end of such a fit Lightning numbers the epoch's rest one above
    its number, and the callback raises at train start; when that fit ended at the epoch's last
    batch, Lightning trains one batch past the epoch, and the callback raises at that batch).
    A checkpoint saved inside an accumulation window (``ModelCheckpoint`` at a validation
    whose ``val_check_interval`` is not a multiple of ``accumulate_grad_batches``, or
    ``trainer.save_checkpoint`` from a batch hook) holds no accumulated gradient: Lightning
    steps on the window's remaining microbatches, so the resumed run differs from the
    uninterrupted one (the order resumes exactly); the callback warns.
    Lightning writes the callback state
    of rank 0 only, and every rank loads it: under several processes that state is every rank's,
    since each ``step()`` is a collective that checks that all ranks stepped the same number of
    local examples, and the sketches are gathered, so the ordering state, order and position
    counters are the same on every rank; only the ``rank`` recorded in its configuration
    differs, and each rank loads it as its own.

    Args:
        sampler: the ``GraBSampler`` (or ``GraBBatchSampler``) of the train ``DataLoader``;
            None: the one the LightningModule or DataModule holds at fit start.
    """

    def __init__(self, sampler: GraBSampler | GraBBatchSampler | None = None) -> None:
        self.sampler = None if sampler is None else _as_grab_sampler(sampler)
        self._pending: dict[str, Any] | None = None  # a state loaded before the sampler exists
        self._trainer: Any = None  # whose epoch counter says when an epoch is over
        self._resumed_at_epoch_end = False  # the loaded state was saved after an epoch's end
        self._loaded: dict[str, Any] | None = None  # loaded for this fit, read at train start
        self._open = 0  # backwards since the last optimizer step (checkpointed)
        self._batch_backwards = 0  # backwards over the batch under way

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer
        sampler = self.sampler
        if stage == "fit" and sampler is not None and sampler.num_replicas != trainer.world_size:
            raise ValueError(_topology_error(sampler, trainer))  # the same on every rank

    def on_fit_start(self, trainer, pl_module) -> None:
        message = None
        if self.sampler is None:
            held = _held_samplers(pl_module, trainer.datamodule)
            if len(held) == 1:
                self.sampler = held[0]
            else:
                message = (
                    f"GraBCallback() found {len(held)} GraBSamplers held as attributes of the "
                    "LightningModule and DataModule at fit start; build exactly one in setup() "
                    "(self.sampler = GraBSampler(...)), or pass it: GraBCallback(sampler)."
                )
        if message is None:
            message = _topology_error(self.sampler, trainer)
        if not trainer.strategy.reduce_boolean_decision(message is None, all=True):
            raise ValueError(message or "GraBCallback: another rank's GraBSampler was refused.")
        if self._pending is not None:
            self._load(self._pending)

    def on_train_start(self, trainer, pl_module) -> None:
        loader = trainer.train_dataloader
        message = _loader_error(loader, self.sampler, trainer.overfit_batches)
        loaded, self._loaded = self._loaded, None
        if message is None and loaded is not None:
            message = _renumbered_rest_error(trainer, loaded)
        if message is None and loaded is not None and not trainer.fit_loop.restarting:
            self._end_epoch_of(loaded)  # Lightning begins the next epoch, and so must the sampler
        elif message is None and loaded is not None and self._open:
            _warn_resume_inside_window(
                "GraBCallback",
                self._open,
                "and differs from the uninterrupted run (the GraB order resumes exactly)",
            )
        self._open = 0
        if message is None and self._resumed_at_epoch_end and _is_stateful(loader):
            message = (
                f"GraBCallback: this run resumes from a checkpoint taken at an epoch's last step "
                f"with a {type(loader).__name__}, whose own snapshot Lightning restores after "
                f"the sampler's: it resumes inside the finished epoch, whose empty (or, cut by "
                f"limit_train_batches, untrained) rest Lightning counts as the next epoch, so "
                f"one epoch of training would be lost. Resume from a checkpoint inside an epoch, "
                f"or train with a plain DataLoader (GraBCallback restores the GraBSampler's "
                f"position itself, and Lightning resumes it exactly with the next epoch)."
            )
        if message is not None:
            raise ValueError(message)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # reload_dataloaders_every_n_epochs: Lightning built the epoch's loader again
        message = _loader_error(trainer.train_dataloader, self.sampler, trainer.overfit_batches)
        if message is not None:
            raise ValueError(message)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        message = _batch_past_the_epoch_error(trainer, batch_idx)
        if message is not None:
            raise ValueError(message)
        self._batch_backwards = 0

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._batch_backwards:  # manual optimization: a backward over the same examples
            raise ValueError(
                f"GraBCallback: training_step ran a second backward over batch "
                f"{trainer.fit_loop.epoch_loop.batch_idx} (manual optimization: one per "
                "optimizer, or a loss backpropagated twice). The callback steps the GraBSampler "
                "after every backward with the examples of the next batch it yielded, so the "
                "second backward's gradients would be credited to another batch's examples. "
                "Run one manual_backward per batch (sum the losses first), or step the sampler "
                "yourself in training_step (sampler.step() once per batch, after the backward "
                "whose gradients should order the examples) without GraBCallback."
            )
        self._batch_backwards += 1
        # this microbatch's examples, with their own gradients ("16-mixed": the scale divided out)
        step_sampler(self.sampler, _loss_scaler(trainer))
        self._open += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._open = 0

    def on_validation_start(self, trainer, pl_module) -> None:
        self._refuse_evaluation_over_the_sampler("validation", trainer.val_dataloaders, trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._refuse_evaluation_over_the_sampler("test", trainer.test_dataloaders, trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._refuse_evaluation_over_the_sampler("predict", trainer.predict_dataloaders, trainer)

    def _refuse_evaluation_over_the_sampler(self, stage: str, loaders: Any, trainer: Any) -> None:
        """Raise if an evaluation loader draws from the sampler this callback steps (or, before
        a fit found it, from one the LightningModule or DataModule holds)."""
        samplers = [self.sampler] if self.sampler is not None else []
        samplers = samplers or _held_samplers(trainer.lightning_module, trainer.datamodule)
        message = _evaluation_error(stage, loaders, samplers)
        if message is not None:
            raise ValueError(message)

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            self.sampler = self._sampler_held_by_the_fit()
        if self.sampler is None:
            return {}
        # Lightning prefetches a batch: hand the in-flight examples back to the sampler
        ended = _lightning_epoch_over(self._trainer)
        state = rewound_state(self.sampler.state_dict(), self.sampler.num_samples, ended=ended)
        return {"sampler": state, "open_microbatches": self._open}

    def _sampler_held_by_the_fit(self) -> GraBSampler | None:
        """The one ``GraBSampler`` the fit's LightningModule or DataModule holds, or None.

        A checkpoint can be saved before this callback's ``on_fit_start`` found the sampler:
        Lightning's ``Tuner`` saves one before its trial fits (``scale_batch_size``,
        ``lr_find``), which draw from the loader with the callbacks taken out, and restores it
        after them; the sampler's state must be in it, or the fit after the tuning would start
        where the trials left the sampler.
        """
        trainer = self._trainer
        if trainer is None:
            return None
        held = _held_samplers(trainer.lightning_module, trainer.datamodule)
        return held[0] if len(held) == 1 else None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "sampler" not in state_dict:
            return
        self._pending = state_dict
        if self.sampler is not None:
            self._load(state_dict)

    def _load(self, state_dict: dict[str, Any]) -> None:
        sampler = self.sampler
        state = rewound_state(state_dict["sampler"], sampler.num_samples)  # "ended" at epoch end
        sampler.load_state_dict(state)
        self._resumed_at_epoch_end = bool(state.get("ended"))
        self._pending = None
        self._loaded = state
        self._open = int(state_dict.get("open_microbatches", 0))

    def _end_epoch_of(self, state: dict[str, Any]) -> None:
        """The loaded ``state``'s epoch is over: Lightning resumes with the next epoch.

        A checkpoint taken at the end of an epoch that Lightning ended early (``should_stop``
        from ``EarlyStopping`` or ``Timer``, ``-1`` returned from ``on_train_batch_start``)
        holds a position inside the sampler's epoch; Lightning has finished that epoch (it ran
        its end) and starts the next one whole, as a plain ``DataLoader`` does. Read at train
        start, where ``fit_loop.restarting`` says whether Lightning continues inside the saved
        epoch (a checkpoint from inside it, or iteration-based training with ``max_steps``).
        """
        if state.get("ended") or not state.get("started"):
            return  # over already, or saved before its epoch began (the Tuner's): nothing to end
        sampler = self.sampler
        state = rewound_state(state, sampler.num_samples, ended=True)
        sampler.load_state_dict(state)


def _warn_resume_inside_window(callback: str, open_microbatches: int, consequence: str) -> None:
    """Warn that a resume starts inside an accumulation window: Lightning's checkpoint holds
    none of the window's gradient (``consequence``: what that costs the ``callback``)."""
    rank_zero_warn(
        f"{callback}: this checkpoint was saved inside an accumulation window, after "
        f"{open_microbatches} of its microbatches; Lightning's checkpoint does not hold their "
        f"accumulated gradient, so the resumed run steps on the window's remaining microbatches "
        f"only, {consequence}. For an exact resume, checkpoint at optimizer steps "
        "(ModelCheckpoint(every_n_train_steps=...); a checkpoint saved at validation needs a "
        "val_check_interval that is a multiple of accumulate_grad_batches)."
    )


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


def _refuse_unequal_counts(wrapper: AdaptiveAccumulationWrapper, trainer: Any) -> None:
    """Ranks that count different weights for a microbatch raise in the wrapper's ``step``.

    DDP averages the ranks' gradients with equal weights, each rank's the mean over its own
    ``count``; the wrapper weighs that average by the ranks' summed count. The two agree with
    the one-process microbatch (the mean over all ranks' examples or tokens) only when every
    rank counts the same, and a ``training_step`` loss is the rank's own mean. The wrapper
    compares the counts in the all-reduce it makes anyway, after the backward and before
    anything of the microbatch is folded or applied, and raises on every rank.
    """
    wrapper.set_unequal_counts(
        "raise",
        raised_by=f"AdaptiveAccumulationCallback under {type(trainer.strategy).__name__}",
        fix=(
            "or weigh microbatches as DDP does, equally: AdaptiveAccumulationCallback("
            "count_fn=...) with a function that returns 1.0 (defined at module level, so that "
            "ddp_spawn can pickle it)."
        ),
    )


class AdaptiveAccumulationCallback(Callback):
    """Wire an ``AdaptiveAccumulationWrapper`` optimizer into Lightning's automatic optimization.

    Each batch's ``count`` reaches the wrapper, Lightning's clipping moves to the wrapper,
    step-interval LR schedulers advance on real updates only (``RealUpdateSchedule``: warm-up and
    decay are counted in updates, a ``frequency`` of k in k real updates), and the window still
    open when training ends is applied (``flush``).

    Continuing a finished fit. ``ModelCheckpoint`` saves at the last epoch's end, before the
    fit's end applies the open window: a fit continued from that checkpoint (more epochs, or a
    larger ``max_steps``) equals the uninterrupted longer run. A checkpoint saved after the fit
    (``trainer.save_checkpoint``), or a second ``fit`` of the same module, holds that early
    update, so the continued run has it too and is not the uninterrupted one: the callback warns
    at train start (the wrapper's ``last_reason`` is ``"flushed"``).

    Under DDP (``strategy="ddp"`` / ``"ddp_spawn"``) the wrapper all-reduces what it decides on,
    so every rank takes the same decisions, and the run is the one-process run over the global
    microbatches (clipping, the flush and a checkpoint inside a window included), provided every
    rank counts the same weight for a microbatch: DDP averages the ranks' gradients with equal
    weights, so a rank counting more examples or tokens than another would be under-weighted.
    The callback sets the wrapper's ``unequal_counts`` to ``"raise"``: the counts are compared
    in the all-reduce the wrapper makes anyway (no collective of the callback's own), and
    differing counts raise ``ValueError`` on every rank in the wrapper's ``step``, after that
    microbatch's backward and before anything of it is folded or any update applied.

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
        scheduled = _schedules_accumulation(trainer)
        if trainer.accumulate_grad_batches != 1 or scheduled:
            raise ValueError(
                "AdaptiveAccumulationCallback: the wrapper decides when to step, so "
                "Trainer(accumulate_grad_batches=...) should be 1, but got "
                f"{trainer.accumulate_grad_batches}"
                + (" and a GradientAccumulationScheduler" if scheduled else "")
                + "; Lightning would divide every loss and step the wrapper once per window, "
                "hiding microbatches from it. Leave accumulation to the wrapper."
            )
        self.wrapper = wrapper = wrappers[0]
        _hand_clipping_to(wrapper, trainer)
        _refuse_unequal_counts(wrapper, trainer)
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, RealUpdateSchedule):
                # every `frequency` real updates: Lightning calls it after every microbatch
                frequency, config.frequency = config.frequency, 1
                config.scheduler = RealUpdateSchedule(config.scheduler, wrapper, frequency)

    def on_train_start(self, trainer, pl_module) -> None:
        """Warn when the fit continues from a wrapper whose last act was the train-end flush
        (its optimizer state is restored by now, after ``on_fit_start``)."""
        counters = self.wrapper.counters
        if counters.last_reason != "flushed":
            return
        self.wrapper.continues_a_flush = False  # said here, in Lightning's terms
        source = f"the checkpoint {trainer.ckpt_path}" if trainer.ckpt_path else "the last fit"
        rank_zero_warn(
            f"AdaptiveAccumulationCallback: {source} ended a fit whose end applied the open "
            f"accumulation window early (its last {counters.last_step_num_draws} microbatches, "
            "as that fit's final model needs); continuing from it is not the uninterrupted run, "
            "which would have accumulated on, but has that update in it. For an exact "
            "continuation, resume from the checkpoint ModelCheckpoint saved at the last epoch's "
            "end (before the fit's end applied the window) or from an earlier one."
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        count = self.count_fn(batch)
        try:
            self.wrapper.default_count = count  # the weight of this step() call
        except ValueError as error:  # ArgumentTypeError too: it is both
            raise type(error)(
                f"AdaptiveAccumulationCallback: count_fn(batch) gave {count!r} for batch "
                f"{batch_idx}: {error}. It should return this microbatch's weight (its examples "
                f"or tokens), a positive number"
            ) from None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("grabkit/optimizer_updates", float(self.wrapper.num_steps))

    def on_train_end(self, trainer, pl_module) -> None:
        self.wrapper.flush()  # the window still open when training ends: applied, not dropped


class NoiseScaleCallback(Callback):
    """Log the gradient noise scale of Lightning's optimizer steps.

    Each microbatch's loss must be its mean. Lightning divides it by ``accumulate_grad_batches``
    (A), so the accumulated gradient is the window's mean when the window holds A microbatches of
    equal size; a window that does not (the epoch's last, when its batches are not a multiple of
    A; a partial last batch) is left out of the estimate. Under ``precision="16-mixed"`` the
    GradScaler's scale is divided out of every measured norm (read before Lightning unscales the
    gradients and updates the scale), and a window that overflowed is skipped.

    * One process: ``AccumulationNoiseScale``, the window's microbatch gradients against their
      mean, closed after the window's last backward; needs ``accumulate_grad_batches >= 2``,
      or a ``GradientAccumulationScheduler`` (read window by window; windows of one batch are
      left out).
    * DDP (``strategy="ddp"`` / ``"ddp_spawn"``, any ``accumulate_grad_batches``):
      ``DDPNoiseScale``, each rank's local window gradient against the all-reduced one, read in
      DDP's communication hook (so DDP's hook slot must be free), counted in each rank's local
      examples; a window whose microbatches differ in size (its local gradient is then not the
      mean over its examples) is left out on every rank. The estimate logged at a step includes
      the steps before it (each step's few scalars are all-reduced while the next one trains);
      ``result`` after training includes the last. FSDP and DeepSpeed strategies raise.

    Measuring never changes training (the hook all-reduces as DDP's own does).

    Checkpoints. The estimator's state goes into Lightning's checkpoint; a resume from one saved
    at an optimizer step (``ModelCheckpoint(every_n_train_steps=...)``) continues the uninterrupted
    estimate exactly, provided Lightning resumes the data where it stopped (a plain
    ``DataLoader`` restarts the epoch's batches from its first one; torchdata's
    ``StatefulDataLoader`` resumes exactly). A checkpoint saved inside an accumulation window
    (``trainer.save_checkpoint`` from a batch hook, ``OnExceptionCheckpoint``, ``ModelCheckpoint``
    at a validation inside a window) does not hold the window's accumulated gradient, so the
    resumed run steps on the window's remaining microbatches only: that window is left out of
    the estimate (on every rank), with a warning. After an epoch Lightning ended early
    (``should_stop`` inside a window, the checkpoint saved at the epoch's end) Lightning starts
    the next epoch from a zero gradient instead: the saved window is dropped, nothing is left out.

    Args:
        count_fn: batch -> examples; default :func:`batch_count`.
        per_block: also log ``noise_scale/b_simple/<parameter>`` for every parameter tensor
            (one ``log`` entry each, which Lightning makes costly on small models).
        **options: ``AccumulationNoiseScale`` / ``DDPNoiseScale`` keywords (``update_rate``,
            ``window``, ...).
    """

    def __init__(
        self, count_fn: Any = batch_count, per_block: bool = False, **options: Any
    ) -> None:
        self.count_fn, self.per_block, self.options = count_fn, per_block, options
        self.estimator: AccumulationNoiseScale | None = None  # one process
        self.distributed: TrainerNoiseScale | None = None  # DDP
        self.result = None
        self._count = 0.0
        self._held: float | None = None  # DDP: the count of the last backward, not yet closed
        self._counts: list[float] = []  # one process: the counts of the window in progress
        self._pending_state: dict | None = None
        self._open = 0  # backwards of the window in progress (checkpointed)
        self._lost_window = False  # resumed inside a window whose gradient Lightning dropped

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.world_size > 1:
            if self.distributed is None:
                self.distributed = TrainerNoiseScale(pl_module, self.options, trainer.world_size)
            if self._pending_state is not None:
                self.distributed.load_state_dict(self._pending_state)
                self._pending_state = None
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "NoiseScaleCallback measures the accumulation windows of Lightning's automatic "
                "optimization (accumulate_grad_batches), which manual optimization "
                "(automatic_optimization=False) does not have. Measure in training_step with "
                "grabkit.noise.AccumulationNoiseScale(self): end_microbatch(count) after each "
                "manual_backward, end_step() before the optimizer step (and any clipping)."
            )
        if trainer.accumulate_grad_batches < 2 and not _schedules_accumulation(trainer):
            raise ValueError(
                "NoiseScaleCallback compares microbatch gradients with their mean, so in one "
                "process it needs Trainer(accumulate_grad_batches >= 2), but got "
                f"{trainer.accumulate_grad_batches}."
            )
        if self.estimator is None:
            self.estimator = AccumulationNoiseScale(pl_module, **self.options)
        if "grad_scaler" not in self.options:  # "16-mixed": the scale divided out
            self.estimator.grad_scaler = _loss_scaler(trainer)
        if self._pending_state is not None:
            self.estimator.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_start(self, trainer, pl_module) -> None:
        """A resume from inside a window loses it, unless Lightning begins a fresh epoch.

        A checkpoint taken inside an accumulation window holds none of its gradient. Lightning
        continues that window (``fit_loop.restarting``: a checkpoint from inside the epoch, or
        iteration-based training) on its remaining microbatches only, so the window is left
        out; after an epoch Lightning ended early (``should_stop`` inside a window, then
        ``ModelCheckpoint`` at the epoch's end) it starts the next epoch with a zero gradient
        instead: the saved window's microbatches are dropped and no window was cut.
        """
        if not self._lost_window:
            return
        if not trainer.fit_loop.restarting:
            self._lost_window, self._open = False, 0
            if self.estimator is not None:  # one process: the saved microbatches, never closed
                self.estimator.discard_step()
            return
        _warn_resume_inside_window(
            "NoiseScaleCallback",
            self._open,
            "and the window is left out of the noise-scale estimate",
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._count = self.count_fn(batch)
        if self.distributed is not None and self.distributed.estimator is None:
            self.distributed.attach(_ddp_model(trainer))  # before the first backward

    def on_after_backward(self, trainer, pl_module) -> None:
        self._open += 1
        if self.distributed is None:
            self.estimator.end_microbatch(self._count)
            self._counts.append(self._count)
            if not trainer.fit_loop.epoch_loop._should_accumulate():
                self._close_window(trainer)  # before Lightning unscales (16-mixed) and clips
            return
        if self._held is not None:  # the previous backward did not end a window
            model, scaler = trainer.strategy.model, _loss_scaler(trainer)
            self.distributed.microbatch(model, self._held, "steps", None, False, scaler)
        self._held = self._count

    def _close_window(self, trainer) -> None:
        """One process: measure the window whose last backward just ran, or leave it out."""
        counts, self._counts = self._counts, []
        if self._lost_window:
            self._discard_window()
        elif _is_mean_window(counts, trainer.accumulate_grad_batches):
            self.result = self.estimator.end_step()
        else:
            self.estimator.discard_step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        open_microbatches, self._open = self._open, 0
        if self.distributed is None:
            if self._counts:
                raise RuntimeError(
                    "NoiseScaleCallback: Lightning stepped the optimizer after a backward it was "
                    "expected to accumulate, so the window was not measured; this Lightning "
                    "version decides accumulation differently: report it."
                )
        elif self._lost_window or open_microbatches < trainer.accumulate_grad_batches:
            self._discard_window()  # a window shorter than A is not its mean: left out
        else:
            held, self._held = self._held, None
            model, scaler = trainer.strategy.model, _loss_scaler(trainer)
            self.distributed.microbatch(model, held, "steps", None, True, scaler)
            self.result = self.distributed.result
        if self.result is not None:
            values = self.result.as_dict()
            if not self.per_block:
                values = {k: v for k, v in values.items() if "/" not in k}
            pl_module.log_dict({f"noise_scale/{k}": v for k, v in values.items()})

    def _discard_window(self) -> None:
        """Leave out the window a mid-window checkpoint cut, or one shorter than
        ``accumulate_grad_batches`` (on every rank: all load rank 0's state and count the same
        windows, so all discard the same one; no collective runs)."""
        self._lost_window = False
        if self.distributed is None:
            self.estimator.discard_step()
            self.result = self.estimator.estimate
        else:
            self._held = None
            self.distributed.discard_window()
            self.result = self.distributed.result

    def on_train_end(self, trainer, pl_module) -> None:
        if self.distributed is not None:
            self.result = self.distributed.result  # the last step's all-reduce folded in

    def state_dict(self) -> dict[str, Any]:
        owner = self.distributed if self.distributed is not None else self.estimator
        if owner is None:
            return {}
        return {"estimator": owner.state_dict(), "open_microbatches": self._open}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "estimator" not in state_dict:
            return
        self._open = int(state_dict.get("open_microbatches", 0))
        self._lost_window = self._open > 0  # confirmed at train start
        owner = self.distributed if self.distributed is not None else self.estimator
        if owner is None:
            self._pending_state = state_dict["estimator"]
        else:
            owner.load_state_dict(state_dict["estimator"])


def _loss_scaler(trainer: Any) -> Any:
    """The GradScaler that multiplies Lightning's losses ("16-mixed"), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)


def _is_mean_window(counts: list[float], accumulate: int) -> bool:
    """Whether Lightning's accumulated gradient is the mean over the window's examples: each
    loss is divided by ``accumulate``, so the window needs that many microbatches, of one size
    (and two at least, to compare a microbatch with the mean)."""
    return accumulate >= 2 and len(counts) == accumulate and len(set(counts)) == 1


def _schedules_accumulation(trainer: Any) -> bool:
    """A ``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at each epoch's
    start (1 until then); the windows are read as they come, those of one batch left out."""
    return any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)


def _ddp_model(trainer: Any) -> nn.Module:
    """The strategy's ``DistributedDataParallel`` model, or the reason it cannot be measured."""
    model = trainer.strategy.model
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise NotImplementedError(
            f"NoiseScaleCallback with world_size={trainer.world_size} measures local against "
            "all-reduced gradients in DistributedDataParallel's communication hook "
            f"(DDPNoiseScale), but the {type(trainer.strategy).__name__} strategy wrapped the "
            f"model in {type(model).__name__} (FSDP or DeepSpeed); use strategy='ddp' (or "
            "'ddp_spawn'), or leave the callback out."
        )
    return model


def _transformers_models(pl_module: nn.Module) -> list[nn.Module]:
    """The outermost transformers models (modules with a ``base_model``) inside ``pl_module``."""
    found: list[nn.Module] = []
    for module in pl_module.modules():
        inside = any(module is m or any(module is d for d in m.modules()) for m in found)
        if not inside and isinstance(getattr(module, "base_model", None), nn.Module):
            found.append(module)
    return found


class GroupingCallback(Callback):
    """Run the transformers models of the LightningModule by length groups while fitting.

    Each right-padded batch runs through the model's body one length group at a time, each group
    padded only to its own longest row, with the padded run's outputs at real positions (hence its
    loss and gradients, up to float rounding): ``grabkit.integrations.grouped_forward``. The
    batches, the loader and the ``training_step`` stay as they are.

    Args:
        model: the transformers model to group; None: every outermost module of the
            LightningModule that has a ``base_model`` (a transformers ``PreTrainedModel``).
        **planning: ``grabkit.group.plan_groups`` keywords.

    Not with ``GraBCallback`` or ``ExampleGradientNormsCallback`` on the same model: their hook
    statistics read one call of each layer per backward.
    """

    def __init__(self, model: nn.Module | None = None, **planning: Any) -> None:
        self.model, self.planning = model, planning
        self.grouped: list[GroupedForward] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        readers = (GraBCallback, ExampleGradientNormsCallback)
        hooked = [c for c in trainer.callbacks if isinstance(c, readers)]
        if hooked:
            raise NotImplementedError(
                f"GroupingCallback calls the model once per length group, and "
                f"{type(hooked[0]).__name__} reads per-example statistics from one call of each "
                "layer per backward; use one of them."
            )
        models = [self.model] if self.model is not None else _transformers_models(pl_module)
        if not models:
            raise ValueError(
                "GroupingCallback found no transformers model (a module with base_model) in the "
                "LightningModule; pass it: GroupingCallback(model=self.net)."
            )
        self.grouped = [GroupedForward(m, **self.planning) for m in models]

    def on_fit_start(self, trainer, pl_module) -> None:
        for grouped in self.grouped:
            grouped.attach()

    def on_fit_end(self, trainer, pl_module) -> None:
        for grouped in self.grouped:
            grouped.detach()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_fit_end(trainer, pl_module)


class ExampleGradientNormsCallback(Callback):
    """Log quantiles (and a histogram) of the per-example gradient norms |g_i| of every step.

    At each optimizer step, the norms of the step's examples (every microbatch's backward) are
    logged with ``pl_module.log_dict`` as ``grad_norm_per_example/{min,q10,median,q90,max,mean,
    count}`` and, when the logger's experiment has ``add_histogram`` (TensorBoard), as a
    histogram ``grad_norm_per_example``. A norm is the gradient of an example's own loss
    (Lightning's division by ``accumulate_grad_batches`` undone, the value in force at each
    backward, so a ``GradientAccumulationScheduler``'s too; see
    ``grabkit.integrations.example_norms``). A ``GraBCallback``'s sampler
    statistics on the model are shared (one set of hooks; a sketching sampler's give estimated
    norms).

    Args:
        module: the network to measure (default: the LightningModule).
        quantiles: in [0, 1]; loss_reduction: how each microbatch's loss reduces its examples
            (None: a shared sampler's statistics' own, else "mean").
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        loss_reduction: str | None = None,
    ) -> None:
        self.module, self.loss_reduction = module, loss_reduction
        self.quantiles = ExampleGradientNorms.check_quantiles(quantiles)
        self.norms: ExampleGradientNorms | None = None
        self.last: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        stats = None
        for callback in trainer.callbacks:
            sampler = getattr(callback, "sampler", None)
            if isinstance(callback, GraBCallback) and sampler is not None:
                stats = sampler.stats
        module = self.module if self.module is not None else pl_module
        self.norms = ExampleGradientNorms(module, stats, self.loss_reduction, self.quantiles)
        # 16-mixed: the loss scale divided out (every capture runs before the scaler's update)
        self.norms.grad_scaler = _loss_scaler(trainer)

    def on_after_backward(self, trainer, pl_module) -> None:
        # Lightning divides each loss by the accumulation in force for this backward, which a
        # GradientAccumulationScheduler changes at epoch starts: undone now, backward by backward
        self.norms.scale = float(trainer.accumulate_grad_batches)
        self.norms.capture()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = self.norms.take()
        self.last = self.norms.summarize(norms)
        if self.last:
            pl_module.log_dict(self.last)
        experiment = getattr(trainer.logger, "experiment", None)
        if norms.numel() and hasattr(experiment, "add_histogram"):
            experiment.add_histogram("grad_norm_per_example", norms, trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.norms is not None:
            self.norms.close()
            self.norms = None
