"""A guard on the one place the engine changes a tensor the model sees: a shared input's output.

A layer whose input is shared by the batch (positions ``torch.arange(T)``, Hugging Face's (1, T)
position ids) gives every example the same activation, and the per-example gradients of its
parameters only exist where the model broadcasts its output against the batch
(``tok_emb + pos_emb``). So the engine hands the model that output expanded to (B, ...) (a view,
no copy), whose gradient carries one slice per example. That is exact, and changes nothing the
model computes, only if the model does with the expanded tensor what it would have done with
the original one. ``BatchExpanded`` (the view's class) makes that certain at run time: each
torch function that receives it is checked against the shape the model would have had, with
no extra computation (shapes only):

* an elementwise op (``+``, ``-``, ``*``, ``/``, ``torch.where``) whose result has the shape the
  original operands broadcast to: the broadcast the model did anyway, which ends the guard;
* ``scaled_dot_product_attention`` with it as ``attn_mask`` (an additive bias broadcast against
  the batch's scores, as Hugging Face's T5 passes its position bias), when the result has the
  shape the model's own call would have: the same broadcast inside the attention;
* an elementwise op, a unary pointwise function, ``F.linear`` or a normalisation over the last
  dims whose result is the batch of the original's result: the guard continues on the result;
* ``unsqueeze(0)`` (the model adds the batch dim itself), conversions (``to``, ``float``,
  ``contiguous``), ``detach``, and reads of dtype, device or autograd state: allowed;
* ``permute`` of the model's dims (T5's relative position bias, an Embedding of (T, S) buckets
  permuted to (H, T, S)), or ``transpose`` of two of them: the same permutation of the expanded
  dims, the batch kept in front;
* a matrix product whose result has the shape of the model's own (its leading dims broadcast
  against the batch as the model's would: ``q[:, :, None] @ rel.transpose(-1, -2)``), read as
  an elementwise op is;
* ``einsum`` with an explicit result whose dim 0 is the batch, under a letter that an operand
  holding B rows starts with: computed with that letter put in front of the expanded operands'
  terms (``"bqd,qkd->bqk"`` as ``"bqd,bqkd->bqk"``: relative position representations), the
  model's own result, each example contracting its own copy;
* anything else (a reduction, a reshape, indexing, a read of the shape, dropout, a ``cat``):
  ``ValueError``, naming the layer and the operation (and chaining torch's error where the op
  fails on the expanded shape); the model would compute something else.

Shape reads are refused too: the model would see the expanded shape.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch.utils._pytree import tree_leaves

__all__ = [
    "ELEMENTWISE_OPS",
    "MATMUL_OPS",
    "ROW_WISE_OPS",
    "SAME_OPS",
    "UNARY_OPS",
    "BatchExpanded",
    "einsum_terms",
    "expand_for_batch",
    "first_of",
    "op_name",
]

ELEMENTWISE_OPS = frozenset(
    f"{prefix}{op}{suffix}"
    for op in ("add", "sub", "mul", "div", "true_divide")
    for prefix, suffix in (("", ""), ("__", "__"), ("__r", "__"), ("__i", "__"))
) | {"__truediv__", "__rtruediv__", "__itruediv__", "where"}
UNARY_OPS = frozenset(
    {"tanh", "sigmoid", "relu", "gelu", "silu", "exp", "neg", "__neg__", "softplus", "square"}
)
ROW_WISE_OPS = frozenset({"linear", "layer_norm", "rms_norm"})
SAME_OPS = frozenset(
    {"to", "contiguous", "float", "double", "half", "bfloat16", "type_as", "clone", "detach"}
)
_HARMLESS = frozenset(
    {
        "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "is_cuda", "layout",
        "is_floating_point", "data_ptr", "__repr__", "__format__", "_version",
    }
)  # fmt: skip


_SWAPS = frozenset({"transpose", "swapaxes", "swapdims"})
#: matrix products whose result shape follows from their operands' by broadcasting
MATMUL_OPS = frozenset({"matmul", "__matmul__", "__rmatmul__"})


def op_name(func: Any) -> str:
    """The name of a torch function as ``__torch_function__`` receives it (a property's own name
    for its getter)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.shape.__get__
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


def _batched(shape: torch.Size, batch: int) -> tuple[int, ...]:
    """The (B, ...) shape the engine hands the model for a tensor the model has as ``shape``:
    a leading dim of 1 becomes B, otherwise B is put in front."""
    if len(shape) and shape[0] == 1:
        return (batch, *shape[1:])
    return (batch, *shape)


def _model_shape(value: Any) -> torch.Size:
    if isinstance(value, BatchExpanded):
        return value.grabkit_model_shape
    if isinstance(value, torch.Tensor):
        return value.shape
    return torch.Size()


class BatchExpanded(torch.Tensor):
    """An output expanded to (B, ...) for a layer whose input the batch shares (see module).

    ``grabkit_model_shape`` is the shape the model would have had, ``grabkit_layer`` the layer's
    name, ``grabkit_batch`` B.
    """

    grabkit_model_shape: torch.Size
    grabkit_layer: str
    grabkit_batch: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name == "permute" and args and isinstance(args[0], BatchExpanded):
            return args[0]._permuted(args[1:], kwargs)
        if name in _SWAPS and args and isinstance(args[0], BatchExpanded):
            return args[0]._swapped(args[1:], kwargs)
        if name == "einsum":
            return _batched_einsum(args)
        guarded = first_of(BatchExpanded, (*args, *kwargs.values()))
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(*args, **kwargs)
            except RuntimeError as error:  # an op the expanded shape breaks (a cat, a view)
                if guarded is None:
                    raise
                guarded._refuse(name, error)
        if name in _HARMLESS or guarded is None:
            return out
        return guarded._checked(name, args, kwargs, out)

    def _permuted(self, dims: tuple, kwargs: dict) -> BatchExpanded:
        """``permute(dims)`` as the model asks it of its (model-shaped) tensor, applied to the
        expanded one with the batch dim kept first."""
        if "dims" in kwargs:
            dims = (kwargs["dims"],)
        if len(dims) == 1 and not isinstance(dims[0], int):
            dims = tuple(dims[0])
        model_shape = self.grabkit_model_shape
        rank = len(model_shape)
        order = [int(d) % rank for d in dims] if rank else []
        with torch._C.DisableTorchFunctionSubclass():
            prepended = self.dim() == rank + 1
            if len(order) != rank or sorted(order) != list(range(rank)):
                self._refuse("permute")
            if prepended:
                out = torch.Tensor.permute(self, [0, *(d + 1 for d in order)])
            elif order and order[0] == 0:  # (1, ...) expanded in place: the batch stays first
                out = torch.Tensor.permute(self, order)
            else:
                self._refuse("permute")
        permuted = torch.Size(model_shape[d] for d in order)
        return _wrap(out, permuted, self.grabkit_layer, self.grabkit_batch)

    def _swapped(self, dims: tuple, kwargs: dict) -> BatchExpanded:
        """``transpose(d0, d1)`` (``swapaxes``, ``swapdims``) of the model's dims: the
        permutation that swaps them, applied as ``_permuted`` does."""
        given = [*dims, *kwargs.values()]
        rank = len(self.grabkit_model_shape)
        if len(given) != 2 or not rank:
            self._refuse("transpose")
        first, second = (int(d) % rank for d in given)
        order = list(range(rank))
        order[first], order[second] = order[second], order[first]
        return self._permuted((order,), {})

    def _checked(self, name: str, args: tuple, kwargs: dict, out: Any) -> Any:
        batch = self.grabkit_batch
        if name in SAME_OPS and args and args[0] is self and isinstance(out, torch.Tensor):
            return _wrap(out, self.grabkit_model_shape, self.grabkit_layer, batch)
        if name == "unsqueeze" and len(args) > 1 and int(args[1]) == 0 and args[0] is self:
            unsqueezed = torch.Size((1, *self.grabkit_model_shape))
            return _wrap(self, unsqueezed, self.grabkit_layer, batch)
        if isinstance(out, torch.Tensor):
            model = self._model_result(name, args, kwargs, out)
            if model is not None and tuple(out.shape) == tuple(model):
                return out  # met the batch as the model's own broadcast would
            if model is not None and tuple(out.shape) == _batched(model, batch):
                return _wrap(out, model, self.grabkit_layer, batch)
        self._refuse(name)

    def _refuse(self, name: str, cause: BaseException | None = None) -> NoReturn:
        batch = self.grabkit_batch
        raise ValueError(
            f"layer {self.grabkit_layer!r} got an input shared by the batch, so PerSampleStats "
            f"hands the model its output expanded to shape "
            f"{_batched(self.grabkit_model_shape, batch)} instead of "
            f"{tuple(self.grabkit_model_shape)}, which is exact only where the model broadcasts "
            f"it against the batch (an elementwise op with a (B, ...) tensor). Here the model "
            f"passes it to {name!r}, where the expansion would change what it computes. Give "
            f"that layer's input an explicit batch dim (e.g. pos.unsqueeze(0).expand(B, -1)), or "
            f"combine its output with the batch first."
        ) from cause

    def _model_result(self, name: str, args: tuple, kwargs: dict, out: torch.Tensor):
        """The shape the model's own result would have, for the ops whose result shape follows
        from their operands' (None for any other op)."""
        if name in ELEMENTWISE_OPS:
            shapes = [_model_shape(a) for a in (*args, *kwargs.values())]
            try:
                return torch.broadcast_shapes(*shapes)
            except RuntimeError:  # the model's own operands would not even broadcast
                return None
        if name == "scaled_dot_product_attention":
            return _attention_result(args, kwargs)
        if name in MATMUL_OPS and len(args) == 2:
            return _matmul_result(name, args)
        if name in UNARY_OPS and args and args[0] is self:
            return self.grabkit_model_shape
        if name in ROW_WISE_OPS and args and args[0] is self:
            return torch.Size((*self.grabkit_model_shape[:-1], out.shape[-1]))
        return None


def first_of(kind: type[Any], values: tuple) -> Any:
    """The first ``kind`` among ``values``, also inside containers (``torch.cat``'s list), or
    None."""
    return next((v for v in tree_leaves(values) if isinstance(v, kind)), None)


def einsum_terms(args: tuple) -> tuple[list[Any], list[str], str] | None:
    """(operands, their subscript terms, the result's term) of ``einsum(equation, *operands)``
    (the operands also given as one list), for an equation with an explicit result and no
    ellipsis; None for any other."""
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    return (operands, terms, output) if len(terms) == len(operands) else None


def _matmul_result(name: str, args: tuple) -> torch.Size | None:
    """The shape of the model's own matrix product of two operands of 2 dims or more (their
    leading dims broadcast); None for a vector operand."""
    first, second = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
    a, b = _model_shape(first), _model_shape(second)
    if len(a) < 2 or len(b) < 2:
        return None
    try:
        batch = torch.broadcast_shapes(a[:-2], b[:-2])
    except RuntimeError:
        return None
    return torch.Size((*batch, a[-2], b[-1]))


def _batched_einsum(args: tuple) -> torch.Tensor:
    """``einsum(equation, *operands)`` with expanded operands, computed with the batch's letter
    put in front of their terms: the letter of the result's dim 0, where an operand that is
    not expanded holds B rows under it (``"bqd,qkd->bqk"`` becomes ``"bqd,bqkd->bqk"``). Each
    example then contracts its own copy of the table, which is the model's own result; any
    other equation (no such letter, an ellipsis, an implicit result) is refused."""
    guarded = first_of(BatchExpanded, args[1:])
    parsed = einsum_terms(args)
    if parsed is None:
        guarded._refuse("einsum")
    operands, terms, output = parsed
    letter, batch = output[:1], guarded.grabkit_batch
    with torch._C.DisableTorchFunctionSubclass():
        holds = any(
            not isinstance(t, BatchExpanded) and term[:1] == letter and t.shape[0] == batch
            for t, term in zip(operands, terms, strict=True)
        )
        if not letter or not holds:
            guarded._refuse("einsum")
        for i, t in enumerate(operands):
            if isinstance(t, BatchExpanded):
                if t.dim() != len(t.grabkit_model_shape) + 1 or letter in terms[i]:
                    guarded._refuse("einsum")
                terms[i] = letter + terms[i]
        try:
            return torch.einsum(",".join(terms) + "->" + output, *operands)
        except RuntimeError as error:
            guarded._refuse("einsum", error)


def _attention_result(args: tuple, kwargs: dict) -> torch.Size | None:
    """The shape of ``scaled_dot_product_attention``'s result with the model's own mask, when
    the expanded tensor is only the mask (None when it is a query, key or value)."""
    names = ("query", "key", "value", "attn_mask")
    operands = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    query, key, value, mask = operands
    if not isinstance(mask, BatchExpanded) or any(
        isinstance(t, BatchExpanded) for t in (query, key, value)
    ):
        return None
    try:
        batch = torch.broadcast_shapes(
            query.shape[:-2], key.shape[:-2], value.shape[:-2], mask.grabkit_model_shape[:-2]
        )
    except RuntimeError:
        return None
    return torch.Size((*batch, query.shape[-2], value.shape[-1]))


def _wrap(t: torch.Tensor, model_shape: torch.Size, layer: str, batch: int) -> BatchExpanded:
    with torch._C.DisableTorchFunctionSubclass():
        view = t.as_subclass(BatchExpanded)
    view.grabkit_model_shape = torch.Size(model_shape)
    view.grabkit_layer = layer
    view.grabkit_batch = batch
    return view


def expand_for_batch(output: torch.Tensor, expanded: torch.Tensor, layer: str) -> BatchExpanded:
    """What the model sees instead of ``output`` (its (B, ...) expansion ``expanded``)."""
    return _wrap(expanded, output.shape, layer, expanded.shape[0])
