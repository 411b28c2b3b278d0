"""Hugging Face Accelerate: the two pieces a hand-written accelerate loop needs.

Accelerate needs no callback machinery; a loop stays a loop (``pip install accelerate``)::

    sampler = GraBSampler(dataset, model=model)
    loader = DataLoader(dataset, sampler=sampler, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, wrapper, loader)
    loader = shard_by_sampler(loader)  # several processes: keep the sampler's split
    accelerator.register_for_checkpointing(SamplerCheckpoint(sampler))
    for batch in loader:
        accelerator.backward(loss_fn(model, batch))
        sampler.step()                                     # every microbatch
        adaptive_step(optimizer, count=len(batch["labels"]))  # wrapper: AcceleratedOptimizer
        optimizer.zero_grad()

* :func:`adaptive_step`: ``AcceleratedOptimizer.step()`` takes no ``count=``; this steps the
  ``AdaptiveAccumulationWrapper`` inside it with the count, through accelerate's ``GradScaler``
  when mixed precision has one (the wrapper unscales each microbatch itself and drops an
  overflowed one). It refuses ``gradient_accumulation_steps > 1``: ``accelerator.backward``
  would divide every loss and ``accumulate()`` would hide microbatches from the wrapper. Clip
  with the wrapper's ``clip_grad_norm=``, which clips the window's averaged gradient, not with
  ``accelerator.clip_grad_norm_`` before ``adaptive_step``: that would clip every microbatch
  before the wrapper measures it, and a norm-threshold rule would see the clipped norms. At
  the end of training the window still accumulating is applied by the wrapper's own
  ``flush()`` (``optimizer.optimizer.flush()``: ``AcceleratedOptimizer`` has none); left
  unflushed, its microbatches are never applied (a ``save_state`` holds them for a resume).
  ``save_state`` before that flush: the state holds the open window, and a run continued
  from it (more epochs) is the uninterrupted longer run; a state saved after it holds the
  window's early update, so a continuation has that update too, and the wrapper warns at its
  first step.
* :class:`SamplerCheckpoint`: register it (not the sampler) for ``save_state`` /
  ``load_state``. accelerate's loader looks one batch ahead, so the sampler's own snapshot
  counts a batch that was never trained; this one hands the in-flight examples back, and after
  ``load_state`` the next ``iter(loader)`` yields exactly the untrained rest of the epoch. Do
  not also ``skip_first_batches`` (accelerate's recipe for loaders that restart their epoch):
  the resumed loader's first batch refuses it. A state saved at an epoch's last step resumes
  with the next epoch: accelerate's recipe (``load_state``, then the epoch loop from the saved
  epoch + 1, i.e. ``step // len(loader)``) works unchanged, a ``DataLoader(drop_last=True)``
  whose dropped rest was never stepped included (the prepared loader says when it yielded its
  last batch). Under several processes rank 0's state is saved and every rank loads it as its
  own.
* :func:`shard_by_sampler`: several processes. Build the ``GraBSampler`` after ``Accelerator()``
  with ``statistics="sketch"`` (it splits every epoch across the ranks, and its steps gather the
  ranks' sketches) and call ``shard_by_sampler`` on the prepared loader, so that accelerate's
  ``BatchSamplerShard`` does not split the batches again (nor complete a partial last batch with
  other examples: the sampler gives every process the same number); a GraB loader re-split by
  accelerate is refused at its first batch, ``split_batches=True`` and ``dispatch_batches=True``
  (several processes) by ``shard_by_sampler``.

Nothing here imports accelerate; it works with any object that has ``.optimizer`` and
``.scaler`` the way ``AcceleratedOptimizer`` has them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper
from grabkit.integrations.resume import rewound_state
from grabkit.integrations.wiring import check_not_dispatched
from grabkit.order import GraBBatchSampler, GraBSampler

__all__ = ["SamplerCheckpoint", "adaptive_step", "grab_sampler_of", "shard_by_sampler"]


def _unwrap(optimizer: Any) -> AdaptiveAccumulationWrapper:
    inner = optimizer
    while inner is not None and not isinstance(inner, AdaptiveAccumulationWrapper):
        inner = getattr(inner, "optimizer", None)
    if inner is None:
        raise TypeError(
            "adaptive_step needs an AdaptiveAccumulationWrapper (or accelerate's "
            f"AcceleratedOptimizer around one), but got {type(optimizer).__name__}; pass the "
            "wrapper to accelerator.prepare(...)."
        )
    return inner


def adaptive_step(
    optimizer: Any,
    *,
    count: float | torch.Tensor | None = None,
    metric: float | torch.Tensor | None = None,
) -> bool:
    """Step the adaptive wrapper inside an ``AcceleratedOptimizer`` with ``count`` / ``metric``.

    Call after every microbatch's ``accelerator.backward(loss)``. Returns True when the inner
    optimizer stepped (the wrapper's answer; False also for an overflowed fp16 microbatch).
    """
    wrapper = _unwrap(optimizer)
    state = getattr(optimizer, "gradient_state", None)
    steps = getattr(state, "num_steps", 1)
    if steps != 1:
        raise ValueError(
            "adaptive_step: the adaptive wrapper decides the accumulation window, so "
            f"Accelerator(gradient_accumulation_steps=...) should be 1, but got {steps}; with "
            "more, accelerator.backward divides every loss and accumulate() hides microbatches "
            "from the wrapper."
        )
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        stepped = scaler.step(wrapper, count=count, metric=metric)  # the wrapper unscales
        scaler.update()
        return bool(stepped)
    return wrapper.step(count=count, metric=metric)


class SamplerCheckpoint:
    """A ``GraBSampler`` for ``accelerator.register_for_checkpointing``, prefetch-safe.

    Save right after an optimizer step (everything stepped was trained); the saved state hands
    the examples the loader fetched ahead back to the sampler. Under ``accumulate()`` that is
    where ``accelerator.sync_gradients`` is True: a state taken after backwards the sampler has
    not stepped yet (stepped at the window's end) is refused (their statistics are in no state,
    and the resumed loader would yield their examples again), and so is any state taken inside
    a window (``save_state`` holds no accumulated gradient: the resumed run would step on the
    window's remaining microbatches alone). A state saved after the prepared
    loader's last batch of an epoch (accelerate's ``end_of_dataloader``) is marked as ended, so
    the resume starts the next epoch even when the loader dropped a partial last batch whose
    examples were never stepped (``drop_last=True``).

    Args:
        sampler: the ``GraBSampler`` (or ``GraBBatchSampler``) of the train loader.
        loader: the prepared loader that draws from it, read for ``end_of_dataloader``; None:
            the loader accelerate is iterating when the state is saved (a state saved after
            the epoch loop, outside any loader, then needs ``loader=`` under ``drop_last``).
    """

    def __init__(self, sampler: GraBSampler | GraBBatchSampler, loader: Any = None) -> None:
        if isinstance(sampler, GraBBatchSampler):
            sampler = sampler.sampler  # the state and the steps are its sampler's
        if not isinstance(sampler, GraBSampler):
            raise TypeError(
                f"SamplerCheckpoint needs a GraBSampler, but got {type(sampler).__name__}"
            )
        self.sampler, self.loader = sampler, loader

    def _epoch_over(self) -> bool:
        """The loader drawing from the sampler has yielded its epoch's last batch."""
        loaders = [self.loader] if self.loader is not None else _active_loaders()
        return any(
            bool(getattr(loader, "end_of_dataloader", False))
            and grab_sampler_of(loader) is self.sampler
            for loader in loaders
        )

    def state_dict(self) -> dict[str, Any]:
        self._check_all_stepped()
        _check_at_a_window_end()
        state, ended = self.sampler.state_dict(), self._epoch_over()
        return rewound_state(state, self.sampler.num_samples, ended=ended)

    def _check_all_stepped(self) -> None:
        """Refuse a state taken after backwards the sampler has not stepped (hook mode stepped
        at an accumulation window's end, saved inside the window): no state holds their
        statistics, and the resumed loader would yield their examples again, trained twice."""
        unstepped = self.sampler.source.unstepped()
        if not unstepped:
            return
        raise ValueError(
            f"SamplerCheckpoint: save_state after backwards over {unstepped} examples that the "
            "GraBSampler has not stepped yet (inside an accumulation window whose sampler.step() "
            "comes at its end): their statistics are in no state, and the resumed loader would "
            "yield these examples again, trained twice. Call save_state where "
            "accelerator.sync_gradients is True, after sampler.step() and the optimizer step "
            "(accelerate's save_state holds no accumulated gradient either)."
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.sampler
        state = rewound_state(state, sampler.num_samples)  # "ended" at an epoch's end
        sampler.load_state_dict(state)
        # its next iter() refuses accelerate's skip_first_batches (wiring.check_not_skipped)
        sampler.resumes_untrained_rest = True


def _check_at_a_window_end() -> None:
    """Refuse a state taken inside an ``accumulate()`` window (``sync_gradients`` False): the
    sampler may have stepped every microbatch, but ``save_state`` holds no accumulated gradient,
    so the resumed run would step on the window's remaining microbatches alone (its data and
    order resumed exactly, its parameters not the uninterrupted run's). Read only when
    accelerate was imported."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    gradient_state = state.GradientState()
    steps = gradient_state.num_steps
    if steps <= 1 or gradient_state.sync_gradients:
        return
    raise ValueError(
        f"SamplerCheckpoint: save_state inside an accumulation window (accumulate() with "
        f"gradient_accumulation_steps={steps}, accelerator.sync_gradients is False): the state "
        "holds no accumulated gradient, so the resumed run would step on the window's "
        "remaining microbatches alone and differ from the uninterrupted run (the GraB order "
        "would resume exactly). Call save_state where accelerator.sync_gradients is True, "
        "after the window's optimizer step (a loop that stops after a number of microbatches: "
        f"make it a multiple of {steps}, or count optimizer steps)."
    )


def _active_loaders() -> list[Any]:
    """The prepared loader accelerate is iterating now (its ``GradientState``), if any; read
    only when accelerate was imported."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return []
    gradient_state = state.GradientState()
    return [gradient_state.active_dataloader] if gradient_state.in_dataloader else []


def grab_sampler_of(loader: Any) -> GraBSampler | None:
    """The ``GraBSampler`` a (prepared) ``DataLoader`` draws from, or None.

    Looks through accelerate's ``DataLoaderShard`` / ``BatchSamplerShard`` / ``SkipBatchSampler``
    layers and a ``BatchSampler`` or ``GraBBatchSampler``.
    """
    seen = [loader]
    for _ in range(6):
        found = []
        for obj in seen:
            for name in ("sampler", "batch_sampler"):
                inner = getattr(obj, name, None)
                if isinstance(inner, GraBBatchSampler):
                    return inner.sampler
                if isinstance(inner, GraBSampler):
                    return inner
                if inner is not None:
                    found.append(inner)
        seen = found
    return None


def shard_by_sampler(loader: Any) -> Any:
    """Let the GraB sampler split the epoch across processes; accelerate keeps its split.

    Under several processes ``accelerator.prepare(loader)`` wraps the batches in
    ``BatchSamplerShard``, which hands each process every ``num_processes``-th batch of the whole
    sampler output. A ``GraBSampler`` built after ``Accelerator()`` with ``statistics="sketch"``
    already splits each epoch across the ranks as ``DistributedSampler`` does (rank r visits
    positions r, r + W, ..., and every ``step()`` gathers the ranks' sketches in global order), so
    the second split must go: this makes the prepared loader's ``BatchSamplerShard`` pass the
    sampler's batches through (as ``transformers.Trainer`` does for its own rank-aware sampler),
    after checking that the sampler was built for these processes. ``len(loader)`` is then this
    rank's number of batches. A partial last batch passes through too: the sampler pads the
    epoch so that every process yields the same number of examples, and accelerate's
    ``even_batches`` would complete that batch with the epoch's first examples, which this
    process's sampler never yielded there. Returns the loader (changed in place).

    Raises:
        ValueError: the loader draws from no ``GraBSampler``; the sampler's ``num_replicas`` /
            ``rank`` are not accelerate's ``num_processes`` / ``process_index``; accelerate's
            ``split_batches=True`` (the loader's ``batch_size`` read as all processes' batch:
            kept whole, each process would train that many of its share) or
            ``dispatch_batches=True`` (process 0 alone draws from the loader) on several
            processes.
    """
    sampler = grab_sampler_of(loader)
    if sampler is None:
        raise ValueError(
            "shard_by_sampler: this loader draws from no GraBSampler (or GraBBatchSampler); pass "
            "the loader returned by accelerator.prepare(DataLoader(data, sampler=grab_sampler))."
        )
    check_not_dispatched(loader, sampler.num_replicas)
    for shard in _batch_sampler_shards(loader):
        processes, index = int(shard.num_processes), int(shard.process_index)
        if processes == 1:
            continue  # one process, or already passed through
        if (sampler.num_replicas, sampler.rank) != (processes, index):
            raise ValueError(
                f"shard_by_sampler: accelerate runs {processes} processes (this is process "
                f"{index}) but the GraBSampler was built with num_replicas="
                f"{sampler.num_replicas}, rank={sampler.rank}; build it after Accelerator() with "
                'statistics="sketch" and leave num_replicas and rank to the process group.'
            )
        _check_not_split(shard, processes)
        # the sampler gives every process the same number of examples (DistributedSampler's
        # padding); accelerate's even_batches would complete a partial last batch with the
        # epoch's first examples, which this process's sampler never yielded there
        shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
    return loader


def _check_not_split(shard: Any, processes: int) -> None:
    """Refuse accelerate's ``split_batches=True``: it reads the DataLoader's ``batch_size`` as
    the batch of all processes together, which the sampler's split cannot keep."""
    if not getattr(shard, "split_batches", False):
        return
    size = shard.batch_size
    raise ValueError(
        f"shard_by_sampler: accelerate's split_batches=True reads the DataLoader's "
        f"batch_size={size} as the batch of all {processes} processes together (each training "
        f"{size} / {processes} of it), but the GraBSampler splits the epoch itself: each "
        f"process would train {size} examples of its own share, a global batch {processes} "
        f"times the one asked for. Build the DataLoader (and the sampler's batch_size) with the "
        f"batch of one process, batch_size={size // processes}, and leave split_batches off."
    )


def _batch_sampler_shards(loader: Any) -> list[Any]:
    """accelerate's ``BatchSamplerShard`` objects inside a prepared loader (by duck type)."""
    out, seen = [], [loader]
    for _ in range(6):
        found = []
        for obj in seen:
            inner = getattr(obj, "batch_sampler", None)
            if inner is None:
                continue
            if hasattr(inner, "num_processes") and hasattr(inner, "process_index"):
                out.append(inner)
            found.append(inner)
        seen = found
    return out
