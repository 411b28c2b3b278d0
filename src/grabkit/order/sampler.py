"""``GraBSampler``: a ``torch.utils.data.Sampler`` whose order is decided by per-example gradients.

Two ways to feed it: the per-example gradients given to ``step(grads)`` (grab-sampler's way), or
hook statistics (``model=``: ``step()`` after the backward(s), no (B, d) tensor ever built); see
the class docstring for both loops.

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

import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from grabkit.order import distributed as collective
from grabkit.order.balance import BlockPolicy, SignRule
from grabkit.order.configure import (
    HOOK_SAMPLER_NOT_PICKLABLE,
    BatchPreparer,
    Topology,
    attach_statistics,
    build_ordering,
    dataset_size,
    flat_second_moment,
    merge_grab_sampler_keywords,
    param_dim,
    positive_int,
    statistics_choice,
)
from grabkit.order.orderings import Ordering
from grabkit.order.orderings.base import observe_in_blocks
from grabkit.order.positions import first_position, skip_count
from grabkit.order.sources import HookSource, check_finite, step_pieces
from grabkit.order.state import plain_config, read_state
from grabkit.stats.gradient_batch import GradientBatch

__all__ = ["GraBSampler"]

_STATE_VERSION = 2


class GraBSampler(Sampler[int]):
    """Order a dataset's examples by herding their gradients (GraB) or by a baseline ordering.

    Args:
        data_source: the dataset (only ``len()`` is used).
        params: the trainable parameters (dict name -> tensor, or an iterable of tensors);
            only their total size d is used, to check the gradients. Optional.
        model: hook mode: a ``torch.nn.Module``; the sampler installs
            ``grabkit.stats.PerSampleStats(model, loss_reduction=loss_reduction)`` (``close()``
            removes it) and ``step()`` without arguments balances its per-example statistics.
        stats: hook mode with your own statistics object (anything with ``gradient_batch()``).
        balance_type: a registered ordering by its grab-sampler name (``grabkit.order.
            BALANCE_TYPES``: ``"mean"`` (default), ``"pair"``, ``"recursive"``, ...) or a
            ``BalanceType`` member.
        ordering: an ``Ordering`` instance instead, e.g. ``PairBalance(len(dataset))``; its own
            seed and sign rule are used.
        batch_size: the loader's batch size: lets hook mode check that a backward covered
            the whole yielded batch, and sets ``skip()``'s default.
        probabilistic: self-balancing walk instead of the greedy sign.
        prob_balance_c: the walk's constant; ``None`` or ``"auto"`` is scale-aware (see
            ``grabkit.order.balance.SignRule``).
        projection: ``None``, ``"gaussian"``, ``"sparse"``, ``"kronecker"`` or a callable
            (B, d) -> (B, k): random projection applied to dense batches before balancing.
        projection_dim, pi_eps, kron_order: k (default: the Johnson-Lindenstrauss dimension
            for ``pi_eps``, capped at d); ``kron_order`` must be 2.
        normalize: balance g_i / ||g_i||.
        num_replicas, rank, drop_last, seed: as ``torch.utils.data.DistributedSampler``;
            ``num_replicas``/``rank`` default to the initialised process group (else 1 and 0).
        random_first_epoch: the first epoch in a random order (else 0..n-1).
        dtype, device: move dense gradients there before balancing (default: as given).
        record_orders: keep every epoch's order in ``orders_history``.
        loss_reduction: hook mode: ``"mean"`` or ``"sum"``, how the loss was reduced.
        block_policy: how dense batches are cut for balancing (``grabkit.order.balance.
            BlockPolicy``); tuning only, the orders do not depend on it.
        stats_options: hook mode: keywords passed on to ``PerSampleStats`` (e.g.
            ``{"torch_func_fallback": True}``).
        statistics: hook mode: ``"exact"`` (default; one process) or ``"sketch"``, a (B, k)
            random sketch of every example's gradient from the same hooks (unbiased inner
            products, error about sqrt(2 / k) |g_i| |g_j|; ``grabkit.stats.sketch``): every
            ordering then runs in hook mode, cheaper, and on several ranks (seeded by ``seed``).
        sketch_dim: k for ``statistics="sketch"`` (default 1024; a power of two or a square).
        **options: the ordering's own options (``depth`` of ``"recursive"``, ``ema_decay``,
            ``betas``, ``eps``, ``orders``, ``descending_norm``, the NTK family's, ...: see
            ``Ordering.option_names()``; options of other orderings are ignored, as in
            grab-sampler) and grab-sampler's spellings ``trainable_params``, ``prob_balance``,
            ``normalize_grads``, ``random_projection`` (``grabkit.order.compat``).

    Example (grab-sampler's functional form)::

        sampler = GraBSampler(dataset, params)  # balance_type="mean" (vanilla GraB)
        for x, y in DataLoader(dataset, sampler=sampler, batch_size=16):
            sampler.step(vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y))
            ...  # optimiser update

    Example (hook mode, gradient accumulation over two micro-batches)::

        with GraBSampler(dataset, model=model, batch_size=32) as sampler:
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
        params: Mapping[str, torch.Tensor] | Any = None,
        *,
        model: torch.nn.Module | None = None,
        stats: Any = None,
        balance_type: str | Any = "mean",
        ordering: Ordering | None = None,
        batch_size: int = 1,
        probabilistic: bool | None = None,
        prob_balance_c: float | str | None = None,
        projection: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
        projection_dim: int | None = None,
        pi_eps: float = 0.1,
        kron_order: int = 2,
        normalize: bool | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        random_first_epoch: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        record_orders: bool = False,
        loss_reduction: str = "mean",
        block_policy: BlockPolicy | None = None,
        stats_options: dict[str, Any] | None = None,
        statistics: str = "exact",
        sketch_dim: int | None = None,
        **options: Any,
    ) -> None:
        self.n = dataset_size(data_source)
        given = {"params": params, "probabilistic": probabilistic, "normalize": normalize}
        given["projection"] = projection
        merge_grab_sampler_keywords(given, options)
        self.batch_size = positive_int("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"`seed` should be an int, but got seed={seed!r}")
        self.drop_last = bool(drop_last)
        self.normalize = bool(given["normalize"])
        self.topology = Topology.of(self.n, num_replicas, rank, self.drop_last)
        self.num_replicas, self.rank = self.topology.num_replicas, self.topology.rank
        self.num_samples, self.total_size = self.topology.num_samples, self.topology.total_size
        self.dim = param_dim(given["params"], model)
        rule = SignRule(bool(given["probabilistic"]), prob_balance_c)
        explicit = {"probabilistic": given["probabilistic"], "prob_balance_c": prob_balance_c}
        explicit.update(seed=seed or None, random_first_epoch=None if random_first_epoch else 0)
        explicit["balance_type"] = None if balance_type == "mean" else balance_type
        self.ordering: Ordering = build_ordering(
            ordering, balance_type, self.n, seed=seed, rule=rule, explicit=explicit,
            random_first_epoch=bool(random_first_epoch), block_policy=block_policy, options=options,
        )  # fmt: skip
        self.balance_type, self.rule = self.ordering.name, self.ordering.rule
        self.seed = self.ordering.seed
        self.prepare = BatchPreparer(
            self.n, self.seed, given["projection"], projection_dim, pi_eps, kron_order, dtype,
            device,
        )  # fmt: skip
        self.projection_kind = given["projection"]
        self.statistics, self._owns_stats = statistics, model is not None and stats is None
        self.sketch_dim = statistics_choice(
            statistics, sketch_dim, self._owns_stats, self.projection_kind, self.num_replicas
        )
        self.stats = stats if not self._owns_stats else attach_statistics(
            model, loss_reduction, self.ordering, self.projection_kind, stats_options,
            sketch_dim=self.sketch_dim, seed=self.seed,
        )  # fmt: skip
        self.source = None if self.stats is None else HookSource(self.stats)
        self._config = plain_config(
            n=self.n, dim=self.dim, num_replicas=self.num_replicas, rank=self.rank,
            balance_type=self.balance_type, seed=self.seed, drop_last=self.drop_last,
            probabilistic=self.rule.probabilistic, prob_balance_c=self.rule.c,
            normalize=self.normalize, projection=self.projection_kind,
            projection_dim=projection_dim, pi_eps=pi_eps,
            random_first_epoch=self.ordering.random_first_epoch,
            options=self.ordering.option_values,
        )  # fmt: skip
        if self.sketch_dim is not None:  # recorded only in sketch mode: exact states load as before
            self._config.update(statistics="sketch", **self.stats.sketch.config)
        self._agreed = False  # the one cross-rank configuration check (first iter())
        self.record_orders = bool(record_orders)
        self.orders_history: list[list[int]] = []
        self._epoch = 0
        self._requested_epoch: int | None = None
        self._finished_any = False
        self._live: dict[str, Any] = {}  # the ordering state every state_dict() shares
        self._history: list[torch.Tensor] = []
        self._begin(0, self.ordering.initial_order(0))
        self._resume = False
        self._token = 0

    # -- epochs ------------------------------------------------------------------------------
    def _begin(self, epoch: int, order: torch.Tensor) -> None:
        self._epoch = epoch
        self._order = order.to(torch.int64).cpu()
        self._yielded = self._stepped = 0
        self._started = False
        self._requested_epoch = None
        self.ordering.start_epoch(epoch)
        self.rule.start_epoch(self.seed, epoch)
        if self.record_orders:
            self.orders_history.append(self._order.tolist())
            self._history.append(self._order)
        self._publish()

    def _advance(self) -> None:
        if self._stepped == 0 and self._yielded and self.ordering.uses_gradients:
            warnings.warn(
                f"GraBSampler epoch {self._epoch} ended with no step() at all, so "
                f'balance_type="{self.balance_type}" saw no gradient and keeps the order. Call '
                "sampler.step(...) after each backward (see the GraBSampler docstring).",
                stacklevel=3,
            )
        epoch = self._epoch + 1 if self._requested_epoch is None else self._requested_epoch
        order = self.ordering.finish_epoch(self._order, epoch)
        self._finished_any = True
        self._begin(epoch, order)

    @property
    def epoch(self) -> int:
        """The number of the current epoch."""
        return self._epoch

    @property
    def order(self) -> torch.Tensor:
        """The current epoch's global order, (n,) dataset indices."""
        return self._order.clone()

    def set_epoch(self, epoch: int) -> None:
        """Number the next epoch ``epoch`` (seeds its random parts), like DistributedSampler."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"`epoch` should be a non-negative integer, but got epoch={epoch!r}")
        self._requested_epoch = epoch
        self._publish()

    def _padded_order(self) -> torch.Tensor:
        return collective.padded_order(self._order, self.total_size, self.seed, self._epoch)

    def _local_indices(self) -> torch.Tensor:
        return self._padded_order()[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if not self._agreed and collective.process_group_matches(self.num_replicas):
            collective.check_agreement({**self._config, "rank": None}, self.num_replicas)
            self._agreed = True
        if self._requested_epoch == self._epoch and (self._resume or not self._started):
            self._requested_epoch = None  # set_epoch(e) for the epoch already under way
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
    def step(self, grads: Any = None, *, indices: Any = None) -> None:
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
        Raises:
            ValueError: more gradients than the epoch has examples left, indices that are not
                yielded examples in visit order, a gradient length that differs from
                ``params``, hook mode with no backward since the last step or a backward over
                another number of examples than a yielded batch, or NaN / Inf values. Nothing
                changes then.
        """
        pieces = step_pieces(grads, self.source, self.dim, self.sketch_dim)
        B = sum(int(piece.size) for piece in pieces)
        start = first_position(
            B, self._stepped, self._yielded, self.num_samples, self.batch_size, self._epoch,
            local=self._local_indices if indices is not None else None, indices=indices,
            hook=grads is None,
        )  # fmt: skip
        if B and self.ordering.uses_gradients:
            check_finite(pieces)
            position = start
            for piece in pieces:
                self._balance(piece, position)
                position += int(piece.size)
        self._stepped = start + B
        self._started = True
        if self.source is not None and grads is None:
            self.source.clear()
        self._publish()

    def skip(self, count: int | None = None) -> None:
        """Give the next ``count`` unstepped examples no decision this epoch (a skipped batch).

        They keep their place between the front and the back part; the next ``step()`` balances
        the examples after them. ``count`` defaults to the rest of the current batch of
        ``batch_size`` (hook mode: the batch of the backwards since the last ``step()``).
        """
        kept = self.source.discard() if self.source is not None else 0
        count = skip_count(count, kept, self._stepped, self.num_samples, self.batch_size)
        self._stepped += count
        self._started = True
        self._publish()

    def _balance(self, batch: GradientBatch, position: int) -> None:
        """Observe one piece whose first row sits at local ``position``."""
        B = int(batch.size)
        batch = self.prepare(batch)
        if self.num_replicas == 1 and position + B <= min(self.n, self._order.numel()):
            indices = self._order[position : position + B]  # no padding reached
        else:
            batch, indices = collective.global_rows(
                batch, position, self.num_replicas, self.n, self._padded_order()
            )
        if self.normalize:
            batch = batch.normalized()
        if indices.numel():
            observe_in_blocks(self.ordering, batch, indices)

    def update_v(self, second_moment: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """``"adamean"``: set v = sqrt(second moment) + eps from the optimiser (flat or dict)."""
        flat = flat_second_moment(self.ordering, self.sketch_dim, second_moment)  # checks first
        self.ordering.update_v(flat)

    # -- state ------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Refresh the live ordering state that every ``state_dict()`` shares (references to
        the ordering's tensors, no copies: O(1) in the gradient length)."""
        self._live.update(
            epoch=self._epoch,
            stepped=self._stepped,
            requested_epoch=self._requested_epoch,
            finished_any=self._finished_any,
            order=self._order,
            rule=self.rule.state_dict(),
            ordering=self.ordering.state_dict(),
            orders_history=list(self._history),
        )

    def state_dict(self) -> dict[str, Any]:
        """The position now (a snapshot) and the live ordering state (shared, not copied: it
        shows the latest ``step()``; see "Resuming" above). Plain data for ``torch.save`` and
        ``torch.load(weights_only=True)``; save it (or ``copy.deepcopy`` it) to freeze it."""
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
        empty pass when the whole epoch had been yielded, as ``RandomSampler`` does)."""
        state = read_state(
            "GraBSampler", state, self._config, _STATE_VERSION, self.num_samples,
            permutation=self.balance_type != "swr",
        )  # fmt: skip
        live, order = state["live"], state["live"]["order"]
        self.ordering.load_state_dict(dict(live["ordering"]))
        self.rule.load_state_dict(dict(live["rule"]))
        self._epoch = int(state["epoch"])
        req = live["requested_epoch"]
        self._requested_epoch = None if req is None else int(req)
        self._finished_any = bool(live["finished_any"])
        self._order = order.to(torch.int64).cpu().clone()
        self._yielded, self._stepped = int(state["yielded"]), int(live["stepped"])
        self._started = bool(state["started"]) or self._stepped > 0
        self._history = [torch.as_tensor(o) for o in live["orders_history"]]
        self.orders_history = [o.tolist() for o in self._history]
        self._resume = self._started
        if self.source is not None:
            self.source.clear()
        self._token += 1
        self._publish()

    def close(self) -> None:
        """Stop reading hook statistics; remove the hooks the sampler attached (``model=``)."""
        if self.source is not None:
            self.source.close()
        if self._owns_stats and self.stats is not None:
            self.stats.close()

    def __getstate__(self) -> dict[str, Any]:  # hooks live on this process's model only
        if self.source is not None:
            raise TypeError(HOOK_SAMPLER_NOT_PICKLABLE)
        return self.__dict__

    def __enter__(self) -> GraBSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
