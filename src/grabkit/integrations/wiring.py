"""Recognise a training framework in the call stack, to warn about wiring it without grabkit's
integration (or refuse wiring that would train on the wrong examples).

The obvious wiring of a grabkit object into a framework often runs, and is silently wrong: a GQC
wrapper passed to a plain ``transformers.Trainer`` is clipped every microbatch (so it steps every
time), a ``GraBSampler`` in a plain ``Trainer`` is missing from its checkpoints (a resume
diverges), a noise scale measured in a plain ``Trainer`` callback sees clipped gradients.
grabkit's objects call :func:`check_wiring` at their first use (a sampler at each ``iter()``
until it warned); it walks the call stack for a framework object (no framework is imported) and
warns once per object, naming the integration to use. accelerate re-splitting a GraB sampler
that already splits the epoch across ranks is not a warning but an error
(:func:`check_not_resharded`): every rank would train on other examples than GraB credits.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = [
    "check_not_accelerate_stateful",
    "check_not_dispatched",
    "check_not_resharded",
    "check_not_skipped",
    "check_sampler_iteration",
    "check_wiring",
    "frames_self",
]

_MAX_FRAMES = 80

#: what each grabkit object needs in each framework: (integration class name, advice)
_ADVICE = {
    ("sampler", "transformers"): (
        "GrabkitTrainer",
        "a GraBSampler in transformers' Trainer: Trainer's checkpoints do not hold its state, "
        "so a resume diverges from the uninterrupted run, and stepping it outside "
        "training_step misses microbatches. Use grabkit.integrations.huggingface."
        "GrabkitTrainer(grab={...}) instead of a plain Trainer with your own sampler glue.",
    ),
    ("sampler", "lightning"): (
        "GraBCallback",
        "a GraBSampler in a Lightning Trainer without GraBCallback: nothing steps it after each "
        "backward (its order then never changes) and Lightning's checkpoints do not hold its "
        "state. Add grabkit.integrations.lightning.GraBCallback(sampler) to the callbacks.",
    ),
    ("adaptive", "transformers"): (
        "GrabkitTrainer",
        "an adaptive accumulation wrapper stepped by transformers' Trainer: Trainer clips every "
        "microbatch before the wrapper sees it and passes no count, so a norm-threshold rule "
        "steps on every microbatch, and the LR schedule counts microbatches. Use "
        "grabkit.integrations.huggingface.GrabkitTrainer(accumulation=lambda opt: "
        "OptimizerWrapperGNTS(opt, ...)) with gradient_accumulation_steps=1.",
    ),
    ("adaptive", "lightning"): (
        "AdaptiveAccumulationCallback",
        "an adaptive accumulation wrapper stepped by Lightning without "
        "AdaptiveAccumulationCallback: Lightning clips every microbatch before the wrapper sees "
        "it (gradient_clip_val) and passes no count, so a norm-threshold rule steps on every "
        "microbatch. Add grabkit.integrations.lightning.AdaptiveAccumulationCallback().",
    ),
    ("noise", "transformers"): (
        "GrabkitTrainer",
        "a noise scale closed inside transformers' Trainer with max_grad_norm > 0: Trainer "
        "clips the accumulated gradient before any callback runs, so the step's norm is the "
        "clipped one and B_simple is wrong. Use grabkit.integrations.huggingface."
        "GrabkitTrainer(noise_scale={...}), which closes the step before Trainer clips.",
    ),
}


def frames_self(depth: int = 2) -> Iterator[Any]:
    """The ``self`` of each calling frame, innermost first, from ``depth`` frames up."""
    frame = sys._getframe(depth)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None:
            yield owner
        frame = frame.f_back


def _is(obj: Any, module_prefix: str, name: str) -> bool:
    """Whether a class named ``name`` from a module under ``module_prefix`` is in obj's MRO."""
    return any(
        cls.__name__ == name and cls.__module__.startswith(module_prefix)
        for cls in type(obj).__mro__
    )


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or None where reading it fails (Lightning raises for a detached module)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # a property that raises is as good as absent here
        return None


def _framework(obj: Any) -> tuple[str, Any] | None:
    """("transformers", its Trainer) or ("lightning", its Trainer) for a framework object."""
    if _is(obj, "transformers", "Trainer"):
        return "transformers", obj
    for prefix in ("lightning.pytorch", "pytorch_lightning"):
        if _is(obj, prefix, "Trainer"):
            return "lightning", obj
        if type(obj).__module__.startswith(prefix):
            trainer = _attribute(obj, "trainer")
            if _is(trainer, prefix, "Trainer"):
                return "lightning", trainer
    return None


def _integrated(kind: str, framework: str, trainer: Any) -> bool:
    """Whether the framework runs grabkit's integration for this kind of object."""
    wanted = _ADVICE[(kind, framework)][0]
    if framework == "transformers":
        return _is(trainer, "grabkit.integrations", wanted)
    if kind == "noise":
        return True  # Lightning's on_before_optimizer_step runs before it clips
    return any(_is(callback, "grabkit.integrations", wanted) for callback in trainer.callbacks)


def _needs_warning(kind: str, framework: str, trainer: Any) -> bool:
    if kind == "noise" and framework == "transformers":
        return float(getattr(trainer.args, "max_grad_norm", 0) or 0) > 0 and not _integrated(
            kind, framework, trainer
        )
    return (kind, framework) in _ADVICE and not _integrated(kind, framework, trainer)


def check_wiring(obj: Any, kind: str) -> bool:
    """Warn (once per ``obj``) when a framework in the call stack runs ``obj`` without the
    integration it needs. ``kind``: "sampler", "adaptive" or "noise". Returns True when a
    framework was found (checked), so callers can stop checking."""
    for owner in frames_self(depth=2):
        found = _framework(owner)
        if found is None:
            continue
        framework, trainer = found
        if _needs_warning(kind, framework, trainer) and not getattr(obj, "_wiring_warned", False):
            obj._wiring_warned = True
            warnings.warn(f"grabkit: {_ADVICE[(kind, framework)][1]}", UserWarning, stacklevel=3)
        return True
    return False


def check_not_dispatched(loader: Any, num_replicas: int) -> None:
    """Raise when ``loader`` is accelerate's ``DataLoaderDispatcher`` on several processes
    (``dispatch_batches=True``): process 0 alone iterates it and hands every process a slice of
    its batches, so a GraB sampler that splits the epoch across the ranks is drawn on process 0
    only; the other ranks' shares are never trained, each rank's gradients are credited to
    examples it did not train, and process 0 blocks in the sampler's first collective, which
    the others never reach."""
    if not _is(loader, "accelerate", "DataLoaderDispatcher"):
        return
    processes = int(getattr(_attribute(loader, "state"), "num_processes", 1))
    if processes <= 1:
        return
    raise ValueError(
        f"accelerate's dispatch_batches=True on {processes} processes: process 0 alone iterates "
        f"this loader and slices its batches for every process, but its GraBSampler "
        f"(num_replicas={num_replicas}) splits the epoch across the processes itself: the other "
        "processes' shares would never be trained, GraB would credit each process's gradients "
        "to examples it did not train, and process 0 would wait in the sampler's first "
        "collective for processes that never reach it. Leave dispatch_batches off "
        "(DataLoaderConfiguration(dispatch_batches=False); the default for a map-style "
        "dataset) and call grabkit.integrations.accelerate.shard_by_sampler(loader) after "
        "prepare(): every process then draws its own share."
    )


def check_not_resharded(num_replicas: int, rank: int) -> None:
    """Raise when accelerate's ``BatchSamplerShard`` re-splits a GraB sampler's batches, or its
    ``DataLoaderDispatcher`` hands them out (:func:`check_not_dispatched`).

    A GraB sampler decides from the gradients of the examples it yields in visit order; under
    accelerate's ``prepare()`` every process draws the sampler's whole output and keeps every
    ``num_processes``-th batch, so the examples a rank trains are not the ones the sampler
    credits its gradients to (and with a sampler that already splits the epoch, each rank trains
    a fraction of its share).
    """
    for owner in frames_self(depth=2):
        check_not_dispatched(owner, num_replicas)
        processes = getattr(owner, "num_processes", 1)
        if not _is(owner, "accelerate", "BatchSamplerShard") or processes <= 1:
            continue
        raise ValueError(
            f"accelerate's prepare() split this loader's batches across {processes} processes "
            f"(BatchSamplerShard), on top of a GraBSampler with num_replicas={num_replicas}, "
            f"rank={rank}: each process would train other examples than GraB credits its "
            'gradients to. Build the sampler after Accelerator() with statistics="sketch" (it '
            "takes num_replicas and rank from the process group and splits the epoch itself), "
            "and after prepare() call grabkit.integrations.accelerate.shard_by_sampler(loader) "
            "so that accelerate keeps the sampler's split."
        )


def check_not_skipped(sampler: Any) -> None:
    """Raise when accelerate's ``skip_first_batches`` skips batches of a sampler that resumes
    the untrained rest of its epoch itself (restored by ``SamplerCheckpoint``).

    accelerate's resume recipe (``load_state``, then ``skip_first_batches(loader, n)``) is for
    loaders that restart their epoch; ``SamplerCheckpoint`` hands the trained examples' position
    back to the sampler, whose next ``iter()`` yields only the epoch's untrained rest. Skipping
    on top would never train ``n`` batches of it, and GraB, stepping the next unstepped examples
    after each backward, would credit the gradients of the batches after them to theirs.
    Checked at the first ``iter()`` after the restore (the flag is cleared there).
    """
    if not getattr(sampler, "resumes_untrained_rest", False):
        return
    sampler.resumes_untrained_rest = False
    for owner in frames_self(depth=2):
        skipped = getattr(owner, "skip_batches", 0)
        skipper = _is(owner, "accelerate", "SkipBatchSampler") or _is(
            owner, "accelerate", "SkipDataLoader"
        )
        if skipper and isinstance(skipped, int) and skipped > 0:
            raise ValueError(
                f"accelerate's skip_first_batches skips {skipped} batch(es) of a GraBSampler "
                "that SamplerCheckpoint restored: its next iter() already yields only the "
                "epoch's untrained rest, so the skipped batches would never be trained and GraB "
                "would credit the gradients of the batches after them to their examples. Drop "
                "skip_first_batches from the resume (after load_state, iterate the prepared "
                "loader itself: SamplerCheckpoint resumes the epoch exactly)."
            )


def check_not_accelerate_stateful() -> None:
    """Raise when accelerate's prepared loader built with
    ``DataLoaderConfiguration(use_stateful_dataloader=True)`` iterates a GraB sampler.

    ``save_state`` then saves torchdata's loader snapshot, and after ``load_state`` torchdata
    fast-forwards the loader's batch sampler (a plain ``BatchSampler`` to it) by the batches it
    counted: on top of a sampler that ``SamplerCheckpoint`` restored to its epoch's untrained
    rest, that skips untrained batches (inside an epoch, refused at a later step without naming
    the cause); without ``SamplerCheckpoint`` the sampler's ordering state is in no checkpoint
    and the resumed run orders otherwise than the uninterrupted one (silently).
    """
    for owner in frames_self(depth=2):
        loader = _is(owner, "accelerate", "DataLoaderShard") or _is(
            owner, "accelerate", "DataLoaderDispatcher"
        )
        if loader and getattr(owner, "use_stateful_dataloader", False):
            raise ValueError(
                "accelerate's DataLoaderConfiguration(use_stateful_dataloader=True) iterates "
                "this GraBSampler: save_state would hold torchdata's loader snapshot, and after "
                "load_state torchdata fast-forwards the epoch by the batches it counted, on top "
                "of the sampler's own resume (untrained batches skipped), or without "
                "SamplerCheckpoint resumes no GraB state at all (another order than the "
                "uninterrupted run). Leave use_stateful_dataloader off and register "
                "grabkit.integrations.accelerate.SamplerCheckpoint(sampler) for save_state: "
                "the plain prepared loader then resumes the epoch's untrained rest exactly."
            )


def check_sampler_iteration(sampler: Any) -> None:
    """What a GraB sampler checks at each ``iter()``: refused when accelerate re-splits its
    batches, restores it through a stateful loader, or skips batches of an epoch it resumes
    itself; warned (once) when a framework
    iterates it without the GraB integration."""
    check_not_resharded(sampler.num_replicas, sampler.rank)
    check_not_accelerate_stateful()
    check_not_skipped(sampler)
    if not getattr(sampler, "_wiring_warned", False):
        check_wiring(sampler, "sampler")
