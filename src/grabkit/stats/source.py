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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["BackwardMark", "StatisticsSource", "Subscription", "reset_unused"]


#: (id of the first trainable parameter a step's backwards reached, that parameter's version
#: counter then, whether its ``.grad`` was empty then)
BackwardMark = tuple[int, int, bool]


def reset_unused(earlier: BackwardMark | None, later: BackwardMark | None) -> bool:
    """Whether the gradients of the backward marked ``earlier`` were reset before the backward
    marked ``later`` with no optimizer step between: ``later`` found the same parameter's
    ``.grad`` empty (``zero_grad``) and the parameter unchanged. Such a backward trained
    nothing (a GAN generator's step through the model, an FGSM ``loss.backward()`` taken for
    the input gradient before the adversarial one), so it is no micro-batch of an update.
    (An optimizer that updates in place without a version bump, a fused one, looks unused
    too: only a backward followed by another before its statistics were taken is asked.)"""
    if earlier is None or later is None or not later[2]:
        return False
    return earlier[0] == later[0] and earlier[1] == later[1]


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

    @property
    @abstractmethod
    def backward_seen(self) -> bool:
        """Whether a backward ran since this step's first forward (statistics can be read)."""

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
