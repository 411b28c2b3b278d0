"""What happens to a step's gradients before the ordering sees them: a chain of small transforms.

Each transform maps the step's ``Rows`` (a ``GradientBatch`` and where its rows sit in the
epoch's visit order) to new ``Rows``. ``GraBSampler`` builds its ``Chain`` once, at
construction, and runs every step through it, as optax's ``chain`` composes gradient
transformations:

* ``Cast(dtype, device)``: move dense gradients (statistics pass through unchanged);
* ``Project(kind, dim)``: a random projection R^d -> R^k of dense gradients
  (``grabkit.order.projection``), unbiased for inner products;
* ``GatherAcrossRanks()``: all-gather every rank's rows into the global batch, in global visit
  order, without the padding duplicates (``grabkit.order.distributed``);
* ``Normalize()``: g_i / ||g_i|| (lazily for statistics, which have no coordinates).

A transform is set once (``bind``: the dataset size, the seed and the rank layout, which the
sampler knows and the transform may need) and records what changes the orders in ``config``
(checked when a saved state is loaded). The default chain is empty: the batch the gradient
source made is the batch the ordering sees.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from grabkit.order import distributed as collective
from grabkit.order.projection import PROJECTION_KINDS, make_projection
from grabkit.order.topology import Setting
from grabkit.stats.gradient_batch import GradientBatch
from grabkit.validation import check_positive_int

__all__ = [
    "Cast",
    "Chain",
    "GatherAcrossRanks",
    "Normalize",
    "Project",
    "Rows",
    "Transform",
    "jl_dimension",
]


@dataclass(frozen=True)
class Rows:
    """A step's rows on their way to the ordering.

    Attributes:
        batch: B per-example gradients.
        positions: where the rows sit in the epoch's padded global visit order: a slice on one
            process, a (B,) int64 CPU tensor once several ranks are involved.
        start: this rank's visit position of its first row (ranks check that they agree).
    """

    batch: GradientBatch
    positions: slice | torch.Tensor
    start: int


class Transform(ABC):
    """One step of the preprocessing; see the module docstring."""

    def bind(self, setting: Setting) -> None:  # noqa: B027 (optional)
        """Called once by the sampler before the first step."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def config(self) -> dict[str, Any]:
        """What this transform records in the sampler's configuration (plain data)."""
        return {}

    @abstractmethod
    def __call__(self, rows: Rows) -> Rows:
        """The rows after this transform."""


class Chain(Transform):
    """Transforms applied in order."""

    def __init__(self, transforms: Iterable[Transform] = ()) -> None:
        self.transforms = tuple(transforms)
        for t in self.transforms:
            if not isinstance(t, Transform):
                raise TypeError(
                    f"`transforms` should hold Transform instances (Cast, Project, Normalize, "
                    f"GatherAcrossRanks, ...), but got {type(t).__name__}"
                )

    def bind(self, setting: Setting) -> None:
        for t in self.transforms:
            t.bind(setting)

    def config(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for t in self.transforms:
            merged.update(t.config())
        return merged

    def __call__(self, rows: Rows) -> Rows:
        for t in self.transforms:
            rows = t(rows)
        return rows

    def has(self, kind: type[Transform]) -> bool:
        """Whether the chain holds a transform of this type."""
        return any(isinstance(t, kind) for t in self.transforms)


class Cast(Transform):
    """Move dense gradients to ``dtype`` / ``device`` (either may be None: left as given).
    Hook statistics pass through unchanged: they are read in the model's own dtype."""

    def __init__(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"`dtype` should be a torch.dtype, but got dtype={dtype!r}")
        self.dtype, self.device = dtype, None if device is None else torch.device(device)

    def __repr__(self) -> str:
        return f"Cast(dtype={self.dtype}, device={self.device})"

    def __call__(self, rows: Rows) -> Rows:
        X = rows.batch.coordinates()
        if X is None:
            return rows
        moved = X.to(device=self.device or X.device, dtype=self.dtype or X.dtype)
        return replace(rows, batch=rows.batch.derived(moved))


def jl_dimension(n: int, eps: float) -> int:
    """Johnson-Lindenstrauss target dimension 4 ln(n) / (eps^2/2 - eps^3/3) for n points."""
    if not 0 < eps < 1:
        raise ValueError(f"`pi_eps` should be in (0, 1), but got pi_eps={eps!r}")
    return max(1, math.ceil(4 * math.log(max(n, 2)) / (eps**2 / 2 - eps**3 / 3)))


class Project(Transform):
    """A random projection of dense gradients, (B, d) -> (B, k), before balancing.

    Args:
        kind: ``"gaussian"``, ``"sparse"``, ``"kronecker"`` (``grabkit.order.projection``,
            seeded by the sampler's seed) or a callable (B, d) -> (B, k).
        dim: k; default the Johnson-Lindenstrauss dimension for ``pi_eps`` and the dataset
            size, capped at d.
        pi_eps: the JL distortion that sets the default k.
        kron_order: must be 2 (``"kronecker"`` factors each gradient as a matrix).
    """

    def __init__(
        self,
        kind: str | Callable[[torch.Tensor], torch.Tensor],
        dim: int | None = None,
        *,
        pi_eps: float = 0.1,
        kron_order: int = 2,
    ) -> None:
        if not callable(kind) and kind not in PROJECTION_KINDS:
            raise ValueError(
                f"`projection` should be None, one of {list(PROJECTION_KINDS)} or a callable "
                f"mapping (B, d) to (B, k), but got projection={kind!r}"
            )
        if kron_order != 2:
            raise ValueError(
                f"`kron_order` should be 2 (the only supported order), got {kron_order!r}"
            )
        if dim is not None:
            check_positive_int("projection_dim", dim)
        if not callable(kind) and dim is None:
            jl_dimension(2, pi_eps)  # validates pi_eps now
        self.kind, self.dim, self.pi_eps = kind, dim, pi_eps
        self.projection: Callable[[torch.Tensor], torch.Tensor] | None = (
            kind if callable(kind) else None
        )
        self.n, self.seed = 2, 0

    def bind(self, setting: Setting) -> None:
        self.n, self.seed = setting.n, setting.seed

    def __repr__(self) -> str:
        return f"Project({self.kind!r}, dim={self.dim})"

    def config(self) -> dict[str, Any]:
        kind = "callable" if callable(self.kind) else self.kind
        return {"projection": kind, "projection_dim": self.dim, "pi_eps": self.pi_eps}

    def __call__(self, rows: Rows) -> Rows:
        batch = rows.batch
        X = batch.coordinates()
        if X is None:
            raise TypeError(
                "a random projection needs dense per-example gradients, but step() got a "
                f"{type(batch).__name__}; drop projection= or pass the (B, d) gradients."
            )
        if self.projection is None:
            d = X.shape[1]
            k = self.dim or min(d, jl_dimension(self.n, self.pi_eps))
            self.projection = make_projection(
                self.kind, d, k, seed=self.seed, device=X.device, dtype=X.dtype
            )
        Y = self.projection(X)
        if Y.ndim != 2 or Y.shape[0] != batch.size:
            raise ValueError(
                f"the projection returned shape {tuple(Y.shape)} for a batch of {batch.size}; "
                "it should return (B, k)."
            )
        return replace(rows, batch=batch.derived(Y))


class GatherAcrossRanks(Transform):
    """Every rank's rows of this step, in global visit order, without the padding duplicates
    (``grabkit.order.distributed.gather_rows``): all ranks then decide as one process would.
    One process: nothing to gather. A step's rows only get a global position here."""

    def __init__(self) -> None:
        self.n, self.num_replicas = 0, 1

    def bind(self, setting: Setting) -> None:
        self.n, self.num_replicas = setting.n, setting.topology.num_replicas

    def __call__(self, rows: Rows) -> Rows:
        if self.num_replicas == 1:
            return rows
        batch = rows.batch
        local = torch.arange(rows.start, rows.start + batch.size)
        batch, positions = collective.gather_rows(batch, local, rows.start, self.num_replicas)
        keep = positions < self.n  # padding repeats examples: not balanced twice
        if not bool(keep.all()):
            batch = batch.derived(batch.coordinates()[keep.to(batch.device)])
            positions = positions[keep]
        return Rows(batch, positions, rows.start)


class Normalize(Transform):
    """Balance g_i / ||g_i|| (zero rows stay zero): each example counts by its direction."""

    def config(self) -> dict[str, Any]:
        return {"normalize": True}

    def __call__(self, rows: Rows) -> Rows:
        return replace(rows, batch=rows.batch.normalized())
