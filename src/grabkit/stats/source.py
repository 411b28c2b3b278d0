"""The statistics-source protocol: how a consumer takes each backward's statistics.

A ``StatisticsSource`` records the per-example statistics of every ``loss.backward()`` from hooks
and drops them when the next step's first forward begins (``PerSampleStats``; ``SketchedStats``
reads the same hooks as (B, k) sketches). A consumer ``subscribe``s once and gets a
``Subscription``:

* its listener runs after each backward, just before the next forward drops that backward's
  statistics (so gradient accumulation can keep every micro-batch);
* ``take()`` returns the latest backward's ``GradientBatch`` once (None before any backward, and
  again None until the next backward; None for a backward that reached no parameter): a consumer
  never counts one backward twice;
* ``close()`` ends the subscription.

Subscriptions are independent: two consumers of one source each take every backward. A
subscription keeps no batch alive: once taken, the batch is the consumer's.

A consumer handed a source that another built (``ExampleGradientNorms(model, stats=sampler.
stats)``) reads the statistics as that source defines them: its loss reduction and the trainable
parameters of the model it hooks. ``check_shared`` refuses a consumer asked for another
definition (a loss reduction, or a model, other than the source's), which it would otherwise
silently not get.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from grabkit.stats.gradient_batch import GradientBatch

__all__ = [
    "BackwardMark",
    "StatisticsSource",
    "Subscription",
    "check_shared",
    "gradients_taken",
    "note_gradients_taken",
    "reset_unused",
]


#: (id of the first trainable parameter a step's backwards reached, that parameter's version
#: counter then, whether its ``.grad`` was empty then, how many times its ``.grad`` had been
#: taken away for use then: ``gradients_taken``)
BackwardMark = tuple[int, int, bool, int]

#: parameter -> how many times a consumer took its ``.grad`` away for use (weakly held)
_TAKEN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def note_gradients_taken(params: Iterable[torch.Tensor]) -> None:
    """Record that the ``.grad`` of ``params`` was taken away to be used (an
    ``AdaptiveAccumulationWrapper`` folds each microbatch's gradient into its window and
    clears ``.grad``), so that an empty ``.grad`` afterwards is not read as a reset."""
    for p in params:
        _TAKEN[p] = _TAKEN.get(p, 0) + 1


def gradients_taken(p: torch.Tensor) -> int:
    """How many times ``p``'s ``.grad`` was taken away for use (``note_gradients_taken``)."""
    return _TAKEN.get(p, 0)


def reset_unused(earlier: BackwardMark | None, later: BackwardMark | None) -> bool:
    """Whether the gradients of the backward marked ``earlier`` were reset before the backward
    marked ``later`` with no optimizer step between: ``later`` found the same parameter's
    ``.grad`` empty (``zero_grad``), the parameter unchanged and nothing having taken its
    gradient for use (an accumulation wrapper's fold). Such a backward trained nothing (a GAN
    generator's step through the model, an FGSM ``loss.backward()`` taken for the input
    gradient before the adversarial one), so it is no micro-batch of an update. (An optimizer
    that updates in place without a version bump, a fused one, looks unused too: only a
    backward followed by another before its statistics were taken is asked.)"""
    if earlier is None or later is None or not later[2]:
        return False
    return earlier[0] == later[0] and earlier[1] == later[1] and earlier[3] == later[3]


class StatisticsSource(ABC):
    """Per-example statistics of each backward, read through ``subscribe`` / ``take`` / ``close``.

    Implementations hold ``step_listeners`` (called with no argument after a backward, before
    the next forward drops it) and ``generation`` (changes whenever the recorded statistics
    change: a gradient arrived, a step began), and implement ``backward_seen``,
    ``gradient_batch`` and ``close``.
    """

    #: called (no arguments) after a backward, before the next forward drops its statistics
    step_listeners: list[Callable[[], None]]
    #: changes whenever the recorded statistics change (a gradient arrived, a step began)
    generation: int
    #: the module whose trainable parameters the statistics describe (None where unknown)
    model: nn.Module | None = None
    #: how the batch loss combines the examples' terms, "mean" or "sum" (None where unknown)
    loss_reduction: str | None = None

    @property
    @abstractmethod
    def backward_seen(self) -> bool:
        """Whether a backward ran since this step's first forward (statistics can be read)."""

    @property
    def closed(self) -> bool:
        """Whether ``close()`` removed the hooks (nothing more is recorded). Sources that
        cannot tell say False."""
        return False

    @property
    def parameter_gradients_seen(self) -> bool:
        """Whether a backward since this step's first forward reached the trainable parameters,
        not only the inputs (an input gradient by ``torch.autograd.grad``, as FGSM takes one).
        Sources that cannot tell say True."""
        return True

    @property
    def backward_mark(self) -> BackwardMark | None:
        """What tells this step's backwards from those of a step whose gradients were reset
        unused (``reset_unused``): the first trainable parameter they reached, its version
        counter then, and whether its ``.grad`` was empty then. None where unknown."""
        return None

    @property
    def stepped_since_backward(self) -> bool:
        """Whether the parameter of ``backward_mark`` changed in place since that backward (an
        optimizer step between the backward and the read); False where unknown."""
        return False

    @property
    def step_inputs(self) -> tuple[torch.Tensor, ...]:
        """The tensors the model's forward took in this step (its batch), so a consumer can
        tell two backwards over the same batch from two micro-batches; () where unknown."""
        return ()

    @abstractmethod
    def gradient_batch(self, *, settle: bool = True) -> GradientBatch:
        """The latest backward's statistics as a ``GradientBatch``.

        ``settle=False``: a check of the statistics (``PerSampleStats``' identity check) may be
        left pending on the batch, compared by its ``to_host`` in the same transfer as the first
        values the consumer reads, before they are returned; a consumer that asks for it moves
        every value it reads to the host through ``batch.to_host`` (or calls ``batch.settle()``).
        """

    @abstractmethod
    def close(self) -> None:
        """Remove the hooks; the source records nothing more."""

    def subscribe(self, listener: Callable[[], None] | None = None) -> Subscription:
        """A new consumer: ``listener()`` runs after each backward, before the next forward drops
        its statistics (``take()`` still reads them inside the call)."""
        return Subscription(self, listener)


class Subscription:
    """One consumer's view of a ``StatisticsSource`` (see the module docstring)."""

    def __init__(self, source: StatisticsSource, listener: Callable[[], None] | None) -> None:
        self.source = source
        self.listener = listener
        self._taken: int | None = None  # the generation last taken
        if listener is not None:
            source.step_listeners.append(listener)

    def take(self, *, settle: bool = True) -> GradientBatch | None:
        """The latest backward's batch, the first time it is asked for; else None. A backward
        that reached no parameter (an input gradient alone) gives nothing: it is not a
        micro-batch of the step. ``settle``: as for ``StatisticsSource.gradient_batch``."""
        source = self.source
        generation = source.generation
        if self._taken == generation:  # first: the usual case of a listener after a take
            return None
        if not (source.backward_seen and source.parameter_gradients_seen):
            return None
        self._taken = generation
        return source.gradient_batch(settle=settle)

    def close(self) -> None:
        """Stop listening (the source itself stays open)."""
        listeners = self.source.step_listeners
        if self.listener is not None and self.listener in listeners:
            listeners.remove(self.listener)


def check_shared(
    stats: StatisticsSource, model: nn.Module | None, loss_reduction: str | None, consumer: str
) -> str | None:
    """The loss reduction ``consumer`` reads ``stats`` in, after checking that they describe
    what it was asked for: the trainable parameters of ``model`` (a wrapper of the source's
    model, DDP, ``torch.compile`` or a module holding it and nothing more, has the same ones)
    (None: not given) and ``loss_reduction`` (None: the source's own).

    A source defines its statistics itself; a consumer given another model or reduction would
    read those of the source's model and reduction without a word (the norms of a submodule's
    parameters only; B times the norms where a summed loss is read as a mean), so both are
    refused with a ``ValueError`` naming the difference. What a source does not say (a source
    of the user's without ``model`` or ``loss_reduction``) is not checked.
    """
    own = stats.loss_reduction
    if loss_reduction is not None and own is not None and loss_reduction != own:
        raise ValueError(
            f"{consumer} was given loss_reduction={loss_reduction!r}, but the statistics it "
            f"reads (stats=, shared with their owner) were built with loss_reduction={own!r}, "
            f"and it reads them as they are; leave loss_reduction out (the statistics' own "
            f"is used) or build the statistics' owner with loss_reduction={loss_reduction!r}."
        )
    hooked = stats.model
    if hooked is not None and model is not None:
        _check_same_parameters(model, hooked, consumer)
    return own if loss_reduction is None else loss_reduction


def _check_same_parameters(model: nn.Module, hooked: nn.Module, consumer: str) -> None:
    """Refuse ``model`` unless its trainable parameters are those ``hooked`` has."""
    wanted = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    measured = {id(p): name for name, p in hooked.named_parameters() if p.requires_grad}
    if wanted.keys() == measured.keys():
        return
    missing = [name for key, name in wanted.items() if key not in measured]
    extra = [name for key, name in measured.items() if key not in wanted]
    what = (
        f"{missing[:3]} ({len(missing)} of the model's trainable parameters) are not measured"
        if missing
        else f"they measure {extra[:3]} ({len(extra)} parameters), which the model has not"
    )
    raise ValueError(
        f"{consumer} was given a {type(model).__name__} and statistics (stats=) hooked on a "
        f"{type(hooked).__name__} with other trainable parameters: {what}, so its numbers "
        f"would describe another model. Pass the module the statistics hook (stats.model), "
        f"or leave stats= out to hook the model itself."
    )
