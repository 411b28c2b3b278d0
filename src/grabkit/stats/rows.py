"""Grouped batches under statistics: which items of the batch the rows of each layer call hold.

A grouped batch (``grabkit.group``: ``run_grouped``, ``GroupedBatch.run``,
``backward_by_group``, ``DataCollection.apply``) calls the model once per length group, each
call holding some of the batch's n items in its rows (a group padded to a bucketed size ends with
rows of no item). The grouped runner announces the batch and each group (``grouped_run``,
``GroupedRun.group``); the engine tags every layer call made inside a group with it
(``StepRows``), keeps the groups of one grouped batch in one step (``backward_by_group``'s
backwards included), and at read time builds each parameter's factor group by group and puts
the groups' rows back in the batch's item order (``RowsFactor``). So every statistic, sketch
and GraB decision describes item i of the batch, exactly as the padded run would.

Layers called in the same step after the grouped run began but outside its groups hold the
whole batch in its item order: what a runner's merged output is (a head applied to
``GroupedBatch.run``'s output, or to a grouped body's). Their rows are one more segment, which
overlaps every group: item i's gradient is its group's part plus its whole-batch part, cross
terms included.

The per-group factors are read as they are: norms, dots and weighted sums cost what they cost on
each group (the padding the grouping saved is never computed), and the Gram matrix's blocks
between two groups are cross products of their factors (``cross_gram``: ghost-style for weights,
never a per-item gradient of a large layer unless that is cheaper).

Shapes: n items, group s holds ``rows_s >= m_s`` rows, its first m_s being items
``items_s`` (int64, CPU); k vectors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from grabkit.stats.factors import (
    EmbeddingFactor,
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    SumFactor,
    combine,
    embedding_linear_cross,
)

__all__ = [
    "GroupRows",
    "GroupedRun",
    "ItemLayout",
    "RowsFactor",
    "StepRows",
    "cross_gram",
    "grouped_run",
    "in_grouped_run",
]

# row chunks of the (N_u, N_v) blocks an embedding cross product builds stay below this many entries
_CROSS_CHUNK_ENTRIES = 1 << 24


class _ThreadRuns(threading.local):
    """The grouped runs under way in this thread, innermost last."""

    def __init__(self) -> None:
        self.runs: list[GroupedRun] = []


_active = _ThreadRuns()

UNANNOUNCED_GROUPS_HELP = (
    "If the model was run group by group (a padded batch split by length), call it through "
    "grabkit.group (run_grouped, GroupedBatch.run, backward_by_group or DataCollection.apply), "
    "which tells the statistics which items each call holds; a loop of your own over the groups "
    "cannot be told apart from other calls."
)


class GroupRows:
    """One group of a grouped batch: its first ``len(items)`` rows are items ``items``; the
    rest of its ``rows`` rows (padding to a bucketed size) belong to no item. ``inputs``: the
    tensors the group's call received (its rows in dim 0 of the first), which the engine checks
    layer inputs against; empty where the runner does not know them."""

    __slots__ = ("inputs", "items", "key", "rows")

    def __init__(self, items: torch.Tensor, rows: int, inputs: Sequence[torch.Tensor] = ()) -> None:
        self.items = torch.as_tensor(items, dtype=torch.long).reshape(-1).cpu()
        self.rows = int(rows)
        if self.rows < len(self.items):
            raise ValueError(
                f"a group of {self.rows} rows cannot hold {len(self.items)} items; announce the "
                f"rows the group is computed with"
            )
        self.key = (tuple(self.items.tolist()), self.rows)
        self.inputs = tuple(t for t in inputs if isinstance(t, torch.Tensor))


class GroupedRun:
    """A grouped batch of ``size`` items being run group by group (see ``grouped_run``);
    ``reduction``: how the runner combines the items' losses (``"mean"`` or ``"sum"``), where it
    makes the loss itself (``backward_by_group``), else None."""

    def __init__(self, size: int, reduction: str | None = None) -> None:
        self.size = int(size)
        self.reduction = reduction
        self.current: GroupRows | None = None

    @contextmanager
    def group(
        self,
        items: torch.Tensor,
        rows: int | None = None,
        inputs: Sequence[torch.Tensor] = (),
    ) -> Iterator[None]:
        """Model calls inside hold, in their first rows, the batch's items ``items`` (then
        ``rows - len(items)`` padding rows); ``inputs``: the tensors the group is called with."""
        previous = self.current
        self.current = GroupRows(items, len(items) if rows is None else rows, inputs)
        try:
            yield
        finally:
            self.current = previous


@contextmanager
def grouped_run(size: int, reduction: str | None = None) -> Iterator[GroupedRun]:
    """Announce a grouped batch of ``size`` items to every ``PerSampleStats`` whose model is
    called inside (in this thread); announce each group with ``run.group(items, rows)``.
    ``reduction``: the loss reduction the runner applies, where it makes the loss."""
    run = GroupedRun(size, reduction)
    _active.runs.append(run)
    try:
        yield run
    finally:
        _active.runs.remove(run)


def in_grouped_run() -> bool:
    """Whether a grouped runner is running a batch in this thread now."""
    return bool(_active.runs)


def _active_group() -> tuple[GroupedRun, GroupRows] | None:
    runs = _active.runs
    if not runs or runs[-1].current is None:
        return None
    return runs[-1], runs[-1].current


class ItemLayout:
    """Where a grouped step's items sit: ``size`` items, ``groups[s]`` the rows of group s
    (``overlapping``: whether some item sits in two of them: a whole-batch segment beside the
    groups, or a group's output trimmed to its items before a loss with parameters)."""

    def __init__(self, size: int, groups: Sequence[GroupRows], overlapping: bool = False) -> None:
        self.size = size
        self.groups = list(groups)
        self.overlapping = overlapping
        self._indices: dict[tuple[int, torch.device], torch.Tensor] = {}

    def index(self, s: int, device: torch.device) -> torch.Tensor:
        """Group s's item indices on ``device`` (moved once)."""
        key = (s, device)
        if key not in self._indices:
            self._indices[key] = self.groups[s].items.to(device)
        return self._indices[key]


class StepRows:
    """The grouped batch (if any) that one engine step's layer calls came from."""

    def __init__(self) -> None:
        self.run: GroupedRun | None = None
        self.groups: dict[tuple[tuple[int, ...], int], GroupRows] = {}
        self.whole: GroupRows | None = None  # calls after the run began, outside its groups

    @property
    def grouped(self) -> bool:
        return self.run is not None

    def tag(self) -> GroupRows | None:
        """The group a layer call made now holds, recorded: None before any grouped run of the
        step, the whole batch in item order outside the groups once one began.

        A call of a grouped step recomputed during its backward outside the run (activation
        checkpointing with use_reentrant=True after ``GroupedBatch.run`` returned) raises at
        once: which group's items its rows hold is unknown.
        """
        if self.run is None and not _active.runs:  # the usual step: no grouped batch
            return None
        active = _active_group()
        if active is None:
            if self.run is None:
                return None
            if torch._C._current_graph_task_id() != -1:
                raise ValueError(
                    "a layer was recomputed during the backward of a grouped batch (activation "
                    "checkpointing with use_reentrant=True) after the grouped run had returned, "
                    "so which group's items its rows hold is unknown: use "
                    "use_reentrant=False, or backward_by_group (each group's backward runs "
                    "inside the group)."
                )
            if self.whole is None:
                whole = GroupRows(torch.arange(self.run.size), self.run.size)
                self.whole = self.groups.setdefault(whole.key, whole)
            return self.whole
        run, rows = active
        if self.run is None:
            self.run = run
        elif run is not self.run:
            raise ValueError(
                "two grouped batches were run through the model in one step (no backward "
                "between them), so their items cannot be told apart: call backward (and read "
                "the statistics or step the sampler) after each grouped batch."
            )
        return self.groups.setdefault(rows.key, rows)

    def check_reduction(self, loss_reduction: str) -> None:
        """Raise when the grouped runner took the mean of the items' losses but the statistics
        were told the loss is their sum: every item's gradient would be 1/n of its own. (A sum
        under ``"mean"`` statistics is left alone: ``loss_fn`` may divide by the count itself.)
        """
        if self.run is None or self.run.reduction != "mean" or loss_reduction != "sum":
            return
        raise ValueError(
            "backward_by_group ran this grouped batch with reduction='mean' (the mean of "
            "loss_fn's per-item losses), but the statistics were built with "
            "loss_reduction='sum' (PerSampleStats, SketchedStats or "
            "GraBSampler(loss_reduction=...)): every item's gradient would be 1/"
            f"{self.run.size} of its own; pass reduction='sum' to backward_by_group, or "
            "loss_reduction='mean' to the statistics"
        )

    def continues(self) -> bool:
        """Whether a forward now belongs to this step although a backward ran: the next group
        of the grouped batch being run (``backward_by_group`` backwards each group)."""
        active = _active_group()
        return active is not None and active[0] is self.run

    def layout(self, calls: Sequence[tuple[str, Any, int]]) -> ItemLayout:
        """The step's ``ItemLayout``, after checking its calls ``(layer name, group or None,
        rows)`` (those that received an output gradient)."""
        for name, group, size in calls:
            if group is None:
                raise ValueError(
                    f"layer {name!r} was called before the grouped batch's run in the same step "
                    f"(a forward of another batch before the backward), so its rows cannot be "
                    f"matched to the batch's items: run the step's forwards through the grouped "
                    f"batch (layers called on its merged output are fine), or call backward and "
                    f"read the statistics before the other forward."
                )
            if size != group.rows:
                where = (
                    f"the whole grouped batch of {group.rows} items (a call after its run, "
                    f"outside its groups: the merged output, in item order)"
                    if group is self.whole
                    else f"a grouped batch's group of {group.rows} rows"
                )
                raise ValueError(
                    f"layer {name!r} holds {size} examples in a call on {where}; PerSampleStats "
                    f"needs those rows in dim 0 of every layer's input (batch_first layouts)."
                )
        seen = torch.cat([g.items for g in self.groups.values()])
        if len(seen) and (int(seen.min()) < 0 or int(seen.max()) >= self.run.size):
            raise ValueError(
                f"the groups announced for a grouped batch of {self.run.size} items name items "
                f"outside it; build the plan from the batch's lengths."
            )
        overlapping = len(seen) != len(torch.unique(seen))
        return ItemLayout(self.run.size, list(self.groups.values()), overlapping)

    def factors(
        self,
        calls: Sequence[tuple[str, Any, int]],
        merged: Callable[[GroupRows], dict[str, ParameterFactor | None]],
    ) -> tuple[dict[str, RowsFactor | None], int]:
        """(name -> ``RowsFactor`` or None, number of items) from ``merged(group)``, the
        engine's merged factors of the calls of one group."""
        layout = self.layout(calls)
        per_group = [merged(group) for group in layout.groups]
        names = per_group[0].keys() if per_group else ()
        factors: dict[str, RowsFactor | None] = {}
        for name in names:
            parts = [factors_of_group[name] for factors_of_group in per_group]
            present = [p for p in parts if p is not None]
            factors[name] = RowsFactor(layout, parts, present[0].param_shape) if present else None
        return factors, layout.size


class RowsFactor:
    """Per-item gradients of a grouped batch: group s's factor (``parts[s]``, None where the
    parameter got no gradient there) holds in its first m_s rows the items
    ``layout.groups[s].items``; every read is put back in the batch's item order, summed over
    the segments an item sits in (a group and the whole batch, ``layout.overlapping``)."""

    def __init__(
        self, layout: ItemLayout, parts: list[ParameterFactor | None], param_shape: torch.Size
    ) -> None:
        self.layout = layout
        self.parts = parts
        self.batch_size = layout.size
        self.param_shape = torch.Size(param_shape)
        self._present = [(s, f) for s, f in enumerate(parts) if f is not None]

    def _items(self, s: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        index = self.layout.index(s, like.device)
        return index, len(index)

    def _scatter_rows(self, values: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """(n, ...) with group s's leading rows of ``values`` added at its items (zeros where no
        segment holds an item)."""
        first = values[0][1]
        out = first.new_zeros(self.batch_size, *first.shape[1:])
        for s, v in values:
            index, m = self._items(s, v)
            out.index_add_(0, index, v[:m].to(out.dtype))
        return out

    def norms_squared(self) -> torch.Tensor:
        out = self._scatter_rows([(s, f.norms_squared()) for s, f in self._present])
        if self.layout.overlapping:  # + 2 <g_i^s, g_i^t> for the items two segments share
            for a, (s, u) in enumerate(self._present):
                for t, v in self._present[a + 1 :]:
                    items, rows_s, rows_t = self._shared(s, t, out.device)
                    if len(items):
                        cross = cross_gram(u, v)[rows_s, rows_t]
                        out.index_add_(0, items, 2 * cross.to(out.dtype))
        return out

    def _shared(
        self, s: int, t: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(items in both segments s and t, their rows in s, their rows in t)."""
        index_s, index_t = self.layout.index(s, device), self.layout.index(t, device)
        row_s = torch.full((self.batch_size,), -1, dtype=torch.long, device=device)
        row_t = row_s.clone()
        row_s[index_s] = torch.arange(len(index_s), device=device)
        row_t[index_t] = torch.arange(len(index_t), device=device)
        items = torch.nonzero((row_s >= 0) & (row_t >= 0)).reshape(-1)
        return items, row_s[items], row_t[items]

    def dot(self, vectors: torch.Tensor) -> torch.Tensor:
        return self._scatter_rows([(s, f.dot(vectors)) for s, f in self._present])

    def gram(self) -> torch.Tensor:
        """The (n, n) Gram matrix: each group's own Gram matrix and the cross products between
        groups, assembled in group order and put in item order with one scatter (added block
        by block where segments overlap)."""
        if self.layout.overlapping:
            return self._overlapping_gram()
        present = self._present
        upper: dict[tuple[int, int], torch.Tensor] = {}
        for a, (s, u) in enumerate(present):
            for b, (t, v) in enumerate(present[a:], start=a):
                block = u.gram() if a == b else cross_gram(u, v)
                upper[a, b] = block[: self._size(s), : self._size(t)]
        dtype = upper[0, 0].dtype
        rows = [
            torch.cat([upper[a, b] if a <= b else upper[b, a].T for b in range(len(present))], 1)
            for a in range(len(present))
        ]
        assembled = torch.cat(rows, dim=0).to(dtype)  # in group order
        order = torch.cat([self._items(s, assembled)[0] for s, _ in self._present])
        if len(order) == self.batch_size:  # every item present: a permutation
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order), device=order.device)
            return assembled.index_select(0, inverse).index_select(1, inverse)
        out = assembled.new_zeros(self.batch_size, self.batch_size)
        out[order[:, None], order[None, :]] = assembled
        return out

    def _overlapping_gram(self) -> torch.Tensor:
        """sum over segment pairs (s, t) of their cross block, added at (items_s, items_t)."""
        out: torch.Tensor | None = None
        for a, (s, u) in enumerate(self._present):
            for t, v in self._present[a:]:
                block = u.gram() if s == t else cross_gram(u, v)
                if out is None:
                    out = block.new_zeros(self.batch_size, self.batch_size)
                rows, m = self._items(s, block)
                cols, k = self._items(t, block)
                block = block[:m, :k].to(out.dtype)
                out.index_put_((rows[:, None], cols[None, :]), block, accumulate=True)
                if s != t:
                    out.index_put_((cols[:, None], rows[None, :]), block.T, accumulate=True)
        return out

    def _size(self, s: int) -> int:
        return len(self.layout.groups[s].items)

    def _group_weights(self, s: int, weights: torch.Tensor) -> torch.Tensor:
        """(rows_s, k) weights of group s's rows: its items' weights, zero on padding rows."""
        index, m = self._items(s, weights)
        rows = self.layout.groups[s].rows
        picked = weights.index_select(0, index)
        if rows == m:
            return picked
        return torch.cat([picked, picked.new_zeros(rows - m, weights.shape[1])])

    def weighted_sum(self, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        total: torch.Tensor | None = None
        for s, f in self._present:
            part = f.weighted_sum(self._group_weights(s, weights))
            total = part if total is None else total + part.to(total.dtype)
        if out is not None:
            return out.copy_(total)
        return total

    def add_weighted_sum_to(self, weights: torch.Tensor, target: torch.Tensor) -> None:
        """In place: ``target`` (k, *param_shape) += ``weighted_sum(weights)``, group by group."""
        for s, f in self._present:
            w = self._group_weights(s, weights)
            add_to = getattr(f, "add_weighted_sum_to", None)
            if add_to is not None:
                add_to(w, target)
            else:
                target.add_(f.weighted_sum(w).to(target.dtype))

    def merge(self, other: ParameterFactor) -> ParameterFactor:
        if not isinstance(other, RowsFactor) or other.layout is not self.layout:
            raise TypeError("a grouped batch's factor merges only with one of the same batch")
        parts = [
            a if b is None else b if a is None else combine(a, b)
            for a, b in zip(self.parts, other.parts, strict=True)
        ]
        return RowsFactor(self.layout, parts, self.param_shape)


def cross_gram(u: ParameterFactor, v: ParameterFactor) -> torch.Tensor:
    """(B_u, B_v) entries <g_i^u, g_j^v> between the examples of two factors of one parameter
    (two groups of a grouped batch: other examples, other numbers of positions)."""
    if isinstance(u, SumFactor) or isinstance(v, SumFactor):
        left = u.parts if isinstance(u, SumFactor) else [u]
        right = v.parts if isinstance(v, SumFactor) else [v]
        return sum(cross_gram(a, b) for a in left for b in right)
    if isinstance(u, OuterProductFactor) and isinstance(v, OuterProductFactor):
        return _outer_product_cross(u, v)
    if isinstance(u, EmbeddingFactor) and isinstance(v, EmbeddingFactor):
        return _embedding_cross(u, v)
    if isinstance(u, PerExampleFactor) and isinstance(v, PerExampleFactor):
        return u.grads @ v.grads.to(u.grads.dtype).T
    if isinstance(u, EmbeddingFactor) and _one_group(v):
        return embedding_linear_cross(u, v)
    if isinstance(v, EmbeddingFactor) and _one_group(u):
        return embedding_linear_cross(v, u).T
    identity = torch.eye(v.batch_size, dtype=torch.float64)
    dense_v = v.weighted_sum(identity.to(_dtype_of(v)))  # (B_v, *shape), materialised
    return u.dot(dense_v)


def _one_group(factor: ParameterFactor) -> bool:
    return isinstance(factor, OuterProductFactor) and factor.groups == 1


def _dtype_of(factor: ParameterFactor) -> torch.dtype:
    for attribute in ("inputs", "output_grads", "grads"):
        tensor = getattr(factor, attribute, None)
        if isinstance(tensor, torch.Tensor):
            return tensor.dtype
    return torch.float64


def _outer_product_cross(u: OuterProductFactor, v: OuterProductFactor) -> torch.Tensor:
    """Ghost form sum_{t, s} (A_it . A_js)(D_it . D_js), or both sides' per-example gradients
    materialised when that is cheaper (long sequences through narrow layers)."""
    g, p, q = u.groups, u.in_features, u.out_features
    n_u, n_v = u.batch_size * u.positions, v.batch_size * v.positions
    ghost = n_u * n_v * (p + q)
    materialised = (n_u + n_v) * g * p * q + u.batch_size * v.batch_size * g * p * q
    if ghost > materialised:
        return _materialised(u) @ _materialised(v).to(u.inputs.dtype).T
    a_u, d_u = _rows(u.inputs, g), _rows(u.output_grads, g)  # (G, N_u, p), (G, N_u, q)
    a_v, d_v = _rows(v.inputs, g).to(a_u.dtype), _rows(v.output_grads, g).to(a_u.dtype)
    pairs = ((a_u @ a_v.transpose(1, 2)) * (d_u @ d_v.transpose(1, 2))).sum(dim=0)
    return pairs.reshape(u.batch_size, u.positions, v.batch_size, v.positions).sum(dim=(1, 3))


def _rows(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, T, G, f) -> (G, B T, f)."""
    return t.reshape(-1, groups, t.shape[-1]).transpose(0, 1)


def _materialised(f: OuterProductFactor) -> torch.Tensor:
    """(B, G q p) per-example gradients of one factor (transient)."""
    grads = torch.einsum("btgq,btgp->bgqp", f.output_grads, f.inputs)
    return grads.reshape(f.batch_size, -1)


def _embedding_cross(u: EmbeddingFactor, v: EmbeddingFactor) -> torch.Tensor:
    """sum_{t, s} [idx_it == idx_js] (D_it . D_js), in row chunks of bounded size."""
    idx_u, idx_v = u.indices.reshape(-1), v.indices.reshape(-1)
    d_u = u.output_grads.reshape(idx_u.numel(), -1)
    d_v = v.output_grads.reshape(idx_v.numel(), -1).to(d_u.dtype)
    t = u.positions
    chunk = max(t, (_CROSS_CHUNK_ENTRIES // max(1, idx_v.numel())) // t * t)
    pieces = []
    for start in range(0, idx_u.numel(), chunk):
        stop = min(start + chunk, idx_u.numel())
        pairs = (d_u[start:stop] @ d_v.T) * (idx_u[start:stop, None] == idx_v[None, :])
        pieces.append(pairs.reshape(-1, t, v.batch_size, v.positions).sum(dim=(1, 3)))
    return torch.cat(pieces, dim=0)
