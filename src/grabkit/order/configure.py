"""Turning ``GraBSampler``'s keywords into its parts: the ordering, the batch preparation and
the rank layout, each validated with an error that names the keyword.

* ``merge_grab_sampler_keywords``: grab-sampler's spellings (``grabkit.order.compat``) folded
  into grabkit's, refusing two spellings that disagree.
* ``build_ordering``: a registered ``balance_type`` with the options it declares, or an
  ``Ordering`` instance; options that only other orderings declare are accepted and ignored,
  as grab-sampler does, and a keyword no ordering declares is a ``TypeError``.
* ``BatchPreparer``: dtype / device moves and the random projection of dense batches.
* ``Topology``: ``DistributedSampler``'s replica arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grabkit.order.balance import BlockPolicy, SignRule
from grabkit.order.compat import GRAB_SAMPLER_KEYWORDS, GRAB_SAMPLER_PROJECTIONS
from grabkit.order.orderings import ORDERINGS, Ordering
from grabkit.stats.gradient_batch import DenseGradientBatch, GradientBatch, named_to_flat

__all__ = [
    "DEFAULT_SKETCH_DIM",
    "HOOK_SAMPLER_NOT_PICKLABLE",
    "STATISTICS",
    "BatchPreparer",
    "Topology",
    "attach_statistics",
    "build_ordering",
    "dataset_size",
    "jl_dimension",
    "merge_grab_sampler_keywords",
    "param_dim",
    "positive_int",
    "statistics_choice",
]

_PROJECTIONS = ("gaussian", "sparse", "kronecker")


def dataset_size(data_source: Any) -> int:
    """``len(data_source)``, which must exist and be positive: only map-style datasets reorder."""
    if not isinstance(data_source, Sized):
        raise TypeError(
            "GraBSampler needs a dataset with len(), but got "
            f"{type(data_source).__name__}; iterable-style datasets cannot be reordered."
        )
    n = len(data_source)
    if n == 0:
        raise ValueError("GraBSampler got an empty dataset (len 0); there is nothing to order.")
    return n


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` should be a positive integer, but got {name}={value!r}")
    return value


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (bool, int, float, str)) and isinstance(b, (bool, int, float, str)):
        return a == b
    return False


def merge_grab_sampler_keywords(values: dict[str, Any], extra: dict[str, Any]) -> None:
    """Move grab-sampler's keywords out of ``extra`` into ``values`` (grabkit's names), in
    place; two spellings of one option that disagree raise."""
    for old, new in GRAB_SAMPLER_KEYWORDS.items():
        if old not in extra:
            continue
        old_value = extra.pop(old)
        if old == "random_projection":
            if old_value not in GRAB_SAMPLER_PROJECTIONS:
                raise ValueError(
                    f"`random_projection` should be one of {list(GRAB_SAMPLER_PROJECTIONS)}, "
                    f"but got random_projection={old_value!r}"
                )
            old_value = GRAB_SAMPLER_PROJECTIONS[old_value]
        if old_value is None:
            continue
        if values.get(new) is not None and not _same(values[new], old_value):
            raise ValueError(
                f"`{new}` and its grab-sampler spelling `{old}` disagree ({new}={values[new]!r}, "
                f"{old}={old_value!r}); pass only one of them."
            )
        values[new] = old_value


def build_ordering(
    ordering: Ordering | None,
    balance_type: Any,
    n: int,
    *,
    seed: int,
    rule: SignRule,
    random_first_epoch: bool,
    options: Mapping[str, Any],
    block_policy: BlockPolicy | None = None,
    explicit: Mapping[str, Any] | None = None,
) -> Ordering:
    """The sampler's ordering: ``ordering`` itself, or the registered ``balance_type`` built
    with the options it declares.

    ``explicit`` holds the sampler keywords given other than by default (None when not): with
    an instance they would be silently ignored, so they raise (the instance's own seed, rule
    and options apply).
    """
    known = {name for cls in ORDERINGS.values() for name in cls.option_names()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"GraBSampler got unexpected keyword arguments {unknown}: neither a sampler option "
            f"nor an option of any registered ordering ({sorted(known)})."
        )
    if ordering is not None:
        _check_instance(ordering, n, {**(explicit or {}), **options, "block_policy": block_policy})
        return ordering
    if not isinstance(balance_type, str) and hasattr(balance_type, "value"):
        balance_type = balance_type.value  # an Enum member such as BalanceType.PAIR_BALANCE
    if balance_type not in ORDERINGS:
        raise ValueError(
            f"`balance_type` should be one of {sorted(ORDERINGS)}, but got "
            f"balance_type={balance_type!r}"
        )
    cls = ORDERINGS[balance_type]
    own = {k: v for k, v in options.items() if k in cls.option_names()}
    return cls(
        n, seed=seed, rule=rule, random_first_epoch=random_first_epoch,
        block_policy=block_policy, **own,
    )  # fmt: skip


def _check_instance(ordering: Ordering, n: int, ignored: Mapping[str, Any]) -> None:
    if not isinstance(ordering, Ordering):
        raise TypeError(
            f"`ordering` should be an Ordering instance (e.g. PairBalance(len(dataset))), "
            f"but got {type(ordering).__name__}"
        )
    given = sorted(k for k, v in ignored.items() if v is not None)
    if given:
        raise ValueError(
            f"GraBSampler(ordering=...) takes the instance's own configuration, so {given} "
            "would be ignored; pass them to the ordering's constructor instead."
        )
    if ordering.n != n:
        raise ValueError(
            f"`ordering` was built for n={ordering.n} examples but the dataset has {n}"
        )


def jl_dimension(n: int, eps: float) -> int:
    """Johnson-Lindenstrauss target dimension 4 ln(n) / (eps^2/2 - eps^3/3) for n points."""
    if not 0 < eps < 1:
        raise ValueError(f"`pi_eps` should be in (0, 1), but got pi_eps={eps!r}")
    return max(1, math.ceil(4 * math.log(max(n, 2)) / (eps**2 / 2 - eps**3 / 3)))


class BatchPreparer:
    """dtype / device moves and the random projection applied to dense batches before balancing.

    Args:
        projection: ``None``, ``"gaussian"``, ``"sparse"``, ``"kronecker"`` or a callable
            (B, d) -> (B, k).
        projection_dim: k; default the JL dimension for ``pi_eps`` and n (capped at d).
        kron_order: must be 2.
    """

    def __init__(
        self,
        n: int,
        seed: int,
        projection: str | Callable[[torch.Tensor], torch.Tensor] | None,
        projection_dim: int | None,
        pi_eps: float,
        kron_order: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
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
            positive_int("projection_dim", projection_dim)
        if projection is not None and not callable(projection) and projection_dim is None:
            jl_dimension(n, pi_eps)  # validate pi_eps now
        self.n, self.seed = n, seed
        self.kind, self.dim, self.pi_eps = projection, projection_dim, pi_eps
        self.dtype, self.device = dtype, None if device is None else torch.device(device)
        self.projection: Callable[[torch.Tensor], torch.Tensor] | None = (
            projection if callable(projection) else None
        )

    def __call__(self, batch: GradientBatch) -> GradientBatch:
        """The batch to balance (statistics batches pass through unchanged)."""
        X = batch.coordinates()
        if X is None:
            if self.kind is not None:
                raise TypeError(
                    "a random projection needs dense per-example gradients, but step() got a "
                    f"{type(batch).__name__}; drop projection= or pass the (B, d) gradients."
                )
            return batch
        if self.dtype is not None or self.device is not None:
            X = X.to(device=self.device or X.device, dtype=self.dtype or X.dtype)
        if self.kind is None:
            return DenseGradientBatch(X)
        if self.projection is None:
            from grabkit.order.projection import make_projection

            d = X.shape[1]
            k = self.dim or min(d, jl_dimension(self.n, self.pi_eps))
            self.projection = make_projection(
                self.kind, d, k, seed=self.seed, device=X.device, dtype=X.dtype
            )
        X = self.projection(X)
        if X.ndim != 2 or X.shape[0] != batch.size:
            raise ValueError(
                f"the projection returned shape {tuple(X.shape)} for a batch of {batch.size}; "
                "it should return (B, k)."
            )
        return DenseGradientBatch(X)


@dataclass(frozen=True)
class Topology:
    """``DistributedSampler``'s layout: rank r of W takes ``num_samples`` of the ``total_size``
    padded (or, with ``drop_last``, truncated) positions."""

    num_replicas: int
    rank: int
    num_samples: int
    total_size: int

    @classmethod
    def of(cls, n: int, num_replicas: int | None, rank: int | None, drop_last: bool) -> Topology:
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        positive_int("num_replicas", num_replicas)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"`rank` should be an integer in [0, {num_replicas - 1}], but got rank={rank!r}"
            )
        if drop_last and n % num_replicas:
            num_samples = n // num_replicas
        else:
            num_samples = math.ceil(n / num_replicas)
        if num_samples == 0:
            raise ValueError(
                f"drop_last=True with {n} examples and num_replicas={num_replicas} leaves no "
                "example for any rank; use drop_last=False or a larger dataset."
            )
        return cls(num_replicas, rank, num_samples, num_samples * num_replicas)


def param_dim(params: Any, model: torch.nn.Module | None) -> int | None:
    """d, the total size of ``params`` (or of ``model``'s trainable parameters); None if neither."""
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


STATISTICS = ("exact", "sketch")

#: the sketch width when ``statistics="sketch"`` is chosen without ``sketch_dim`` (32 x 32)
DEFAULT_SKETCH_DIM = 1024


#: raised when a hook-mode sampler is pickled (e.g. sent to ``ddp_spawn`` ranks inside a model)
HOOK_SAMPLER_NOT_PICKLABLE = (
    "a GraBSampler in hook mode (model= or stats=) reads hooks on this process's model and "
    "cannot be pickled or copied to another process. Build it where it runs: in each process "
    "(under Lightning's ddp_spawn, in the LightningModule's or DataModule's setup()), and carry "
    "its progress with state_dict() / load_state_dict()."
)


def statistics_choice(
    statistics: str,
    sketch_dim: int | None,
    hook_mode: bool,
    projection: Any,
    num_replicas: int = 1,
) -> int | None:
    """Check ``statistics=`` / ``sketch_dim=``; the sketch width in sketch mode, else None."""
    if statistics not in STATISTICS:
        raise ValueError(
            f"`statistics` should be one of {list(STATISTICS)}, but got statistics={statistics!r}"
        )
    if statistics == "exact":
        if sketch_dim is not None:
            raise ValueError(
                f'sketch_dim={sketch_dim!r} is for statistics="sketch", but this sampler reads '
                'exact statistics; pass statistics="sketch" or drop sketch_dim.'
            )
        if hook_mode and num_replicas > 1:
            raise ValueError(
                f"hook mode with exact statistics runs on one process, but this sampler has "
                f"num_replicas={num_replicas}: the ranks would have to exchange (B, d) "
                f'per-example gradients. Pass statistics="sketch" (the ranks exchange (B, k) '
                f"sketches; sketch_dim=k), or pass per-example gradients to step()."
            )
        return None
    if not hook_mode:
        raise ValueError(
            'statistics="sketch" sketches hook statistics, so it needs model=...; with '
            "gradients passed to step(), use projection= for a random projection instead."
        )
    if projection is not None:
        raise ValueError(
            'statistics="sketch" is already a random projection of the gradients; drop '
            "projection= (the sketch's width is sketch_dim)."
        )
    from grabkit.stats.sketch import kronecker_factors

    dim = DEFAULT_SKETCH_DIM if sketch_dim is None else sketch_dim
    kronecker_factors(dim)  # validates it
    return dim


def attach_statistics(
    model: torch.nn.Module,
    loss_reduction: str,
    ordering: Ordering,
    projection: Any,
    stats_options: dict[str, Any] | None = None,
    *,
    sketch_dim: int | None = None,
    seed: int = 0,
) -> Any:
    """Hook mode: ``PerSampleStats`` on ``model`` (inner products only, so no coordinates), or
    with ``sketch_dim`` ``SketchedStats`` (a (B, k) sketch, so every ordering runs).

    A ``DistributedDataParallel`` wrapper is looked through: the hooks go on its module.
    """
    from grabkit.stats.engine import unwrap_data_parallel

    model = unwrap_data_parallel(model)
    if sketch_dim is not None:
        from grabkit.stats.sketch import SketchedStats

        return SketchedStats(
            model, sketch_dim, seed, loss_reduction=loss_reduction, **(stats_options or {})
        )
    if ordering.needs_coordinates or projection is not None:
        what = (
            f'balance_type="{ordering.name}"'
            if ordering.needs_coordinates
            else "a random projection"
        )
        raise ValueError(
            f"{what} needs dense per-example gradients, but model= selects hook mode, "
            'which reads inner products only. Pass statistics="sketch" (a (B, k) sketch '
            "of the gradients from the hooks), pass the per-example gradients to step() "
            "(no model=), or choose an ordering such as 'mean', 'pair' or 'recursive'."
        )
    from grabkit.stats import PerSampleStats

    return PerSampleStats(model, loss_reduction=loss_reduction, **(stats_options or {}))


def flat_second_moment(
    ordering: Ordering, sketch_dim: int | None, second_moment: torch.Tensor | Mapping[str, Any]
) -> torch.Tensor:
    """``update_v``'s argument as a flat (d,) tensor, after checking that the ordering scales
    gradient coordinates (``"adamean"``) and sees real ones (not a sketch's)."""
    if sketch_dim is not None:
        raise TypeError(
            'update_v() scales gradient coordinates, but statistics="sketch" balances '
            "sketches, whose coordinates are random combinations of the gradient's; use "
            'statistics="exact" with per-example gradients passed to step() for "adamean".'
        )
    if not hasattr(ordering, "update_v"):
        raise TypeError(
            f'update_v() is for balance_type="adamean", but this sampler uses "{ordering.name}".'
        )
    if isinstance(second_moment, Mapping):
        second_moment = named_to_flat(second_moment)
    return second_moment.reshape(-1)
