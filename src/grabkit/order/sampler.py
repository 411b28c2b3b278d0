"""``GraBSampler``: a ``torch.utils.data.Sampler`` whose order is decided by per-example gradients.

Usage (functional per-example gradients, as with grab-sampler)::

    sampler = GraBSampler(dataset, params)          # balance_type="mean" (vanilla GraB)
    loader = DataLoader(dataset, sampler=sampler, batch_size=16)
    for epoch in range(epochs):
        for x, y in loader:
            grads = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)  # {name: (B, ...)}
            sampler.step(grads)                      # balance this batch, in visit order
            ...                                      # optimiser update

or with hook statistics (no (B, d) tensor is ever built)::

    sampler = GraBSampler(dataset, model=model)     # installs grabkit.stats.PerSampleStats
    ... loss.backward(); sampler.step() ...

Epoch semantics. ``iter(sampler)`` starts a new epoch when the current one has begun (anything
yielded or stepped); otherwise it restarts the current one (so ``iter()`` twice in a row yields
the same order). Each ``step`` takes the gradients of the next examples of the epoch in visit
order. At the start of the next epoch the ordering turns what it saw into the new order;
examples never stepped (an epoch abandoned part-way, a dropped last batch) keep their relative
order (GraB orderings put them between the front and the back part). ``set_epoch(e)`` numbers the
next epoch (it seeds the random parts: random reshuffling, the first order, probabilistic
balancing), as with ``DistributedSampler``.

Distributed use follows ``DistributedSampler``: the epoch's global order is padded by repeating
its first examples (or, with ``drop_last=True``, truncated) to a multiple of ``num_replicas``, and
rank r yields positions r, r + W, r + 2W, ... Every rank calls ``step`` with the gradients of its
own batch; the ranks all-gather them (dense or projected), so all of them take exactly the
decisions one process would take on the global batch in global visit order. Padding duplicates
are not balanced.

Resuming. ``state_dict()`` records what was yielded apart from what was stepped:
``torchdata``'s ``StatefulDataLoader`` saves a sampler when it hands indices to workers, ahead of
training. After ``load_state_dict`` the next ``iter()`` yields the rest of the interrupted epoch
(from the yielded count). Gradients stepped between the load and that ``iter()`` belong to the
examples that were in flight at the snapshot, in order, so a state saved with nothing in flight
(``state_dict()`` right after ``step``, or ``StatefulDataLoader`` with ``num_workers=0``), or one
whose in-flight gradients are stepped again, reproduces the uninterrupted run exactly. In-flight
examples not stepped by then get no decision in that epoch (they keep their place between the
front and back parts); later gradients are never attributed to them. A state saved after the
whole epoch was yielded resumes with the next epoch, like ``StatefulDataLoader``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from grabkit.order.balance import SignRule
from grabkit.order.orderings import ORDERINGS, Ordering
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch, named_to_flat

__all__ = ["GraBBatchSampler", "GraBSampler"]

_STATE_VERSION = 1

#: dense batches larger than this are balanced in consecutive blocks (same decisions, for the
#: orderings whose decisions do not depend on how the visit sequence is cut into batches), so the
#: host transfer of the (B, B) Gram matrix stays small
MAX_BLOCK_ROWS = 1024
_GRAB_SAMPLER_PROJECTIONS = {
    "none": None,
    "jl": "gaussian",
    "jl_sparse": "sparse",
    "kron": "kronecker",
}
_PROJECTIONS = ("gaussian", "sparse", "kronecker")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` should be a positive integer, but got {name}={value!r}")
    return value


def _alias(name: str, value: Any, old_name: str, old_value: Any, default: Any) -> Any:
    """Merge a grabkit keyword with grab-sampler's name for it."""
    if old_value is None:
        return default if value is None else value
    if value is not None and value != old_value:
        raise ValueError(
            f"`{name}` and its grab-sampler spelling `{old_name}` disagree "
            f"({name}={value!r}, {old_name}={old_value!r}); pass only one of them."
        )
    return old_value


def _detached_copy(tree: Any) -> Any:
    """A copy of a nest of dicts and lists whose tensors share no memory with the original."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, Mapping):
        return {k: _detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_detached_copy(v) for v in tree]
    return tree


def jl_dimension(n: int, eps: float) -> int:
    """Johnson-Lindenstrauss target dimension 4 ln(n) / (eps^2/2 - eps^3/3) for n points."""
    if not 0 < eps < 1:
        raise ValueError(f"`pi_eps` should be in (0, 1), but got pi_eps={eps!r}")
    return max(1, math.ceil(4 * math.log(max(n, 2)) / (eps**2 / 2 - eps**3 / 3)))


def _normalized(batch: GradientBatch) -> GradientBatch:
    """g_i / ||g_i|| for every example (zero rows stay zero)."""
    if isinstance(batch, DenseGradientBatch):
        norms = torch.linalg.vector_norm(batch.matrix, dim=1, keepdim=True)
        return DenseGradientBatch(batch.matrix / torch.where(norms > 0, norms, 1.0))
    return _NormalizedBatch(batch)


class _NormalizedBatch:
    """A ``GradientBatch`` of g_i / ||g_i|| (zero rows stay zero), built lazily on the device."""

    def __init__(self, batch: GradientBatch) -> None:
        self.inner = batch
        self.size, self.dim = batch.size, batch.dim
        self.dtype, self.device = batch.dtype, batch.device
        norms = batch.norms_squared().sqrt()
        self.scale = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))  # (B,)

    def gram(self) -> torch.Tensor:
        return self.inner.gram() * self.scale[:, None] * self.scale[None, :]

    def norms_squared(self) -> torch.Tensor:
        return self.inner.norms_squared() * self.scale**2

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        d = self.inner.dot(vectors)
        return d * (self.scale if d.ndim == 1 else self.scale[:, None])

    def total(self) -> torch.Tensor:
        return self.inner.weighted_sum(self.scale[:, None]).reshape(-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        s = self.scale if weights.ndim == 1 else self.scale[:, None]
        return self.inner.weighted_sum(weights * s.to(weights.dtype))


class GraBSampler(Sampler[int]):
    """Order a dataset's examples by herding their gradients (GraB) or by a baseline ordering.

    Args:
        data_source: the dataset (only ``len()`` is used).
        params / trainable_params: the trainable parameters (dict name -> tensor, or an
            iterable of tensors); only their total size d is used, to check the gradients.
            Optional.
        model: hook mode: a ``torch.nn.Module``; the sampler installs
            ``grabkit.stats.PerSampleStats(model, loss_reduction=loss_reduction)`` and
            ``step()`` without arguments balances its per-example statistics after
            ``loss.backward()``.
        stats: hook mode with your own statistics object (anything with ``gradient_batch()``).
        balance_type: the ordering, by grab-sampler's names: ``"mean"`` (default), ``"pair"``,
            ``"recursive"``, ``"recursive-pair"``, ``"batch"``, ``"ema"``, ``"adamean"``,
            ``"adaema"``, ``"sign"``, ``"norm"``, ``"rr"``, ``"so"``, ``"swr"``, ``"fixed"``,
            ``"ntk-fixed"``, ``"ntk-eigen"``, ``"ntk-fixed-eigen"``, ``"flipflop"``, ``"greedy"``.
        batch_size: the loader's batch size, used by ``GraBBatchSampler``; orderings read batch
            sizes from ``step()``.
        probabilistic / prob_balance: self-balancing walk instead of the greedy sign.
        prob_balance_c: the walk's constant; ``None`` or ``"auto"`` is scale-aware (see
            ``grabkit.order.balance.SignRule``).
        projection: ``None``, ``"gaussian"``, ``"sparse"``, ``"kronecker"`` or a callable
            (B, d) -> (B, k): random projection applied to dense batches before balancing.
        projection_dim: k; default the Johnson-Lindenstrauss dimension for ``pi_eps`` (capped
            at d).
        random_projection, pi_eps, kron_order: grab-sampler's spelling (``"none"``, ``"jl"``,
            ``"jl_sparse"``, ``"kron"``) and JL accuracy; ``kron_order`` must be 2.
        normalize / normalize_grads: balance g_i / ||g_i||.
        num_replicas, rank, drop_last, seed: as ``torch.utils.data.DistributedSampler``;
            ``num_replicas``/``rank`` default to the initialised process group (else 1 and 0).
        random_first_epoch: the first epoch in a random order (else 0..n-1).
        depth: tree depth of ``"recursive"``.
        ema_decay: weight of the newest batch mean in ``"ema"``.
        betas, eps: ``"adaema"`` EMAs and ``"adamean"``/``"adaema"`` epsilon.
        orders: the permutation of ``"fixed"`` (None: 0..n-1).
        descending_norm: ``"norm"`` puts large gradients first.
        ntk_features, ntk_kernel, num_rounds, largest_eig, descending_eig, abs_eig: the NTK
            family (see ``grabkit.order.orderings.ntk``).
        dtype, device: move dense gradients there before balancing (default: as given).
        record_orders: keep every epoch's order in ``orders_history``.
        loss_reduction: hook mode: ``"mean"`` or ``"sum"``, how the loss was reduced.
        stats_options: hook mode: keywords passed on to ``PerSampleStats`` (e.g.
            ``{"torch_func_fallback": True}``).
    """

    def __init__(
        self,
        data_source: Sized,
        params: Mapping[str, torch.Tensor] | Any = None,
        *,
        trainable_params: Mapping[str, torch.Tensor] | None = None,
        model: torch.nn.Module | None = None,
        stats: Any = None,
        balance_type: str = "mean",
        batch_size: int = 1,
        probabilistic: bool | None = None,
        prob_balance: bool | None = None,
        prob_balance_c: float | str | None = None,
        projection: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
        projection_dim: int | None = None,
        random_projection: str | None = None,
        pi_eps: float = 0.1,
        kron_order: int = 2,
        normalize: bool | None = None,
        normalize_grads: bool | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        random_first_epoch: bool = True,
        depth: int = 5,
        ema_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        orders: Any = None,
        descending_norm: bool = True,
        ntk_features: torch.Tensor | None = None,
        ntk_kernel: torch.Tensor | None = None,
        num_rounds: int = 16,
        largest_eig: bool = False,
        descending_eig: bool = True,
        abs_eig: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        record_orders: bool = False,
        loss_reduction: str = "mean",
        stats_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(data_source, Sized):
            raise TypeError(
                "GraBSampler needs a dataset with len(), but got "
                f"{type(data_source).__name__}; iterable-style datasets cannot be reordered."
            )
        self.n = len(data_source)
        if self.n == 0:
            raise ValueError("GraBSampler got an empty dataset (len 0); there is nothing to order.")
        if not isinstance(balance_type, str) and hasattr(balance_type, "value"):
            balance_type = balance_type.value  # an Enum member such as grab-sampler's BalanceType
        if balance_type not in ORDERINGS:
            raise ValueError(
                f"`balance_type` should be one of {sorted(ORDERINGS)}, but got "
                f"balance_type={balance_type!r}"
            )
        self.balance_type = balance_type
        self.batch_size = _positive_int("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"`seed` should be an int, but got seed={seed!r}")
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.dtype, self.device = dtype, None if device is None else torch.device(device)
        self.normalize = bool(
            _alias("normalize", normalize, "normalize_grads", normalize_grads, False)
        )
        probabilistic = _alias("probabilistic", probabilistic, "prob_balance", prob_balance, False)
        self.rule = SignRule(bool(probabilistic), prob_balance_c)
        self._setup_projection(projection, projection_dim, random_projection, pi_eps, kron_order)
        self._setup_topology(num_replicas, rank)
        if trainable_params is not None:
            if params is not None and params is not trainable_params:
                raise ValueError(
                    "`params` and its grab-sampler spelling `trainable_params` were both given; "
                    "pass only one of them."
                )
            params = trainable_params
        self.dim = self._param_dim(params, model)
        options: dict[str, Any] = {
            "recursive": {"depth": depth},
            "ema": {"ema_decay": ema_decay},
            "adamean": {"eps": eps},
            "adaema": {"betas": betas, "eps": eps},
            "fixed": {"orders": orders},
            "norm": {"descending_norm": descending_norm},
            "ntk-fixed": {
                "ntk_features": ntk_features,
                "ntk_kernel": ntk_kernel,
                "num_rounds": num_rounds,
            },
        }.get(balance_type, {})
        if balance_type in ("ntk-eigen", "ntk-fixed-eigen"):
            options = {
                "ntk_features": ntk_features,
                "ntk_kernel": ntk_kernel,
                "largest_eig": largest_eig,
                "descending_eig": descending_eig,
                "abs_eig": abs_eig,
            }
        self.ordering: Ordering = ORDERINGS[balance_type](
            self.n, seed=seed, rule=self.rule, random_first_epoch=bool(random_first_epoch),
            **options,
        )  # fmt: skip
        self.stats = stats
        if model is not None and stats is None:
            if self.ordering.needs_coordinates or self.projection_kind is not None:
                what = (
                    f'balance_type="{balance_type}"'
                    if self.ordering.needs_coordinates
                    else "a random projection"
                )
                raise ValueError(
                    f"{what} needs dense per-example gradients, but model= selects hook mode, "
                    "which reads inner products only. Pass the per-example gradients to step() "
                    "(no model=), or choose an ordering such as 'mean', 'pair' or 'recursive'."
                )
            from grabkit.stats import PerSampleStats

            self.stats = PerSampleStats(model, loss_reduction, **(stats_options or {}))
        self.record_orders = bool(record_orders)
        self.orders_history: list[list[int]] = []
        self._epoch = 0
        self._requested_epoch: int | None = None
        self._finished_any = False
        self._begin(0, self.ordering.initial_order(0))
        self._resume = False
        self._token = 0

    # -- configuration helpers --------------------------------------------------------------
    def _setup_projection(
        self,
        projection: str | Callable[[torch.Tensor], torch.Tensor] | None,
        projection_dim: int | None,
        random_projection: str | None,
        pi_eps: float,
        kron_order: int,
    ) -> None:
        if random_projection is not None:
            if random_projection not in _GRAB_SAMPLER_PROJECTIONS:
                raise ValueError(
                    f"`random_projection` should be one of {list(_GRAB_SAMPLER_PROJECTIONS)}, but "
                    f"got random_projection={random_projection!r}"
                )
            mapped = _GRAB_SAMPLER_PROJECTIONS[random_projection]
            if projection is not None and mapped is not None and projection != mapped:
                raise ValueError(
                    f"`projection={projection!r}` and `random_projection={random_projection!r}` "
                    "disagree; pass only one of them."
                )
            projection = projection if projection is not None else mapped
        if projection is not None and not callable(projection) and projection not in _PROJECTIONS:
            raise ValueError(
                f"`projection` should be None, one of {list(_PROJECTIONS)} or a callable mapping "
                f"(B, d) to (B, k), but got projection={projection!r}"
            )
        if kron_order != 2:
            raise ValueError(
                f"`kron_order` should be 2 (the only supported order), got {kron_order!r}"
            )
        if projection_dim is not None:
            _positive_int("projection_dim", projection_dim)
        self.projection_kind = projection
        self.projection_dim = projection_dim
        self.pi_eps = pi_eps
        if projection is not None and not callable(projection) and projection_dim is None:
            jl_dimension(self.n, pi_eps)  # validate pi_eps now
        self.projection: Callable[[torch.Tensor], torch.Tensor] | None = (
            projection if callable(projection) else None
        )

    def _setup_topology(self, num_replicas: int | None, rank: int | None) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        _positive_int("num_replicas", num_replicas)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"`rank` should be an integer in [0, {num_replicas - 1}], but got rank={rank!r}"
            )
        self.num_replicas, self.rank = num_replicas, rank
        if self.drop_last and self.n % num_replicas:
            self.num_samples = self.n // num_replicas
        else:
            self.num_samples = math.ceil(self.n / num_replicas)
        if self.num_samples == 0:
            raise ValueError(
                f"drop_last=True with {self.n} examples and num_replicas={num_replicas} leaves no "
                "example for any rank; use drop_last=False or a larger dataset."
            )
        self.total_size = self.num_samples * num_replicas

    @staticmethod
    def _param_dim(params: Any, model: torch.nn.Module | None) -> int | None:
        if params is None and model is not None:
            params = [p for p in model.parameters() if p.requires_grad]
        if params is None:
            return None
        values = params.values() if isinstance(params, Mapping) else params
        try:
            return sum(int(p.numel()) for p in values)
        except (TypeError, AttributeError):
            raise TypeError(
                "`params` should be a dict of tensors (e.g. dict(model.named_parameters())) or an "
                f"iterable of tensors, but got {type(params).__name__}"
            ) from None

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

    def _advance(self) -> None:
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

    def _padded_order(self) -> torch.Tensor:
        order = self._order
        if self.total_size > order.numel():
            repeats = math.ceil(self.total_size / order.numel())
            order = order.repeat(repeats)
        return order[: self.total_size]

    def _local_indices(self) -> torch.Tensor:
        return self._padded_order()[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self._requested_epoch == self._epoch and (self._resume or not self._started):
            self._requested_epoch = None  # set_epoch(e) for the epoch already under way
        if self._resume:
            self._resume = False
            # examples handed out before the snapshot whose gradients were not stepped since the
            # load were trained on before it: they get no decision this epoch, and later
            # gradients are never attributed to them
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
    def _as_batch(self, grads: Any) -> GradientBatch:
        if grads is None:
            if self.stats is None:
                raise ValueError(
                    "step() without gradients needs hook statistics: construct the sampler with "
                    "model=... (or stats=...), or pass the per-example gradients to step()."
                )
            return self.stats.gradient_batch()
        if isinstance(grads, Mapping):
            if not grads:
                raise ValueError("step() got an empty dict of per-example gradients")
            return DenseGradientBatch(named_to_flat({k: v.detach() for k, v in grads.items()}, 1))
        if isinstance(grads, torch.Tensor):
            if grads.ndim < 2:
                raise ValueError(
                    "step() expects per-example gradients with a leading batch dimension, (B, d) "
                    f"or (B, ...), but got a tensor of shape {tuple(grads.shape)}"
                )
            return DenseGradientBatch(grads.detach().flatten(1))
        if isinstance(grads, GradientBatch):
            return grads
        raise TypeError(
            "step() expects a dict of (B, ...) per-example gradients, a (B, d) tensor, a "
            f"GradientBatch, or nothing in hook mode, but got {type(grads).__name__}"
        )

    def _prepare(self, batch: GradientBatch) -> GradientBatch:
        """dtype/device, projection; dense batches only (statistics batches pass through)."""
        if not isinstance(batch, DenseGradientBatch):
            if self.projection_kind is not None:
                raise TypeError(
                    "a random projection needs dense per-example gradients, but step() got a "
                    f"{type(batch).__name__}; drop projection= or pass the (B, d) gradients."
                )
            return batch
        X = batch.matrix
        if self.dtype is not None or self.device is not None:
            X = X.to(device=self.device or X.device, dtype=self.dtype or X.dtype)
        if self.projection_kind is not None:
            if self.projection is None:
                self.projection = self._make_projection(X)
            X = self.projection(X)
            if X.ndim != 2 or X.shape[0] != batch.size:
                raise ValueError(
                    f"the projection returned shape {tuple(X.shape)} for a batch of {batch.size}; "
                    "it should return (B, k)."
                )
        return DenseGradientBatch(X)

    def _make_projection(self, X: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        from grabkit.order.projection import make_projection

        d = X.shape[1]
        k = self.projection_dim or min(d, jl_dimension(self.n, self.pi_eps))
        return make_projection(
            self.projection_kind, d, k, seed=self.seed, device=X.device, dtype=X.dtype
        )

    def step(self, grads: Any = None) -> None:
        """Balance the next examples of the epoch, in visit order, with their gradients.

        Args:
            grads: per-example gradients of the examples this rank visited next: the dict of
                (B, ...) tensors that ``torch.func.vmap(torch.func.grad(f))`` returns, a (B, d)
                tensor, a ``GradientBatch``, or nothing in hook mode.
        Raises:
            ValueError: more gradients than the epoch has examples left, a gradient length that
                differs from ``params``, or NaN / Inf values (nothing changes then).
        """
        batch = self._as_batch(grads)
        B = int(batch.size)
        left = self.num_samples - self._stepped
        if left < B:
            raise ValueError(
                f"step() got gradients of {B} examples but epoch {self._epoch} has only {left} "
                f"of its {self.num_samples} examples left to step on this rank. Call "
                "iter(sampler) (start the next epoch) before stepping its batches, and pass one "
                "gradient per example yielded."
            )
        if B == 0:
            return
        if self.dim is not None and batch.dim != self.dim:
            raise ValueError(
                f"step() got gradients of length {batch.dim} per example, but the params given to "
                f"the sampler have {self.dim} numbers in total; pass the per-example gradients of "
                "exactly those parameters."
            )
        if self.ordering.uses_gradients:
            batch = self._prepare(batch)
            if self.num_replicas == 1 and self._stepped + B <= min(self.n, self._order.numel()):
                indices = self._order[self._stepped : self._stepped + B]  # no padding reached
            else:
                batch, indices = self._global_batch(batch, B)
            if self.normalize:
                batch = _normalized(batch)
            if indices.numel():
                self._observe(batch, indices)
        self._stepped += B
        self._started = True

    def _global_batch(self, batch: GradientBatch, B: int) -> tuple[GradientBatch, torch.Tensor]:
        """The rows of all ranks for this step, without padding, and their dataset indices."""
        positions = torch.arange(self._stepped, self._stepped + B)
        if self.num_replicas > 1:
            batch, global_positions = self._gather(batch, positions)
        else:
            global_positions = positions
        keep = global_positions < self.n  # padding repeats examples: not balanced twice
        indices = self._padded_order()[global_positions[keep]]
        if not bool(keep.all()):
            batch = DenseGradientBatch(batch.matrix[keep.to(batch.device)])
        return batch, indices

    def _observe(self, batch: GradientBatch, indices: torch.Tensor) -> None:
        split = self.ordering.splittable and isinstance(batch, DenseGradientBatch)
        if not split or batch.size <= MAX_BLOCK_ROWS:
            self.ordering.observe(batch, indices)
            return
        for start in range(0, batch.size, MAX_BLOCK_ROWS):
            block = DenseGradientBatch(batch.matrix[start : start + MAX_BLOCK_ROWS])
            self.ordering.observe(block, indices[start : start + MAX_BLOCK_ROWS])

    def _gather(
        self, batch: GradientBatch, positions: torch.Tensor
    ) -> tuple[DenseGradientBatch, torch.Tensor]:
        """All-gather the ranks' batches into the global batch, rows in global visit order."""
        if not isinstance(batch, DenseGradientBatch):
            raise NotImplementedError(
                "distributed GraB with hook statistics is not supported yet; pass the dense "
                "(or projected) per-example gradients to step() on every rank."
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"num_replicas={self.num_replicas}: the ranks share gradients through "
                "torch.distributed, but no process group is initialised; call "
                "torch.distributed.init_process_group(...) before stepping."
            )
        W = self.num_replicas
        X = batch.matrix
        sizes = [torch.zeros(2, dtype=torch.int64, device=X.device) for _ in range(W)]
        dist.all_gather(sizes, torch.tensor([X.shape[0], self._stepped], device=X.device))
        if any(int(s[0]) != X.shape[0] or int(s[1]) != self._stepped for s in sizes):
            raise ValueError(
                "ranks called step() with different batch sizes or at different positions "
                f"({[tuple(s.tolist()) for s in sizes]} as (batch size, examples stepped)); every "
                "rank must step the same number of examples each time."
            )
        gathered = [torch.empty_like(X) for _ in range(W)]
        dist.all_gather(gathered, X.contiguous())
        rows = torch.stack(gathered, dim=1).reshape(X.shape[0] * W, X.shape[1])
        global_positions = (positions[:, None] * W + torch.arange(W)[None, :]).reshape(-1)
        return DenseGradientBatch(rows), global_positions

    def update_v(self, second_moment: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """``"adamean"``: set v = sqrt(second moment) + eps from the optimiser (flat or dict)."""
        if not hasattr(self.ordering, "update_v"):
            raise TypeError(
                f'update_v() is for balance_type="adamean", but this sampler uses '
                f'"{self.balance_type}".'
            )
        if isinstance(second_moment, Mapping):
            second_moment = named_to_flat(second_moment)
        self.ordering.update_v(second_moment.reshape(-1))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; plain tensors, numbers, strings, lists, dicts."""
        return _detached_copy(
            {
                "version": _STATE_VERSION,
                "n": self.n,
                "num_replicas": self.num_replicas,
                "balance_type": self.balance_type,
                "seed": self.seed,
                "epoch": self._epoch,
                "requested_epoch": self._requested_epoch,
                "finished_any": self._finished_any,
                "order": self._order.clone(),
                "yielded": self._yielded,
                "stepped": self._stepped,
                "started": self._started,
                "rule": self.rule.state_dict(),
                "ordering": self.ordering.state_dict(),
                "orders_history": [torch.tensor(o) for o in self.orders_history],
            }
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``; the next ``iter()`` yields the rest of its epoch."""
        expected = set(self.state_dict())
        state = _detached_copy(state)
        unknown, missing = set(state) - expected, expected - set(state)
        if unknown or missing:
            raise ValueError(
                f"GraBSampler.load_state_dict: unexpected keys {sorted(unknown)}, missing keys "
                f"{sorted(missing)}; the state was not saved by this version of GraBSampler."
            )
        for key, mine in (
            ("version", _STATE_VERSION),
            ("n", self.n),
            ("num_replicas", self.num_replicas),
            ("balance_type", self.balance_type),
            ("seed", self.seed),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"GraBSampler.load_state_dict: the state has {key}={state[key]!r} but this "
                    f"sampler has {key}={mine!r}; build the sampler with the same dataset, "
                    "topology and configuration as the one that was saved."
                )
        self.ordering.load_state_dict(dict(state["ordering"]))
        self.rule.load_state_dict(dict(state["rule"]))
        self._epoch = int(state["epoch"])
        req = state["requested_epoch"]
        self._requested_epoch = None if req is None else int(req)
        self._finished_any = bool(state["finished_any"])
        self._order = state["order"].to(torch.int64).cpu().clone()
        self._yielded, self._stepped = int(state["yielded"]), int(state["stepped"])
        self._started = bool(state["started"])
        self.orders_history = [o.tolist() for o in state["orders_history"]]
        self._resume = self._started and self._yielded < self.num_samples
        self._token += 1


class GraBBatchSampler(Sampler[list[int]]):
    """The batch-sampler form: yields lists of ``batch_size`` indices of a ``GraBSampler``.

    Use as ``DataLoader(dataset, batch_sampler=GraBBatchSampler(dataset, params, batch_size=32))``.
    ``drop_last`` drops the last incomplete batch (its examples are then never stepped and keep
    their place between the front and the back part). Every other keyword goes to
    ``GraBSampler`` (whose replica-level ``drop_last`` stays False); ``step``, ``set_epoch``,
    ``update_v`` and the state methods delegate to it (``.sampler``).
    """

    def __init__(
        self,
        data_source: Sized,
        params: Any = None,
        *,
        batch_size: int,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        self.sampler = GraBSampler(data_source, params, batch_size=batch_size, **kwargs)
        self.batch_size = self.sampler.batch_size
        self.drop_last = bool(drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def step(self, grads: Any = None) -> None:
        self.sampler.step(grads)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def update_v(self, second_moment: Any) -> None:
        self.sampler.update_v(second_moment)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
