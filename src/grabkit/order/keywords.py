"""The keyword form of ``GraBSampler``: grabkit's and grab-sampler's keywords turned into the
sampler's three parts (an ordering, a gradient source, a chain of transforms), each checked with
an error that names the keyword.

``GraBSampler(dataset, params, balance_type="pair", prob_balance=True, normalize_grads=True)``
(grab-sampler's spellings) and ``GraBSampler(dataset, model=model, balance_type="pair")``
(grabkit's) both come here; ``GraBSampler(dataset, PairBalance(n), ExactHooks(model))`` does
not need to. What each keyword becomes:

=====================================================  ===========================================
keyword                                                part
=====================================================  ===========================================
``balance_type``, ``seed``, ``probabilistic`` /        the ordering: ``ORDERINGS[balance_type](n,
``prob_balance``, ``prob_balance_c``,                  seed=..., rule=SignRule(...), ...)``; an
``random_first_epoch``, ``block_policy``, and the      option the chosen ordering does not declare
ordering's own options (``depth``, ``ema_decay``, ...) is a ``TypeError``
``params`` / ``trainable_params`` (also the second     ``DenseGradients(params)``
positional argument)
``model``, ``loss_reduction``, ``stats_options``       ``ExactHooks(model, ...)``
``statistics="sketch"``, ``sketch_dim``                ``SketchHooks(model, sketch_dim, ...)``
``stats``                                              ``HookGradients(stats)``
``dtype``, ``device``                                  ``Cast(dtype, device)``
``projection`` / ``random_projection``,                ``Project(kind, projection_dim, ...)``
``projection_dim``, ``pi_eps``, ``kron_order``
``normalize`` / ``normalize_grads``                    ``Normalize()``
=====================================================  ===========================================

Two spellings of one option that disagree raise; so does a keyword that would be ignored (a
sampler setting next to an ``Ordering`` instance, ``projection_dim`` without a projection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grabkit.order.balance import BlockPolicy, SignRule
from grabkit.order.compat import GRAB_SAMPLER_KEYWORDS, GRAB_SAMPLER_PROJECTIONS
from grabkit.order.orderings import ORDERINGS, Ordering
from grabkit.order.sources import (
    DEFAULT_SKETCH_DIM,
    DenseGradients,
    ExactHooks,
    GradientSource,
    HookGradients,
    SketchHooks,
    param_dim,
)
from grabkit.order.transforms import Cast, GatherAcrossRanks, Normalize, Project, Transform
from grabkit.stats.source import StatisticsSource, check_shared
from grabkit.validation import check_bool, check_int

__all__ = ["STATISTICS", "SamplerParts", "sampler_parts"]

STATISTICS = ("exact", "sketch")

#: how each part's keywords are spelled in grabkit (what ``sampler_parts`` takes)
_ORDERING_KEYWORDS = (
    "balance_type", "seed", "probabilistic", "prob_balance_c", "random_first_epoch",
    "block_policy",
)  # fmt: skip
_SOURCE_KEYWORDS = (
    "params", "model", "stats", "loss_reduction", "stats_options", "statistics", "sketch_dim",
)  # fmt: skip
_TRANSFORM_KEYWORDS = (
    "dtype", "device", "projection", "projection_dim", "pi_eps", "kron_order", "normalize",
)  # fmt: skip
_DEFAULTS: dict[str, Any] = {
    "balance_type": "mean", "seed": 0, "probabilistic": None, "prob_balance_c": None,
    "random_first_epoch": True, "block_policy": None, "params": None, "model": None,
    "stats": None, "loss_reduction": None, "stats_options": None, "statistics": "exact",
    "sketch_dim": None, "dtype": None, "device": None, "projection": None,
    "projection_dim": None, "pi_eps": 0.1, "kron_order": 2, "normalize": None,
}  # fmt: skip


@dataclass(frozen=True)
class SamplerParts:
    """What the keywords describe: the sampler's ordering, gradient source and transforms."""

    ordering: Ordering
    source: GradientSource
    transforms: tuple[Transform, ...]


def sampler_parts(
    n: int,
    ordering: Ordering | None,
    source: GradientSource | None,
    transforms: Iterable[Transform],
    keywords: Mapping[str, Any],
    num_replicas: int = 1,
) -> SamplerParts:
    """The parts of ``GraBSampler(data_source, ordering, source, transforms=..., **keywords)``.

    ``ordering``, ``source`` and ``transforms`` may already be parts (then the keywords for that
    part raise: they would be ignored); the keywords build the rest. With ``num_replicas`` > 1
    the rows are exchanged after the cast and the projection, before normalising.
    """
    values = dict(keywords)
    _merge_grab_sampler_spellings(values)
    options = {k: values.pop(k) for k in list(values) if k not in _DEFAULTS}
    given = dict(values)
    values = {**_DEFAULTS, **values}
    check_int("seed", values["seed"])
    built = _ordering(n, ordering, values, options)
    transforms = tuple(transforms)
    if not transforms:
        transforms = _transforms(values, num_replicas)
    else:
        _refuse_with("transforms=", given, _TRANSFORM_KEYWORDS)
    if source is None:
        source = _source(values, built)
    else:
        _refuse_with("source=", given, _SOURCE_KEYWORDS)
    return SamplerParts(built, source, transforms)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (bool, int, float, str)) and isinstance(b, (bool, int, float, str)):
        return a == b
    return False


def _merge_grab_sampler_spellings(values: dict[str, Any]) -> None:
    """Replace grab-sampler's keywords in ``values`` by grabkit's, in place; two spellings of
    one option that disagree raise."""
    for old, new in GRAB_SAMPLER_KEYWORDS.items():
        if old not in values:
            continue
        old_value = values.pop(old)
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


def _refuse_with(part: str, given: Mapping[str, Any], names: Iterable[str]) -> None:
    clash = sorted(k for k in names if k in given and not _same(given[k], _DEFAULTS[k]))
    if clash:
        raise ValueError(
            f"GraBSampler got {part} together with {clash}, which describe that part too and "
            "would be ignored; pass one or the other."
        )


# -- the ordering ----------------------------------------------------------------------------
def _ordering(
    n: int, ordering: Ordering | None, values: Mapping[str, Any], options: Mapping[str, Any]
) -> Ordering:
    """``ordering`` itself, or the registered ``balance_type`` built with its own options."""
    known = {name for cls in ORDERINGS.values() for name in cls.option_names()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"GraBSampler got unexpected keyword arguments {unknown}: neither a sampler option "
            f"nor an option of any registered ordering ({sorted(known)})."
        )
    if ordering is not None:
        ignored = {
            "probabilistic": values["probabilistic"],
            "prob_balance_c": values["prob_balance_c"],
            "seed": values["seed"] or None,
            "random_first_epoch": None if values["random_first_epoch"] else 0,
            "balance_type": None if values["balance_type"] == "mean" else values["balance_type"],
            "block_policy": values["block_policy"],
        }
        _check_instance({**ignored, **options})
        return ordering
    cls = _ordering_class(values["balance_type"])
    foreign = sorted(set(options) - set(cls.option_names()))
    if foreign:
        owners = sorted(
            name for name, other in ORDERINGS.items() if set(foreign) & set(other.option_names())
        )
        raise TypeError(
            f'balance_type="{cls.name}" takes the options {sorted(cls.option_names())}, but got '
            f"{foreign}, which are options of {owners}: they would change nothing. Drop them, "
            "or choose the ordering they belong to."
        )
    probabilistic = values["probabilistic"]  # None: not given
    rule = SignRule(False if probabilistic is None else probabilistic, values["prob_balance_c"])
    block_policy: BlockPolicy | None = values["block_policy"]
    return cls(
        n, seed=values["seed"], rule=rule, random_first_epoch=values["random_first_epoch"],
        block_policy=block_policy, **options,
    )  # fmt: skip


def _ordering_class(balance_type: Any) -> type[Ordering]:
    if not isinstance(balance_type, str) and hasattr(balance_type, "value"):
        balance_type = balance_type.value  # an Enum member such as BalanceType.PAIR_BALANCE
    if balance_type not in ORDERINGS:
        raise ValueError(
            f"`balance_type` should be one of {sorted(ORDERINGS)}, but got "
            f"balance_type={balance_type!r}"
        )
    return ORDERINGS[balance_type]


def _check_instance(ignored: Mapping[str, Any]) -> None:
    given = sorted(k for k, v in ignored.items() if v is not None)
    if given:
        raise ValueError(
            f"GraBSampler(ordering=...) takes the instance's own configuration, so {given} "
            "would be ignored; pass them to the ordering's constructor instead."
        )


# -- the transforms --------------------------------------------------------------------------
def _transforms(values: Mapping[str, Any], num_replicas: int) -> tuple[Transform, ...]:
    """Cast, project, exchange between ranks, normalise: each only where asked for."""
    chain: list[Transform] = []
    if values["dtype"] is not None or values["device"] is not None:
        chain.append(Cast(values["dtype"], values["device"]))
    projection: str | Callable[[torch.Tensor], torch.Tensor] | None = values["projection"]
    if projection is not None:
        chain.append(
            Project(
                projection, values["projection_dim"], pi_eps=values["pi_eps"],
                kron_order=values["kron_order"],
            )
        )  # fmt: skip
    else:
        for name in ("projection_dim", "pi_eps", "kron_order"):
            if not _same(values[name], _DEFAULTS[name]):
                raise ValueError(
                    f"`{name}` sets the random projection, but no projection= was given; pass "
                    f"projection= too, or drop {name}={values[name]!r}."
                )
    if num_replicas > 1:
        chain.append(GatherAcrossRanks())
    if values["normalize"] is not None and check_bool("normalize", values["normalize"]):
        chain.append(Normalize())
    return tuple(chain)


# -- the gradient source ---------------------------------------------------------------------
def _source(values: Mapping[str, Any], ordering: Ordering) -> GradientSource:
    statistics, sketch_dim = values["statistics"], values["sketch_dim"]
    model, stats, params = values["model"], values["stats"], values["params"]
    if statistics not in STATISTICS:
        raise ValueError(
            f"`statistics` should be one of {list(STATISTICS)}, but got statistics={statistics!r}"
        )
    options = dict(values["stats_options"] or {})
    reduction = "mean" if values["loss_reduction"] is None else values["loss_reduction"]
    if statistics == "sketch":
        if model is None or stats is not None:
            raise ValueError(
                'statistics="sketch" sketches hook statistics, so it needs model=...; with '
                "gradients passed to step(), use projection= for a random projection instead."
            )
        dim = DEFAULT_SKETCH_DIM if sketch_dim is None else sketch_dim
        return SketchHooks(model, dim, reduction, params=params, **options)
    if sketch_dim is not None:
        raise ValueError(
            f'sketch_dim={sketch_dim!r} is for statistics="sketch", but this sampler reads '
            'exact statistics; pass statistics="sketch" or drop sketch_dim.'
        )
    if stats is not None:
        return _shared_source(stats, model, params, values)
    if model is not None:
        return ExactHooks(model, reduction, params=params, **options)
    return DenseGradients(params)


def _shared_source(
    stats: Any, model: torch.nn.Module | None, params: Any, values: Mapping[str, Any]
) -> HookGradients:
    """``HookGradients(stats)``: statistics defined by their owner, so ``stats_options`` (for
    statistics the sampler builds) are refused, and so are a ``model`` and ``loss_reduction``
    other than the statistics' own (``grabkit.stats.source.check_shared``)."""
    if values["stats_options"] is not None:
        raise ValueError(
            "stats_options are the options of the statistics a sampler attaches with model=, "
            "but stats= brings statistics built already; set the options where they are built "
            "(PerSampleStats(model, ...)), or pass model= instead of stats=."
        )
    if isinstance(stats, StatisticsSource):
        check_shared(stats, model, values["loss_reduction"], "GraBSampler")
    return HookGradients(stats, param_dim(params if params is not None else _trainable(model)))


def _trainable(model: torch.nn.Module | None) -> list[torch.Tensor] | None:
    return None if model is None else [p for p in model.parameters() if p.requires_grad]
