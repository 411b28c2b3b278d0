"""Whether a layer input's dim 0 holds the examples of the layers before it, where its size
alone cannot tell.

A layer's input of shape (B, B, ...) whose dim 0 holds positions, not examples, looks like a
batch-first input: a sequence-first copy of an activation (``h.transpose(0, 1).contiguous()``,
``h.permute(1, 0, 2).clone()``, ``einsum("btf->tbf", h)`` made contiguous, ``torch.stack`` of
positions) has the strides of a batch-first tensor, so the layout check
(``_outer_dim_is_not_first``) does not see it, and the statistics would credit position t's
gradient to example t. Rows of a (B, ...) activation reordered between two layers (examples
sorted inside the forward, by length say, and sorted back after) put another example in row j
of the second layer. Neither is seen by the identity check: the rows still add up.

``moved_batch_dim`` follows dim 0 back through the autograd graph that made the input, to the
output of a layer called earlier in the step (whose dim 0 holds the examples): through permutes
and transposes (which move it), stacks, cats, selects and unbinds (which make or take an axis),
copies and reshapes that keep dim 0, element-wise operations (inputs broadcast against the
output, dims aligned from the right), row reorders along dim 0 (``h[perm]``,
``index_select``, ``gather``, ``flip``, ``roll``, ``out[perm] = h``, ``index_copy``; an index
that is the identity passes, read from the device only there), and pieces: slices, splits and
chunks, and cats and stacks of pieces along dim 0, whose row offsets are followed (the walk
carries, along the dim it follows, where row j of the layer's input sits in each tensor), so
pieces put back in another order (``torch.cat([h[1:], h[:1]])``, chunks swapped, unbound rows
stacked reversed) are reorders and pieces put back in order are not. A path through anything
else (a matrix product, a strided view, a reshape that splits dim 0, a custom function) is not
followed: no verdict from it. Rows reordered before the first layer (the model's input itself)
have no graph to follow and are not seen.

Cost: a few attribute reads per node, at most ``_MAX_NODES`` nodes, per layer call (about
15 us for a Linear after a ReLU after a Linear).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Anchor", "made_from_layer_outputs", "moved_batch_dim"]

_MAX_NODES = 64
_MAX_NODES_TO_AN_OUTPUT = 256  # ``made_from_layer_outputs``: a wider walk, run rarely

#: a layer output of the step: (the node that made it, the layer's name, its output number at
#: that node, its shape)
Anchor = tuple[Any, str, int, torch.Size]

# nodes that keep dim 0 where their input's dim 0 has the output's size (copies, reshapes)
_COPIES = frozenset(
    {
        "CloneBackward0",
        "ToCopyBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
    }
)

# nodes whose output dims are not their inputs' dims in order (strided views, indexing, matrix
# products, whose operands' dims may have the output's sizes by chance)
_NOT_FOLLOWED = frozenset(
    {
        "AsStridedBackward0",
        "IndexBackward0",
        "IndexSelectBackward0",
        "MmBackward0",
        "BmmBackward0",
        "AddmmBackward0",
        "AddbmmBackward0",
        "BaddbmmBackward0",
        "MvBackward0",
        "AddmvBackward0",
        "DotBackward0",
    }
)


#: the tracked dim is an axis made by ``torch.stack`` / ``unsqueeze`` (not a dim of the source)
NEW_AXIS = -1


def _shape(node: Any, output_nr: int) -> tuple[int, ...] | None:
    """The shape of the forward output ``output_nr`` of ``node`` (None where unknown)."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None or output_nr >= len(metadata):
        return None
    return tuple(metadata[output_nr].shape)


def _moved(node: Any, dim: int, ndim: int) -> int | None:
    """The input dim that output dim ``dim`` comes from at a permute / transpose node."""
    name = node.name()
    if name == "PermuteBackward0":
        return int(node._saved_dims[dim]) % ndim
    if name == "TransposeBackward0":
        first, second = int(node._saved_dim0) % ndim, int(node._saved_dim1) % ndim
        return second if dim == first else first if dim == second else dim
    return 1 - dim if ndim == 2 else dim  # TBackward0


def _structural(node: Any, name: str, dim: int, ndim: int) -> int | None:
    """The input dim that output dim ``dim`` comes from at a node that adds or removes dims
    (stack, cat, unsqueeze, select, unbind, squeeze of one dim); ``NEW_AXIS`` for the axis a
    stack or unsqueeze made; a select or unbind gives that axis the dim it enumerates."""
    if name == "CatBackward0":
        return dim
    axis = int(node._saved_dim)
    if name in ("StackBackward0", "UnsqueezeBackward0"):
        axis %= ndim
        return NEW_AXIS if dim == axis else dim - (dim > axis)
    axis %= ndim + 1  # select, unbind, squeeze: the input has one more dim
    if dim == NEW_AXIS:
        return axis if name in ("SelectBackward0", "UnbindBackward0") else None
    return dim + (dim >= axis)


_TRANSPOSES = frozenset({"PermuteBackward0", "TransposeBackward0", "TBackward0"})
_STRUCTURAL = frozenset(
    {
        "StackBackward0",
        "CatBackward0",
        "UnsqueezeBackward0",
        "SelectBackward0",
        "UnbindBackward0",
        "SqueezeBackward1",
    }
)


def _source_dim(
    node: Any, name: str, dim: int, shape: tuple[int, ...], source_shape: tuple[int, ...]
) -> int | None:
    """The dim of one input (shape ``source_shape``) that output dim ``dim`` of ``node`` comes
    from; None where that input holds no rows along it or the node is not followed. For
    ``NEW_AXIS`` (the tensor is one entry of an axis a later stack made) a copy or an
    element-wise operation of the same shape maps the whole tensor to its input's."""
    if name in _TRANSPOSES:
        return None if dim == NEW_AXIS else _moved(node, dim, len(shape))
    if name in _STRUCTURAL:
        return _structural(node, name, dim, len(shape))
    if dim == NEW_AXIS:
        return NEW_AXIS if source_shape == shape else None
    if name in _COPIES:  # keeps dim 0 where the input's dim 0 has the output's size
        keeps = dim == 0 and source_shape and source_shape[0] == shape[0]
        return 0 if keeps else None
    # element-wise: broadcast against the output, dims aligned from the right
    source_dim = dim - (len(shape) - len(source_shape))
    if source_dim < 0 or source_shape[source_dim] != shape[dim]:
        return None  # broadcast along it: no rows from this input
    return source_dim


def _elementwise(shape: tuple[int, ...], sources: list[tuple[int, ...]]) -> bool:
    """Whether every input broadcasts against the output (dims aligned from the right)."""
    for source in sources:
        if len(source) > len(shape):
            return False
        aligned = shape[len(shape) - len(source) :]
        if any(s not in (1, o) for s, o in zip(source, aligned, strict=True)):
            return False
    return True


def _reordered_source(node: Any, name: str, shape: tuple[int, ...]) -> int | None:
    """The input (its place in ``next_functions``) whose rows ``node`` reorders (or repeats)
    along dim 0 into as many rows: ``h[perm]``, ``index_select(0, ...)``, ``gather(0, ...)``,
    ``flip(0)``, ``roll(k, 0)``, ``out[perm] = h`` and ``index_copy(0, perm, h)`` (every row
    put); None where it does not. An index is read (a host transfer) only here, to pass the
    identity (``h[arange(B), t]``)."""
    ndim = len(shape)
    if name == "IndexBackward0":
        indices = node._saved_indices
        first = indices[0] if indices else None
        if (
            first is None
            or first.dtype == torch.bool
            or first.dim() != 1
            or sum(index is not None for index in indices) != 1
            or node._saved_self_sym_sizes[0] != shape[0]
        ):
            return None
        return None if _is_identity(first) else 0
    if name in ("IndexSelectBackward0", "GatherBackward0"):
        moved = int(node._saved_dim) % ndim == 0 and not _is_identity(node._saved_index)
        return 0 if moved else None
    if name in ("FlipBackward0", "RollBackward0"):
        dims = [int(d) % ndim for d in node._saved_dims]
        return 0 if not dims or 0 in dims else None
    if name == "IndexPutBackward0":
        indices = node._saved_indices
        if node._saved_accumulate or len(indices) != 1 or indices[0] is None:
            return None
        return _put_rows(node, indices[0], shape)
    if name == "IndexCopyBackward0" and int(node._saved_dim) % ndim == 0:
        return _put_rows(node, node._saved_index, shape)
    return None


def _put_rows(node: Any, index: torch.Tensor, shape: tuple[int, ...]) -> int | None:
    """1 (the put values' input) where ``index`` puts a whole (B, ...) source into the B rows
    in another order; None otherwise (a partial or masked put: no verdict)."""
    source, nr = node.next_functions[1]
    source_shape = _shape(source, nr) if source is not None else None
    if (
        index.dtype == torch.bool
        or index.dim() != 1
        or index.shape[0] != shape[0]
        or not source_shape
        or source_shape[0] != shape[0]
    ):
        return None
    return None if _is_identity(index) else 1


def _is_identity(index: torch.Tensor) -> bool:
    """Whether every row of the index along dim 0 is its own row number."""
    rows = torch.arange(index.shape[0], device=index.device).reshape(-1, *[1] * (index.dim() - 1))
    return bool((index == rows).all())


# nodes that take one piece of their input along a dim (slices, splits, chunks)
_PIECES = frozenset(
    {
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnsafeSplitBackward0",
        "UnsafeSplitWithSizesBackward0",
    }
)
# nodes with several outputs that are followed (each output's place in the input is known)
_SEVERAL_OUTPUTS = frozenset({"UnbindBackward0"}) | (_PIECES - {"SliceBackward0"})

#: a walk edge: (node, its output number, the dim followed, the offset along that dim: row j of
#: the layer's input sits at index j + offset of this tensor's dim; with ``NEW_AXIS`` the tensor
#: is the entry that holds row -offset)
_Edge = tuple[Any, int, int, int]


def _piece_source(node: Any, name: str, output_nr: int, dim: int, offset: int) -> list[_Edge]:
    """The input edge of a slice or split output: along the dim it cuts, the piece starts at
    ``start`` of its input, so the offset grows by ``start``; a slice with a step, or a piece
    that is one entry of a stacked axis, is not followed."""
    source, nr = node.next_functions[0]
    sizes = tuple(node._saved_self_sym_sizes)
    if source is None or dim == NEW_AXIS:
        return []
    axis = int(node._saved_dim) % len(sizes)
    if axis != dim:
        return [(source, nr, dim, offset)]
    if name == "SliceBackward0":
        if int(node._saved_step) != 1:
            return []
        start = int(node._saved_start)
        start = min(max(start + sizes[axis] if start < 0 else start, 0), sizes[axis])
    elif hasattr(node, "_saved_split_sizes"):
        start = sum(int(size) for size in node._saved_split_sizes[:output_nr])
    else:
        start = int(node._saved_split_size) * output_nr
    return [(source, nr, dim, offset + start)]


def _piece_offsets(
    node: Any, name: str, output_nr: int, dim: int, shape: tuple[int, ...], offset: int
) -> list[int | None]:
    """Each input's offset: at a cat or stack along the dim followed (the input's first row
    sits at its start in the output), at a select or unbind of a stacked entry (the entry's
    index along the axis it comes from), else the offset unchanged; None after a piece of
    unknown size (an input without a gradient, when more than one is)."""
    count = len(node.next_functions)
    if name == "UnbindBackward0" and dim == NEW_AXIS:
        return [offset + output_nr]
    if name == "SelectBackward0" and dim == NEW_AXIS:
        sizes = node._saved_self_sym_sizes
        index = int(node._saved_index)
        return [offset + (index + sizes[int(node._saved_dim) % len(sizes)] if index < 0 else index)]
    if name not in ("CatBackward0", "StackBackward0") or dim == NEW_AXIS:
        return [offset] * count
    axis = int(node._saved_dim) % len(shape)
    if axis != dim:
        return [offset] * count
    if name == "StackBackward0":
        return [offset - k for k in range(count)]
    sizes = []
    for source, nr in node.next_functions:
        source_shape = _shape(source, nr) if source is not None else None
        sizes.append(source_shape[axis] if source_shape else None)
    if sizes.count(None) == 1:
        sizes[sizes.index(None)] = shape[axis] - sum(size for size in sizes if size is not None)
    offsets: list[int | None] = []
    start: int | None = 0
    for size in sizes:
        offsets.append(None if start is None else offset - start)
        start = None if start is None or size is None else start + size
    return offsets


def _inputs(node: Any, output_nr: int, dim: int, offset: int) -> list[_Edge]:
    """The input edges that output dim ``dim`` of ``node`` (at ``offset``) comes from, for the
    nodes followed; [] where the path ends."""
    name = node.name()
    shape = _shape(node, output_nr)
    several = len(getattr(node, "_input_metadata", ())) != 1
    if shape is None or name in _NOT_FOLLOWED or (several and name not in _SEVERAL_OUTPUTS):
        return []
    if name in _PIECES:
        return _piece_source(node, name, output_nr, dim, offset)
    offsets = _piece_offsets(node, name, output_nr, dim, shape, offset)
    edges = [
        (source, nr, _shape(source, nr), place)
        for (source, nr), place in zip(node.next_functions, offsets, strict=False)
        if source is not None and place is not None
    ]
    edges = [edge for edge in edges if edge[2]]
    known = _TRANSPOSES | _STRUCTURAL | _COPIES
    if name not in known and not _elementwise(shape, [edge[2] for edge in edges]):
        return []  # not element-wise: its dims are not the output's
    followed = []
    for source, nr, source_shape, place in edges:
        source_dim = _source_dim(node, name, dim, shape, source_shape)
        if source_dim is not None:
            followed.append((source, nr, source_dim, place))
    return followed


_REORDERS = frozenset(
    {
        "IndexBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "FlipBackward0",
        "RollBackward0",
        "IndexPutBackward0",
        "IndexCopyBackward0",
    }
)

#: nodes that may move dim 0 or its rows while keeping the shape: never taken by the shortcut
_MAY_MOVE = _TRANSPOSES | _STRUCTURAL | _REORDERS | _PIECES

#: what a verdict names where pieces of a layer's output were put back in another order
SHIFTED = "a cat or stack of its pieces along dim 0 in another order"


def _next_to_anchor(x: torch.Tensor, anchors: dict[int, Anchor]) -> bool:
    """The usual layer input, where the walk's answer is known without walking: a layer's
    output itself, or one operation of one input away from it (an activation, a dropout, a
    copy) with the same shape, which keeps dim 0 where it is (the walk would follow dim 0 to
    dim 0 of the anchor). A few attribute reads instead of the walk's dozen calls."""
    node = x.grad_fn
    if id(node) in anchors:
        return True
    edges = node.next_functions
    if len(edges) != 1:
        return False
    source, nr = edges[0]
    anchor = anchors.get(id(source))
    if anchor is None or anchor[2] != nr or node.name() in _MAY_MOVE:
        return False
    return x.shape == anchor[3]  # x is the node's output: the shape the walk would read


def moved_batch_dim(x: torch.Tensor, anchors: dict[int, Anchor]) -> tuple[str, int | str] | None:
    """(layer name, where) when dim 0 of ``x`` is not the examples of the output of the layer
    named, an earlier call of the step: ``where`` is the dim != 0 of that output that dim 0 is
    (``NEW_AXIS``: an axis stacked from its outputs), or the name of the operation that
    reordered its rows (``h[perm]``, ``flip(0)``: row j is then another example's; ``SHIFTED``
    for pieces put back in another order). ``anchors``: id of the node that made each layer
    output -> its ``Anchor``. None where no path shows it."""
    node = x.grad_fn
    if node is None or not anchors or _next_to_anchor(x, anchors):
        return None
    # (node, output number, the dim followed, its offset, the operation that reordered dim 0's
    # rows or "")
    stack: list[tuple[Any, int, int, int, str]] = [(node, x.output_nr, 0, 0, "")]
    seen: set[tuple[int, int, int, int, str]] = set()
    while stack and len(seen) < _MAX_NODES:
        node, output_nr, dim, offset, reordered = stack.pop()
        key = (id(node), output_nr, dim, offset, reordered)
        if key in seen:
            continue
        seen.add(key)
        anchor = anchors.get(id(node))
        if anchor is not None:
            if dim != 0 or reordered or offset:
                return anchor[1], dim if dim != 0 else reordered or SHIFTED
            continue
        name, shape = node.name(), _shape(node, output_nr)
        source_at = _reordered_source(node, name, shape) if dim == 0 and shape else None
        if source_at is not None:
            source, nr = node.next_functions[source_at]
            if source is not None:
                stack.append((source, nr, 0, offset, reordered or name.removesuffix("Backward0")))
            continue
        stack.extend((*edge, reordered) for edge in _inputs(node, output_nr, dim, offset))
    return None


def made_from_layer_outputs(
    x: torch.Tensor, anchors: dict[int, Anchor], excluded: set[str] | frozenset[str]
) -> bool:
    """Whether the autograd graph that made ``x`` reaches the output of a layer called earlier
    in the step (``anchors``) other than those of the layers named in ``excluded``: a tensor
    computed from the step's activations, whose dim 0 holds the examples where it has their
    number. A tensor made from parameters, buffers or tensors made without autograd alone
    reaches none. At most ``_MAX_NODES_TO_AN_OUTPUT`` nodes: past them, False (no evidence)."""
    stack = [x.grad_fn]
    seen: set[int] = set()
    while stack and len(seen) < _MAX_NODES_TO_AN_OUTPUT:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        anchor = anchors.get(id(node))
        if anchor is not None and anchor[1] not in excluded:
            return True
        stack.extend(source for source, _ in node.next_functions)
    return False
