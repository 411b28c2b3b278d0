"""What every ordering shares: the ``Ordering`` interface, the front/back order builder, and the
one-call balancing of linear combinations of a batch against running sums.

An ordering sees an epoch as a sequence of ``observe(batch, indices)`` calls (per-example gradients
in visit order, with their dataset indices) and turns it into the next epoch's order in
``finish_epoch``. It only ever reads gradients through the ``GradientBatch`` protocol, so an
ordering that needs only inner products runs unchanged on hook statistics; those that need the
coordinates themselves set ``needs_coordinates``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from grabkit.order.balance import (
    DEFAULT_POLICY,
    BlockPolicy,
    SignRule,
    balance_combinations,
    balance_dense_vectors,
    epoch_generator,
)
from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.validation import check_bool, check_int, check_positive_int

__all__ = [
    "ORDERINGS",
    "PURPOSE_FIRST_EPOCH",
    "PURPOSE_RESHUFFLE",
    "PURPOSE_SHUFFLE_ONCE",
    "PURPOSE_WITH_REPLACEMENT",
    "FrontBackOrder",
    "IndexTensor",
    "Ordering",
    "balance_combinations",
    "balance_dense_vectors",
    "int_list",
    "observe_in_blocks",
    "random_permutation",
    "register_ordering",
]

# purposes for epoch_generator, so that two random streams never coincide
PURPOSE_FIRST_EPOCH = 1
PURPOSE_RESHUFFLE = 2
PURPOSE_SHUFFLE_ONCE = 3
PURPOSE_WITH_REPLACEMENT = 4


def random_permutation(n: int, seed: int, epoch: int, purpose: int) -> torch.Tensor:
    """A (n,) int64 permutation determined by (seed, epoch, purpose)."""
    return torch.randperm(n, generator=epoch_generator(seed, epoch, purpose))


def int_list(values: Iterable[int]) -> list[int]:
    """Saved indices (a tensor or a list) as a list of Python ints."""
    return [int(i) for i in values]


class Ordering(Stateful, ABC):
    """One example-ordering policy over a dataset of n examples.

    A new ordering is one file: a subclass with a ``name``, its options as keyword-only
    ``__init__`` arguments with defaults (validated there: they are its declaration, read by
    ``option_names``), its state declared with ``add_state`` in ``__init__`` (``state_dict`` and
    ``load_state_dict`` follow; ``grabkit.state``), ``observe`` and ``finish_epoch``, and
    ``@register_ordering`` on the class. ``GraBSampler(ds, instance)`` or
    ``GraBSampler(ds, balance_type=name, option=...)`` then uses it.

    Args:
        n: number of examples.
        seed: all randomness derives from it.
        rule: the sign rule shared by the balancers (default: the deterministic rule).
        random_first_epoch: first epoch in a random order (else 0..n-1).
        block_policy: how dense CPU batches are cut into blocks (``BlockPolicy``; tuning only,
            the decisions do not depend on it).
    """

    name: ClassVar[str]
    #: False for orderings that ignore gradients (step() is then free)
    uses_gradients: ClassVar[bool] = True
    #: True when the ordering needs a dense (B, d) batch, not only inner products
    needs_coordinates: ClassVar[bool] = False
    #: True when observing a batch equals observing its rows in consecutive pieces
    splittable: ClassVar[bool] = False

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        rule: SignRule | None = None,
        random_first_epoch: bool = True,
        block_policy: BlockPolicy | None = None,
    ) -> None:
        self.n = check_positive_int("n", n)
        self.seed = check_int("seed", seed)
        self.rule = SignRule() if rule is None else rule
        self.random_first_epoch = check_bool("random_first_epoch", random_first_epoch)
        self.policy = DEFAULT_POLICY if block_policy is None else block_policy

    def __new__(cls, *args: Any, **kwargs: Any) -> Ordering:
        instance = super().__new__(cls)
        declared = cls.option_names()
        given = {k: v for k, v in kwargs.items() if k in declared}
        instance._options = {**declared, **given}  # as constructed: saved in the configuration
        return instance

    @property
    def option_values(self) -> dict[str, Any]:
        """This ordering's own options, as constructed (defaults filled in)."""
        return dict(self._options)

    @classmethod
    def option_names(cls) -> dict[str, Any]:
        """This ordering's own options and their defaults, read from the ``__init__`` chain."""
        found: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            init = klass.__dict__.get("__init__")
            if klass is Ordering or init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name not in _BASE_OPTIONS:
                    found[p.name] = p.default
        return found

    def initial_order(self, epoch: int) -> torch.Tensor:
        """The order of the first epoch, numbered ``epoch``."""
        if self.random_first_epoch:
            return random_permutation(self.n, self.seed, epoch, PURPOSE_FIRST_EPOCH)
        return torch.arange(self.n)

    def renumber(self, epoch: int, order: torch.Tensor) -> torch.Tensor:
        """The order of a not-yet-started epoch after ``set_epoch`` changed its number."""
        return order

    def start_epoch(self, epoch: int) -> None:
        """Called when an epoch begins; balancers reset their running sums here."""

    def observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        """Take the gradients of the examples ``indices`` (B,), given in visit order."""

    @abstractmethod
    def finish_epoch(self, order: torch.Tensor, next_epoch: int) -> torch.Tensor:
        """The next epoch's order, from this epoch's ``order`` and what was observed.

        Examples of ``order`` that were never observed (an epoch abandoned part-way, a dropped
        last batch) keep their relative order; where they go is up to the ordering.
        """

    def update_v(self, second_moment: torch.Tensor) -> None:
        """Take the optimiser's second moment, a flat (d,) tensor: for orderings that balance in
        an adaptive optimiser's geometry (``"adamean"``); the others refuse it."""
        raise TypeError(
            f'update_v() is for balance_type="adamean", but this sampler uses "{self.name}".'
        )

    @property
    def state_owner(self) -> str:
        return f'balance_type="{self.name}"'

    def __repr__(self) -> str:
        rule = self.rule
        walk = f", probabilistic=True, c={rule.c}" if rule.probabilistic else ""
        options = "".join(f", {k}={_short(v)}" for k, v in self.option_values.items())
        return f"{type(self).__name__}(n={self.n}, seed={self.seed}{walk}{options})"


_BASE_OPTIONS = ("seed", "rule", "random_first_epoch", "block_policy")


def _short(value: Any) -> str:
    return f"tensor{tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


#: balance_type name -> ordering class; ``register_ordering`` adds to it
ORDERINGS: dict[str, type[Ordering]] = {}

_O = TypeVar("_O", bound=type[Ordering])


def register_ordering(cls: _O) -> _O:
    """Class decorator: make ``cls`` available as ``GraBSampler(balance_type=cls.name)``."""
    if not (isinstance(cls, type) and issubclass(cls, Ordering)):
        raise TypeError(f"register_ordering expects an Ordering subclass, but got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name` (its balance_type)")
    if ORDERINGS.get(name, cls) is not cls:
        raise ValueError(
            f"balance_type {name!r} is already registered by {ORDERINGS[name].__name__}; "
            "choose another name."
        )
    ORDERINGS[name] = cls
    return cls


def observe_in_blocks(ordering: Ordering, batch: GradientBatch, indices: torch.Tensor) -> None:
    """``ordering.observe``, in blocks of ``policy.observe_rows`` rows for the orderings whose
    decisions do not depend on the cut (``splittable``), so no (B, B) Gram gets large."""
    rows = ordering.policy.observe_rows
    if not ordering.splittable or batch.size <= rows:
        ordering.observe(batch, indices)
        return
    start = 0
    for block in batch.split(rows):
        ordering.observe(block, indices[start : start + block.size])
        start += block.size


class IndexTensor:
    """An int64 tensor copy of a growing list of indices, extended by what was appended since
    the last call: the sampler publishes its state after every step, so this keeps that O(batch)
    instead of O(n). The views it returns share one buffer (reused after a reset)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.int64)
        self._host = self.buffer.numpy()  # the same memory: written without a torch op per step
        self.done = 0

    def reset(self) -> None:
        self.done = 0

    def view(self, items: list[int]) -> torch.Tensor:
        count = len(items)
        if count < self.done:  # the list was replaced or cleared behind our back
            self.done = 0
        if self.buffer.numel() < count:
            grown = torch.empty(max(count, 2 * self.buffer.numel()), dtype=torch.int64)
            grown[: self.done] = self.buffer[: self.done]
            self.buffer, self._host = grown, grown.numpy()
        if count > self.done:
            self._host[self.done : count] = items[self.done :]
        self.done = count
        return self.buffer[:count]


class FrontBackOrder(Stateful):
    """The GraB placement: +1 examples to the front in visit order, -1 examples to the back in
    reverse visit order, unobserved examples in between in their previous relative order."""

    front: list[int]
    back: list[int]

    def __init__(self) -> None:
        self._front_tensor, self._back_tensor = IndexTensor(), IndexTensor()
        self.add_state("front", [], save=self._front_tensor.view, load=int_list)
        self.add_state("back", [], save=self._back_tensor.view, load=int_list)

    def clear(self) -> None:
        self.front.clear()
        self.back.clear()
        self._front_tensor.reset()
        self._back_tensor.reset()

    def place(self, indices: list[int], signs: np.ndarray) -> None:
        for index, eps in zip(indices, signs.tolist(), strict=True):
            (self.front if eps > 0 else self.back).append(index)

    def build(self, order: torch.Tensor) -> torch.Tensor:
        placed = set(self.front) | set(self.back)
        middle = [i for i in order.tolist() if i not in placed]
        return torch.tensor(self.front + middle + self.back[::-1], dtype=torch.int64)

    def after_load(self) -> None:
        self._front_tensor.reset()
        self._back_tensor.reset()
