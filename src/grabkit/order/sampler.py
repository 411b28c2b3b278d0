"""``GraBSampler``: a ``torch.utils.data.Sampler`` whose order is decided by per-example gradients.

The sampler holds three parts and keeps the epochs: an ordering (``grabkit.order.orderings``),
a gradient source (``grabkit.order.sources``: the per-example gradients given to
``step(grads)``, grab-sampler's way, or hook statistics read after the backward(s), no (B, d)
tensor ever built) and a chain of transforms (``grabkit.order.transforms``). A step's data goes
source -> transforms -> ordering, each stage a method of the next part:

    GraBSampler.step(grads, grad_scale=...)
      source.batches(grads)          GradientBatch pieces, one per backward (wrapped once),
                                     divided by a loss scale (``GradientBatch.divided``)
      first_position(...)            where they sit in the epoch (checked before anything moves)
      transforms(Rows(piece, ...))   Cast / Project / GatherAcrossRanks / Normalize, as built
      ordering.observe(batch, idx)   the decisions (grabkit.order.balance: one host transfer)

See the class docstring for the loops.

A batch that is not stepped (a NaN loss) is ``sampler.skip(len(batch))``, or pass the indices
of each stepped batch, ``step(grads, indices=idx)``; skipped examples get no decision that epoch.

Epoch semantics. ``iter(sampler)`` starts a new epoch when the current one has begun (anything
yielded or stepped); otherwise it restarts the current one (so ``iter()`` twice in a row yields
the same order). Each ``step`` takes the gradients of the next examples of the epoch in visit
order. At the start of the next epoch the ordering turns what it saw into the new order;
examples never stepped (an epoch abandoned part-way, a dropped last batch) keep their relative
order (GraB orderings put them between the front and the back part). ``set_epoch(e)`` numbers the
next epoch (it seeds the random parts: random reshuffling, the first order, probabilistic
balancing), as with ``DistributedSampler``.

Distributed use follows ``DistributedSampler`` (``grabkit.order.distributed`` says how the ranks
pad the order and decide as one process). Resuming: see ``grabkit.order.state``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from grabkit.integrations.wiring import check_sampler_iteration
from grabkit.order import distributed as collective
from grabkit.order.balance import NON_FINITE_HELP, SignRule
from grabkit.order.keywords import sampler_parts
from grabkit.order.orderings import Ordering
from grabkit.order.orderings.base import observe_in_blocks
from grabkit.order.positions import first_position, skip_count
from grabkit.order.sources import (
    HOOK_SAMPLER_NOT_PICKLABLE,
    DenseGradients,
    Gradients,
    GradientSource,
    LossScaler,
    StatisticsReader,
    loss_scale,
)
from grabkit.order.state import BATCHING_KEYS, adopt_rank, plain_config, read_state
from grabkit.order.topology import Setting, Topology, dataset_size
from grabkit.order.transforms import Chain, GatherAcrossRanks, Rows, Transform
from grabkit.state import Stateful
from grabkit.stats.gradient_batch import GradientBatch, named_to_flat
from grabkit.validation import check_bool, check_non_negative_int, check_positive_int

__all__ = ["GraBSampler"]

_STATE_VERSION = 2

#: what the configuration records for the transforms when the chain holds none of them
_NO_TRANSFORMS = {"normalize": False, "projection": None, "projection_dim": None, "pi_eps": 0.1}


class GraBSampler(Sampler[int], Stateful):
    """Order a dataset's examples by herding their gradients (GraB) or by a baseline ordering.

    The sampler is three parts and the epoch bookkeeping around them:

    * ``ordering`` (``grabkit.order.orderings``): what decides the next epoch's order from the
      gradients it observes (``MeanBalance(n)``, ``RecursiveBalance(n, depth=3)``, ... with their
      own options, seed and sign rule);
    * ``source`` (``grabkit.order.sources``): where each step's per-example gradients come
      from: ``DenseGradients()`` (given to ``step(grads)``; the default), ``ExactHooks(model)``
      or ``SketchHooks(model, dim)`` (read from hooks after the backward), or
      ``HookGradients(stats)`` (a statistics object of yours);
    * ``transforms`` (``grabkit.order.transforms``): what happens to the gradients on the way,
      in order: ``Cast``, ``Project``, ``GatherAcrossRanks``, ``Normalize``. With several ranks
      the exchange is appended when the chain has none.

    Args:
        data_source: the dataset (only ``len()`` is used).
        ordering: an ``Ordering`` instance built for ``len(data_source)`` examples.
        source: a ``GradientSource`` (default ``DenseGradients()``).
        transforms: ``Transform`` instances, applied in order (default none).
        num_replicas: as ``torch.utils.data.DistributedSampler``; defaults to the initialised
            process group's size (else 1).
        rank: as ``DistributedSampler``; defaults to this process's rank (else 0).
        drop_last: as ``DistributedSampler`` (the seed is the ordering's).
        batch_size: the loader's batch size: lets hook mode check that a backward covered
            the whole yielded batch, and sets ``skip()``'s default.
        record_orders: keep every epoch's order in ``orders_history``.
        **keywords: the keyword form instead of the parts, grabkit's or grab-sampler's
            spellings (``grabkit.order.keywords`` maps each to its part): ``balance_type``
            (a registered name, ``"mean"`` by default, or a ``BalanceType``), ``seed``,
            ``probabilistic``/``prob_balance``, ``prob_balance_c``, ``random_first_epoch``,
            ``block_policy`` and the ordering's own options (``depth``, ``ema_decay``, ...; an
            option of another ordering raises); ``params``/``trainable_params`` (or as the
            second positional argument, as in grab-sampler), ``model``, ``stats``,
            ``loss_reduction``, ``stats_options``, ``statistics`` (``"exact"`` or
            ``"sketch"``), ``sketch_dim``; ``dtype``, ``device``, ``projection``/
            ``random_projection``, ``projection_dim``, ``pi_eps``, ``kron_order``,
            ``normalize``/``normalize_grads``.

    Example (grab-sampler's functional form)::

        sampler = GraBSampler(dataset, params)  # balance_type="mean" (vanilla GraB)
        for x, y in DataLoader(dataset, sampler=sampler, batch_size=16):
            sampler.step(vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y))
            ...  # optimiser update

    Example (hook mode, gradient accumulation over two micro-batches; the keyword form
    ``GraBSampler(dataset, model=model, balance_type="pair", batch_size=32)`` builds the
    same parts)::

        ordering = PairBalance(len(dataset), seed=0)
        with GraBSampler(dataset, ordering, ExactHooks(model), batch_size=32) as sampler:
            loader = DataLoader(dataset, sampler=sampler, batch_size=32)
            for epoch in range(epochs):
                for x, y in loader:
                    for xm, ym in zip(x.chunk(2), y.chunk(2)):
                        (loss_fn(model(xm), ym) / 2).backward()
                    sampler.step()  # both micro-batches, each to its own examples
                    optimizer.step()
                    optimizer.zero_grad()
    """

    def __init__(
        self,
        data_source: Sized,
        ordering: Ordering | Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None,
        source: GradientSource | None = None,
        *,
        transforms: Iterable[Transform] = (),
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        batch_size: int = 1,
        record_orders: bool = False,
        **keywords: Any,
    ) -> None:
        self.n = dataset_size(data_source)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.drop_last = check_bool("drop_last", drop_last)
        self.topology = Topology.of(self.n, num_replicas, rank, self.drop_last)
        if keywords or not isinstance(ordering, Ordering):
            if ordering is not None and not isinstance(ordering, Ordering):
                keywords = {**keywords, "params": ordering}  # grab-sampler: (dataset, params)
                ordering = None
            parts = sampler_parts(
                self.n, ordering, source, transforms, keywords, self.topology.num_replicas
            )
            ordering, source, transforms = parts.ordering, parts.source, parts.transforms
        self.ordering: Ordering = _checked_ordering(ordering, self.n)
        self.source: GradientSource = DenseGradients() if source is None else source
        if not isinstance(self.source, GradientSource):
            raise TypeError(
                "`source` should be a GradientSource (DenseGradients(), ExactHooks(model), "
                f"SketchHooks(model), HookGradients(stats)), but got {type(source).__name__}"
            )
        self.transforms = Chain(transforms)
        if self.topology.num_replicas > 1 and not self.transforms.has(GatherAcrossRanks):
            self.transforms = Chain((*self.transforms.transforms, GatherAcrossRanks()))
        setting = Setting(self.n, self.ordering.seed, self.topology)
        self.transforms.bind(setting)
        self._config = self._configuration()
        self.source.bind(self.ordering, self.transforms, setting)  # attaches hooks: last
        self._config.update(plain_config(**self.source.config()))
        self._agreed = False  # the one cross-rank configuration check (first iter())
        self.record_orders = bool(record_orders)
        self.orders_history: list[list[int]] = []
        self._declare_state()
        self._begin(0, self.ordering.initial_order(0))
        self._resume = False
        self._token = 0
        #: the most examples left handed out but unstepped after a step() of this iteration
        self._in_flight: int | None = None
        self._numbered: int | None = None  # set_epoch's next epoch since the last iter()
        #: after load_state_dict, until the next iter(): the lowest number the resumed loop
        #: may give the epoch it resumes (the saved one, or the next after an ended epoch)
        self._resumed_epoch: int | None = None

    def _declare_state(self) -> None:
        """The live part of the state (shared by every ``state_dict()``, refreshed after each
        change; see "Resuming" in ``grabkit.order.state``). The position (epoch, yielded,
        started) is a snapshot taken by ``state_dict()`` itself."""
        self._live: dict[str, Any] = {}
        #: references to ``_live`` while no ``state_dict()`` handed out holds it (see _publish)
        self._live_unshared = sys.getrefcount(self._live)
        self._live_stale = True
        self.add_state("epoch", 0, attribute="_epoch", load=int)
        self.add_state("stepped", 0, attribute="_stepped", load=int)
        self.add_state("requested_epoch", None, attribute="_requested_epoch", load=_maybe_int)
        self.add_state("finished_any", False, attribute="_finished_any", load=bool)
        self.add_state("order", torch.arange(self.n), attribute="_order", load=_index_copy)
        self.add_state("rule")  # the ordering's sign rule
        self.add_state("ordering")
        self.add_state("orders_history", [], attribute="_history", save=list, load=_tensors)

    def _configuration(self) -> dict[str, Any]:
        """Every setting that changes the orders, as plain data (a loaded state must match)."""
        rule = self.ordering.rule
        return plain_config(
            n=self.n, num_replicas=self.num_replicas, rank=self.rank,
            balance_type=self.ordering.name, seed=self.seed, drop_last=self.drop_last,
            probabilistic=rule.probabilistic, prob_balance_c=rule.c,
            **{**_NO_TRANSFORMS, **self.transforms.config()},
            random_first_epoch=self.ordering.random_first_epoch,
            options=self.ordering.option_values,
        )  # fmt: skip

    # -- the parts, by the names grabkit has always used -----------------------------------
    @property
    def balance_type(self) -> str:
        """The ordering's registered name."""
        return self.ordering.name

    @property
    def rule(self) -> SignRule:
        """The ordering's sign rule."""
        return self.ordering.rule

    @property
    def seed(self) -> int:
        """The ordering's seed; every random choice of the sampler derives from it."""
        return self.ordering.seed

    @property
    def stats(self) -> StatisticsReader | None:
        """The statistics object hook mode reads (None when gradients are passed to ``step``)."""
        return self.source.statistics

    @property
    def statistics(self) -> str:
        """``"sketch"`` when the source balances sketches, else ``"exact"``."""
        return "sketch" if self.source.sketched else "exact"

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def num_samples(self) -> int:
        """How many examples this rank yields per epoch."""
        return self.topology.num_samples

    @property
    def total_size(self) -> int:
        """The padded (or truncated) length of an epoch over all ranks."""
        return self.topology.total_size

    # -- epochs ------------------------------------------------------------------------------
    def _begin(self, epoch: int, order: torch.Tensor) -> None:
        self._epoch = epoch
        self._order = order.to(torch.int64).cpu()
        self._yielded = self._stepped = 0
        self._largest_step = 0  # the most examples one step() of this epoch took
        self._started = False
        self._requested_epoch = None
        self.ordering.start_epoch(epoch)
        self.rule.start_epoch(self.seed, epoch)
        if self.record_orders:
            self.orders_history.append(self._order.tolist())
            self._history.append(self._order)
        self._publish()

    def _advance(self) -> None:
        if self._yielded == 0 and 0 < self._stepped < self.num_samples:
            raise ValueError(
                f"iter(sampler) would end epoch {self._epoch} after step() balanced "
                f"{self._stepped} of its {self.num_samples} examples, none of which were handed "
                f"out: step() ran before the first iter() of the epoch (a warm-up backward on a "
                f"batch the sampler did not yield?), so its gradients went to examples of the "
                f"epoch's order, and the loop's first epoch would not be balanced. Call "
                f"iter(sampler) (start the loader) before stepping; to drive the sampler by its "
                f"order without a loader, step every example of the epoch (or skip() the rest) "
                f"before iter(). Nothing changed."
            )
        if self._stepped == 0 and self._yielded and self.ordering.uses_gradients:
            warnings.warn(
                f"GraBSampler epoch {self._epoch} ended with no step() at all, so "
                f'balance_type="{self.balance_type}" saw no gradient and keeps the order. Call '
                "sampler.step(...) after each backward (see the GraBSampler docstring).",
                stacklevel=3,
            )
        self._warn_batch_left_out()
        epoch = self._epoch + 1 if self._requested_epoch is None else self._requested_epoch
        order = self.ordering.finish_epoch(self._order, epoch)
        self._finished_any = True
        self._begin(epoch, order)

    def _warn_batch_left_out(self) -> None:
        """An epoch handed out whole but stepped short by at least a batch (the loader's
        ``batch_size``, else the largest step's): a batch left out without ``skip()`` before
        the epoch's first step, which cannot be told from a loader fetching ahead then (every
        later attribution of the epoch went one batch early), or a loop that stopped the epoch
        early. A loader's dropped partial batch is shorter than a batch and passes."""
        batch = self.batch_size if self.batch_size > 1 else self._largest_step
        unstepped = self.num_samples - self._stepped
        if not (self._stepped and self._yielded == self.num_samples and unstepped >= batch > 0):
            return
        warnings.warn(
            f"GraBSampler epoch {self._epoch} ended with {unstepped} of the "
            f"{self.num_samples} examples it handed out never stepped: a whole batch or more. "
            "A batch left out without sampler.skip() (a `continue` before its backward) shifts "
            "every later step's gradients onto the examples handed out before them, and before "
            "the epoch's first step it cannot be told from the loader fetching ahead; call "
            "sampler.skip() for every batch you leave out. (A loop that stops its epochs early "
            "on purpose can ignore this.)",
            stacklevel=4,
        )

    @property
    def epoch(self) -> int:
        """The number of the current epoch."""
        return self._epoch

    @property
    def order(self) -> torch.Tensor:
        """The current epoch's global order, (n,) dataset indices."""
        return self._order.clone()

    def set_epoch(self, epoch: int) -> None:
        """Number the next epoch ``epoch`` (seeds its random parts), like DistributedSampler.

        Raises:
            ValueError: another number of the next epoch was set since the last ``iter()``
                (the number of the epoch under way aside): two loops number the epochs
                differently (accelerate's prepared loader numbers its sampler with its
                own count, which restarts at 0 after ``load_state``), and one would silently
                reseed the epoch with the other's number; or, after ``load_state_dict`` and
                before the next ``iter()``, a number below the epoch the state resumes (a loop
                numbering from 0 again: accelerate's count when the loop calls no
                ``loader.set_epoch``).
        """
        epoch = check_non_negative_int("epoch", epoch)
        if self._numbered is not None and epoch != self._numbered:
            raise ValueError(
                f"GraBSampler.set_epoch({epoch}) after set_epoch({self._numbered}) with no "
                "iter() between: two loops number this sampler's epochs differently, and the "
                "epoch's random parts would be seeded by the last one. accelerate's prepared "
                "DataLoader calls set_epoch with its own epoch count at each iter(), and that "
                "count restarts at 0 after load_state (and does not advance when a loop breaks "
                "out of an epoch); call loader.set_epoch(epoch) on the prepared loader instead "
                "of sampler.set_epoch(epoch), so that both agree."
            )
        self._check_resumed_number(epoch)
        self._numbered = None if epoch == self._epoch else epoch  # the epoch under way: no-op
        self._requested_epoch = epoch
        self._publish()

    def _check_resumed_number(self, epoch: int) -> None:
        """Refuse, between ``load_state_dict`` and the next ``iter()``, a number below the epoch
        the state resumes: the saved epoch (mid-epoch) or the next one (a state whose epoch
        ended). The uninterrupted run never numbers an epoch lower than one it trained, and such a
        number would abandon the untrained rest of a saved epoch or seed the next epoch's random
        parts (``prob_balance``, the padding of several ranks) as an earlier one's."""
        lowest = self._resumed_epoch
        if lowest is None or epoch >= lowest:
            return
        if lowest == self._epoch:
            where = (
                f"inside epoch {self._epoch} (its next iter() yields the epoch's untrained rest)"
            )
            effect = "abandon that rest untrained and train a whole epoch in its place"
        else:
            where = f"at the end of epoch {self._epoch} (its next iter() starts epoch {lowest})"
            effect = f"start epoch {lowest} under the number of an epoch already trained"
        raise ValueError(
            f"GraBSampler.set_epoch({epoch}) after load_state_dict of a state saved {where}: the "
            f"resumed run would {effect}, and seed its random parts as epoch {epoch}. "
            f"Number the resumed epochs from {lowest}. In an accelerate loop the prepared "
            "DataLoader numbers its sampler at each iter() with its own count, which restarts "
            "at 0 after load_state: call loader.set_epoch(epoch) on the prepared loader before "
            "each epoch, the loop running from step // len(loader) (accelerate's recipe). "
            "Nothing changed."
        )

    def _padded_order(self) -> torch.Tensor:
        return collective.padded_order(self._order, self.total_size, self.seed, self._epoch)

    def _local_indices(self) -> torch.Tensor:
        return self._padded_order()[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        check_sampler_iteration(self)  # a framework re-splitting or running it unintegrated
        if not self._agreed and collective.process_group_matches(self.num_replicas):
            collective.check_agreement({**self._config, "rank": None}, self.num_replicas)
            self._agreed = True
        if self._requested_epoch == self._epoch and (self._resume or not self._started):
            self._requested_epoch = None  # set_epoch(e) for the epoch already under way
        if self._resume and self._requested_epoch is not None:
            # a loop that numbers its epochs asked for the next one after the load: the rest of
            # the saved epoch is abandoned, as the uninterrupted run's iter() would abandon it
            self._resume = False
        if self._resume:
            self._resume = False
            # examples handed out before the snapshot and not stepped since were trained on
            # before it: no decision this epoch, and later gradients never go to them
            self._stepped = max(self._stepped, self._yielded)
        elif self._started:
            self._advance()
        else:
            if self._requested_epoch is not None and self._requested_epoch != self._epoch:
                e = self._requested_epoch
                order = (
                    self.ordering.renumber(e, self._order)
                    if self._finished_any
                    else self.ordering.initial_order(e)
                )
                if self.record_orders:
                    self.orders_history.pop()
                self._begin(e, order)
            self._yielded = 0
        self._token += 1
        self._in_flight = None
        self._numbered = self._resumed_epoch = None
        self._publish()
        return self._iterate(self._token, self._yielded, self._local_indices().tolist())

    def _iterate(self, token: int, start: int, local: list[int]) -> Iterator[int]:
        for position in range(start, len(local)):
            if self._token != token:  # a newer iter() took over
                return
            self._yielded = position + 1
            self._started = True
            yield local[position]

    def __len__(self) -> int:
        return self.num_samples

    # -- stepping ----------------------------------------------------------------------------
    def step(
        self,
        grads: Gradients | None = None,
        *,
        indices: torch.Tensor | Iterable[int] | None = None,
        grad_scale: float | LossScaler = 1.0,
    ) -> None:
        """Balance the next examples of the epoch, in visit order, with their gradients.

        Args:
            grads: per-example gradients of the examples this rank visited next: the dict of
                (B, ...) tensors that ``torch.func.vmap(torch.func.grad(f))`` returns, a (B, d)
                tensor, a ``GradientBatch``, or nothing in hook mode (then every backward since
                the last ``step()`` is balanced, in order: gradient accumulation works).
            indices: the B dataset indices these gradients belong to, as yielded (e.g. the
                ``idx`` column of the batch). Optional; with it, examples yielded before them
                and not stepped (a skipped batch) are passed over instead of receiving these
                gradients. Without it the gradients go to the next B unstepped examples.
            grad_scale: the factor the loss was multiplied by before its backward(s): with a
                ``torch.amp.GradScaler``, ``scaler.get_scale()`` or the scaler itself, read
                before ``scaler.update()``. The gradients are divided by it: a scale that
                changes between steps (growth, back-off) would otherwise weigh the steps
                differently in the balancing. An overflowing step's gradients are not finite
                and raise: ``skip()`` that batch, as the scaler skips its update.
        Raises:
            ValueError: more gradients than the epoch has examples left, indices that are not
                yielded examples in visit order, a gradient length that differs from
                ``params``, hook mode with no backward since the last step or a backward over
                another number of examples than a yielded batch, a batch left out since
                the last step without ``skip()`` (more examples handed out and unstepped than
                after any earlier step of the epoch's iteration), or NaN / Inf values. Nothing
                changes then.
        """
        factor = loss_scale(grad_scale)  # checked before anything is taken from the source
        pieces = self.source.batches(grads)  # (kept by the source until the step is balanced)
        if factor != 1.0:
            self.source.check_scale(factor)
        if not isinstance(grad_scale, (int, float)):  # a GradScaler (``loss_scale`` checked it)
            self.source.check_scaler(grad_scale)
        pieces = [piece.divided(factor) for piece in pieces]
        B = sum(int(piece.size) for piece in pieces)
        start = first_position(
            B, self._stepped, self._yielded, self.num_samples, self.batch_size, self._epoch,
            local=self._local_indices if indices is not None else None, indices=indices,
            hook=grads is None,
        )  # fmt: skip
        if indices is None:
            self._check_no_batch_left_out(start + B)
        if B and self.ordering.uses_gradients:
            _check_finite(pieces)
            position = start
            for piece in pieces:
                self._balance(piece, position)
                position += int(piece.size)
        for piece in pieces:
            piece.settle()  # a check no host transfer of the balancing settled (else nothing)
        self._stepped = start + B
        self._largest_step = max(self._largest_step, B)
        self._started = True
        if grads is None:
            self.source.clear()
        self._publish()

    def _check_no_batch_left_out(self, end: int) -> None:
        """Refuse a step after which more examples are handed out but unstepped than after any
        earlier step of this iteration. A loader holds a steady number ahead (none, or the
        batches its workers prefetch; a window of micro-batches fetched at once refills to the
        same), which only falls at the epoch's end; it grows by a batch when the loop left one
        out (``continue`` before its backward) without ``skip()``: this step's gradients would
        then go to the examples of the batch left out, and every later batch's likewise."""
        if not self._yielded:
            return  # stepped without iterating: nothing handed out to compare
        in_flight = self._yielded - end
        if self._in_flight is not None and in_flight > self._in_flight:
            raise ValueError(
                f"step(): {in_flight - self._in_flight} more examples were handed out and left "
                f"unstepped than after the previous step() (a batch left out: `continue` "
                f"before its backward, an exception caught), so these gradients would be "
                f"credited to the examples of the batch left out, and every later batch's to "
                f"those before them. Call sampler.skip() for a batch you leave out, or pass "
                f"the batch's dataset indices, step(indices=idx); nothing changed."
            )
        self._in_flight = in_flight if self._in_flight is None else max(self._in_flight, in_flight)

    def skip(self, count: int | None = None) -> None:
        """Give the next ``count`` unstepped examples no decision this epoch (a skipped batch).

        They keep their place between the front and the back part; the next ``step()`` balances
        the examples after them. ``count`` defaults to the rest of the current batch of
        ``batch_size`` (hook mode: the batch of the backwards since the last ``step()``).
        """
        kept = self.source.discard()
        count = skip_count(count, kept, self._stepped, self.num_samples, self.batch_size)
        self._stepped += count
        self._started = True
        self._publish()

    def _balance(self, batch: GradientBatch, position: int) -> None:
        """Observe one piece whose first row sits at this rank's visit ``position``: through
        the transforms, then to the ordering with the rows' dataset indices."""
        positions = self.topology.local_positions(position, batch.size)
        rows = self.transforms(Rows(batch, positions, position))
        order = self._order if self.num_replicas == 1 else self._padded_order()
        indices = order[rows.positions]
        if indices.numel():
            observe_in_blocks(self.ordering, rows.batch, indices)

    def update_v(self, second_moment: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """``"adamean"``: set v = sqrt(second moment) + eps from the optimiser (flat or dict)."""
        if self.source.sketched:
            raise TypeError(
                'update_v() scales gradient coordinates, but statistics="sketch" balances '
                "sketches, whose coordinates are random combinations of the gradient's; use "
                'statistics="exact" with per-example gradients passed to step() for "adamean".'
            )
        if isinstance(second_moment, Mapping):
            if isinstance(self.source, DenseGradients):  # the gradients' names and order
                second_moment = self.source.in_layout(second_moment, "update_v()", 0)
            second_moment = named_to_flat(second_moment)
        self.ordering.update_v(second_moment.reshape(-1))

    # -- state ------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Refresh the live ordering state that every ``state_dict()`` shares (references to
        the ordering's tensors, no copies: O(1) in the gradient length). While no state handed
        out is still held (nothing but the sampler refers to the live part, as in a loop that
        takes a state only to save it), it is only marked stale, and the next ``state_dict()``
        refreshes it: a training step does not rebuild a state nobody holds."""
        if sys.getrefcount(self._live) > self._live_unshared:
            self._refresh_live()
        else:
            self._live_stale = True

    def _refresh_live(self) -> None:
        self._live.update(super().state_dict())
        self._live_stale = False

    def state_dict(self) -> dict[str, Any]:
        """The position now (a snapshot) and the live ordering state (shared, not copied: it
        shows the latest ``step()``; see "Resuming" above). Plain data for ``torch.save`` and
        ``torch.load(weights_only=True)``; save it (or ``copy.deepcopy`` it) to freeze it."""
        if self._live_stale:
            self._refresh_live()
        return {
            "version": _STATE_VERSION,
            "config": dict(self._config),
            "epoch": self._epoch,
            "yielded": self._yielded,
            "started": self._started,
            "live": self._live,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``; the next ``iter()`` yields the rest of its epoch (an
        empty pass when the whole epoch had been yielded, as ``RandomSampler`` does), or starts
        the next epoch when the state says its epoch ``"ended"`` (a state taken at an epoch's
        last optimizer step: ``grabkit.integrations.resume``; see ``grabkit.order.state``).
        Several processes: any rank's state is every rank's (``adopt_rank``)."""
        state = adopt_rank(state, self.num_replicas, self.rank)
        if any(key in state.get("config", {}) for key in BATCHING_KEYS):  # the batch form's
            config = {k: v for k, v in state["config"].items() if k not in BATCHING_KEYS}
            state = {**state, "config": config}
        self.source.check_saved_config("GraBSampler", state, self._config)
        state = read_state(
            "GraBSampler", state, self._config, _STATE_VERSION, self.num_samples,
            permutation=self.balance_type != "swr",
        )  # fmt: skip
        super().load_state_dict(state["live"])
        self._yielded = int(state["yielded"])
        self._started = bool(state["started"]) or self._stepped > 0
        self.orders_history = [o.tolist() for o in self._history]
        self._resume = self._started and not state.get("ended", False)
        self._numbered = None
        self._resumed_epoch = self._epoch + int(self._started and not self._resume)
        self.source.after_load()
        self._token += 1
        self._in_flight = None
        self._publish()

    def close(self) -> None:
        """Stop reading hook statistics; remove the hooks the sampler attached (``model=``)."""
        self.source.close()

    def __getstate__(self) -> dict[str, Any]:  # hooks live on this process's model only
        if self.source.reads_hooks:
            raise TypeError(HOOK_SAMPLER_NOT_PICKLABLE)
        return self.__dict__

    def __enter__(self) -> GraBSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _maybe_int(value: int | None) -> int | None:
    return None if value is None else int(value)


def _index_copy(order: torch.Tensor) -> torch.Tensor:
    return order.to(torch.int64).cpu().clone()


def _tensors(history: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.as_tensor(o) for o in history]


def _checked_ordering(ordering: Ordering, n: int) -> Ordering:
    if not isinstance(ordering, Ordering):
        raise TypeError(
            f"`ordering` should be an Ordering instance (e.g. PairBalance(len(dataset))), "
            f"but got {type(ordering).__name__}"
        )
    if ordering.n != n:
        raise ValueError(
            f"`ordering` was built for n={ordering.n} examples but the dataset has {n}"
        )
    return ordering


def _check_finite(pieces: list[GradientBatch]) -> None:
    """Reject NaN / Inf in any of several micro-batches before the first changes any state (one
    piece is checked by the balancing itself, at no extra cost)."""
    if len(pieces) > 1:
        for piece in pieces:
            norms = piece.to_host(piece.norms_squared())  # a host sync (and the piece's check)
            if not np.isfinite(norms).all():
                raise ValueError(NON_FINITE_HELP)
