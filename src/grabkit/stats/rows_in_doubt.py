"""A guard on a layer output whose rows are taken for the examples on the evidence of shape alone.

A layer input made inside the forward without autograd (not a view of the model's input, not a
parameter or buffer) whose dim 0 has the batch size B is taken to hold one row per example.
Where another of its dims, or of the model's inputs, has size B too (T == B), that is a guess:
Hugging Face BERT's (B, T) zero token types made when none are given, or a one-hot copy of the
(B, T) tokens, hold the examples, but T5's (T, T) relative-position buckets, a (T, T, 1) float
relative-position feature, a (T, d) sinusoidal table or a (T, 1) float copy of given position
ids are shared by the batch and only look like it. Shapes cannot tell them apart; what the
model does with the layer's output can. So the engine hands the model that output as a
``RowsInDoubt`` view (no copy, the same values), which checks at run time that the model treats
its dim 0 as the batch:

* an elementwise op (``+``, ``-``, ``*``, ``/``, ``torch.where``) with operands of no more dims,
  one of which holds the examples (a view of the model's input, or a tensor made from the
  outputs of layers called on the examples, as the engine answers): the rows meet the batch in
  dim 0, which ends the guard (BERT's ``inputs_embeds + token_type_embeddings``); with none
  such (a mask, a buffer, another table of the same shape) the question stays open and the
  guard continues on the result;
* an elementwise op with an operand of more dims: broadcasting would put dim 0 elsewhere, so the
  rows were not the examples (a (T, d) table's output added to (B, T, d) hidden states):
  ``ValueError``;
* ``permute``, ``transpose``, ``swapaxes``, ``movedim`` or ``.T`` that moves dim 0 (T5's
  ``values.permute([2, 0, 1])``), or an op that puts new dims in front of it (``unsqueeze(0)``,
  ``x[None]``, ``view(1, ...)``, ``expand(B, ...)``, ``repeat``): ``ValueError``;
* an op that keeps the rows in dim 0: a result of the same shape (a pointwise function, dropout,
  a softmax, a normalisation, a conversion), ``F.linear``, a transpose of later dims,
  ``unsqueeze``, ``squeeze``, ``view``, ``reshape`` or ``flatten`` that keep dim 0's size, an
  index that keeps dim 0 whole (``x[..., 0]``), a sum, mean or other reduction over later dims:
  the guard continues on the result;
* an ``einsum`` (explicit output), a matrix product or a ``torch.cat`` with other tensors: read
  like an elementwise op where dim 0 stays dim 0 of the result (ended beside the examples,
  continued beside other tables); ``ValueError`` where it goes elsewhere (an ``einsum`` that
  contracts it with the queries' positions, as relative position representations do; a
  ``matmul`` that broadcasts it against more dims or contracts it; a ``cat`` along dim 0);
* anything else (a reduction over dim 0 or all dims, an op that changes dim 0's size, an
  ``einsum`` with an ellipsis): the guard ends, the result plain (what the model computes never
  changes); a strict guard refuses instead. Strict guards are for inputs
  with fewer dims than a model input that holds the batch size elsewhere (a (B, f) time-step
  embedding beside (B, C, H, W) images with H == B), which only the model's use can clear.

A tracked layer whose rule takes its whole call (``MultiheadAttention``, a recurrent layer, the
torch.func fallback) runs on the plain tensor, since what it does inside is the layer's (its
rule knows its batch dim), and its output is guarded in turn (a recurrent layer's is left
plain). An op that meets an expanded shared output (``grabkit.stats.shared_inputs``) is left to
that one's checks, once a broadcast of the guarded rows against more dims is refused.

The cost of the guess: with T == B, a copy of the examples made without autograd (the model's
input scaled) whose layer output the model makes sequence-first (``transpose(0, 1)`` before a
``batch_first=False`` layer) is refused too, as a shared table's would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from grabkit.stats.shared_inputs import (
    ELEMENTWISE_OPS,
    MATMUL_OPS,
    ROW_WISE_OPS,
    BatchExpanded,
    einsum_terms,
    first_of,
    op_name,
)

__all__ = ["RowsInDoubt", "guard_rows"]

#: ops after which the rows stay in dim 0 where its size does: the guard goes on with the result
_ROW_KEEPING = ROW_WISE_OPS | {"unsqueeze", "squeeze", "view", "reshape", "flatten", "unflatten"}
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "logsumexp", "norm"})
_MOVES = frozenset(
    {"permute", "transpose", "swapaxes", "swapdims", "movedim", "t", "T", "mT", "H", "mH"}
)
#: ops that combine the rows with other tensors along dims they name (``_combined``)
_MATMULS = MATMUL_OPS | {"bmm"}
_COMBINING = _MATMULS | {"einsum", "cat", "concat", "concatenate"}


class RowsInDoubt(torch.Tensor):
    """A layer output whose dim 0 is taken for the examples by shape alone (see module).

    ``grabkit_layer`` is the layer's name, ``grabkit_input_shape`` the shape of its input.
    """

    grabkit_layer: str
    grabkit_input_shape: torch.Size
    #: an op the guard cannot follow refuses instead of ending the guard (see ``guard_rows``)
    grabkit_strict: bool
    #: ``examples(t)``: whether the tensor ``t`` holds the step's examples in dim 0 (the
    #: engine's answer: a view of the model's input, or made from its layers' outputs)
    grabkit_examples: Callable[[torch.Tensor], Any] | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if BatchExpanded in types:
            return _beside_expanded(name, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        guarded = first_of(RowsInDoubt, args)
        if guarded is None or not isinstance(out, torch.Tensor):
            return out
        if name in ELEMENTWISE_OPS:
            operands = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(a.dim() > guarded.dim() for a in operands):
                guarded._refuse(f"{name!r} with a tensor of more dims, which broadcasts it")
            if guarded._meets_examples(operands):
                return out.as_subclass(torch.Tensor)
            return guarded._carried(out)  # beside a mask, a buffer, another table: still rows
        if name.startswith("new_") or name.endswith("_like"):
            return out.as_subclass(torch.Tensor)  # not on its values (``x.new_zeros(...)``)
        if name in _COMBINING:
            return guarded._combined(name, args, kwargs, out)
        if args[0] is not guarded:
            return guarded._ended(name, out)
        if name in _MOVES and _moves_dim_0(name, guarded.dim(), args[1:], kwargs):
            guarded._refuse(f"{name!r}, which moves its dim 0")
        if _puts_dims_before(guarded.shape, out) or _indexes_none_first(name, args):
            guarded._refuse(f"{name!r}, which moves its dim 0 behind new dims")
        if _keeps_rows(name, guarded.shape, args, kwargs, out):
            return guarded._carried(out)
        return guarded._ended(name, out)

    def _carried(self, out: torch.Tensor) -> RowsInDoubt:
        return guard_rows(
            out, self.grabkit_layer, self.grabkit_input_shape,
            strict=self.grabkit_strict, examples=self.grabkit_examples,
        )  # fmt: skip

    def _ended(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The result of an op the guard does not follow (an ``einsum``, a ``torch.cat``, a
        matrix product, a reduction over dim 0): plain, or refused where the guard is strict."""
        if self.grabkit_strict:
            self._refuse(f"{name!r}, which PerSampleStats does not follow to the examples")
        return out.as_subclass(torch.Tensor)

    def _meets_examples(self, operands: list[torch.Tensor]) -> bool:
        """Whether an element-wise op pairs these rows with the examples': another operand of as
        many dims, with as many rows, that holds them (not a mask, a buffer or another table of
        the same shape, which would leave the question open)."""
        with torch._C.DisableTorchFunctionSubclass():
            rank = self.dim()
            return self._any_holds_examples([a for a in operands if a.dim() == rank])

    def _any_holds_examples(self, paired: list[torch.Tensor]) -> bool:
        """Whether one of ``paired`` (tensors whose dim 0 meets these rows) holds the examples."""
        examples = self.grabkit_examples
        if examples is None:
            return False
        with torch._C.DisableTorchFunctionSubclass():
            rows = self.shape[0]
            return any(
                not isinstance(a, RowsInDoubt) and a.shape[0] == rows and bool(examples(a))
                for a in paired
            )

    def _combined(self, name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        """An ``einsum``, a matrix product or a ``torch.cat`` with other tensors: refused where it
        takes the rows' dim 0 elsewhere than dim 0 of the result (an ``einsum`` that contracts it
        with the queries' positions, a ``matmul`` that broadcasts it against more dims); ended
        where it pairs them with the examples in dim 0; else the guard continues."""
        with torch._C.DisableTorchFunctionSubclass():
            placed = _rows_placed(name, self, args, kwargs)
        if isinstance(placed, str):
            self._refuse(placed)
        if placed is None:
            return self._ended(name, out)
        if self._any_holds_examples(placed):
            return out.as_subclass(torch.Tensor)
        return self._carried(out)

    def _refuse(self, what: str) -> NoReturn:
        shape = tuple(self.grabkit_input_shape)
        raise ValueError(
            f"layer {self.grabkit_layer!r} got an input of shape {shape} made inside the "
            f"forward without autograd, whose dim 0 has the batch size while another dim of it "
            f"or of the model's input has it too (T == B), so PerSampleStats took its rows for "
            f"the examples; but the model passes the layer's output to {what}, as it would a "
            f"table shared by the batch (T5's (T, T) relative-position buckets, a (T, d) "
            f"position table or a relative-position feature made in the forward), not rows of "
            f"examples. PerSampleStats cannot tell them apart by shape: use a batch size that "
            f"differs from the sequence lengths."
        )


def _beside_expanded(name: str, args: tuple, kwargs: dict) -> Any:
    """An op on a guarded output and an expanded shared one (``BatchExpanded``): refused where
    it broadcasts the guarded rows against more dims, else left to the expanded one's checks
    (``NotImplemented``), which decide what the model computes."""
    operands = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    guarded = next(a for a in operands if isinstance(a, RowsInDoubt))
    with torch._C.DisableTorchFunctionSubclass():
        wider = any(a.dim() > guarded.dim() for a in operands)
    if name in ELEMENTWISE_OPS and wider:
        guarded._refuse(f"{name!r} with a tensor of more dims, which broadcasts it")
    return NotImplemented


def _puts_dims_before(shape: torch.Size, out: torch.Tensor) -> bool:
    """Whether ``out`` has the dims of ``shape`` behind new ones (``x[None]``, ``unsqueeze(0)``,
    ``view(1, *shape)``, ``expand(B, *shape)``, ``repeat``, ``expand_as`` a (B, ...) tensor), as
    a table shared by the batch is given a batch dim; ``new_zeros`` and its kind make a tensor
    unrelated to the values."""
    rank = len(shape)
    return out.dim() > rank and tuple(out.shape[out.dim() - rank :]) == tuple(shape)


def _indexes_none_first(name: str, args: tuple) -> bool:
    """Whether ``args`` index with a new dim in front (``x[None, ..., 0]``)."""
    if name != "__getitem__" or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return bool(index) and index[0] is None


def _keeps_rows(name: str, shape: torch.Size, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """Whether ``out``, the result of ``name`` on a tensor of ``shape`` (its first argument),
    holds that tensor's rows in its dim 0: a result of the same shape (a pointwise function,
    dropout, a softmax, a normalisation, a conversion), ``F.linear``, a transpose of later dims,
    ``unsqueeze``, ``squeeze``, ``view``, ``reshape`` or ``flatten`` that keep dim 0's size, an
    index that keeps dim 0 whole (``x[..., 0]``, ``x[:, None]``), a reduction over later dims."""
    if out.dim() == 0 or out.shape[0] != shape[0]:
        return False
    if out.shape == shape or name in _ROW_KEEPING or name in _MOVES:
        return True
    if name in _REDUCTIONS:
        return _reduces_later_dims(len(shape), args, kwargs)
    if name != "__getitem__":
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    first = index[0] if index else None
    return first is Ellipsis or (isinstance(first, slice) and first == slice(None))


def _reduces_later_dims(rank: int, args: tuple, kwargs: dict) -> bool:
    """Whether a reduction called with ``args`` and ``kwargs`` names its dims and dim 0 is not
    among them (``bias.sum(-1)``)."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None:
        return False
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return bool(dims) and all(int(d) % rank != 0 for d in dims)


def _moves_dim_0(name: str, rank: int, args: tuple, kwargs: dict) -> bool:
    """Whether ``name(*args)`` on a tensor of ``rank`` dims puts another dim first."""
    if name in ("t", "mT", "mH"):
        return rank == 2
    if name in ("T", "H"):
        return rank > 1
    if name == "permute":
        dims = args if args and isinstance(args[0], int) else tuple(args[0] if args else ())
        dims = dims or tuple(kwargs.get("dims", ()))
        return bool(dims) and int(dims[0]) % rank != 0
    if name == "movedim":
        source = args[0] if args else kwargs.get("source")
        dest = args[1] if len(args) > 1 else kwargs.get("destination")
        sources = [source] if isinstance(source, int) else list(source)
        dests = [dest] if isinstance(dest, int) else list(dest)
        return any((s % rank == 0) != (d % rank == 0) for s, d in zip(sources, dests, strict=True))
    first = args[0] if args else kwargs.get("dim0")
    second = args[1] if len(args) > 1 else kwargs.get("dim1")
    return (int(first) % rank == 0) != (int(second) % rank == 0)


def guard_rows(
    output: torch.Tensor,
    layer: str,
    input_shape: torch.Size,
    *,
    strict: bool = False,
    examples: Callable[[torch.Tensor], Any] | None = None,
) -> RowsInDoubt:
    """What the model sees instead of ``output`` (the same tensor, guarded).

    ``strict``: an op the guard cannot follow refuses rather than ending the guard, for an input
    that nothing but the model's use can clear (fewer dims than a model input that holds the
    batch size elsewhere: a (B, f) time embedding beside (B, C, H, W) images with H == B).
    ``examples(t)`` tells whether a tensor holds the step's examples; without it no element-wise
    op ends the guard."""
    with torch._C.DisableTorchFunctionSubclass():
        view = output.as_subclass(RowsInDoubt)
    view.grabkit_layer = layer
    view.grabkit_input_shape = torch.Size(input_shape)
    view.grabkit_strict = strict
    view.grabkit_examples = examples
    return view


def _rows_placed(
    name: str, guarded: RowsInDoubt, args: tuple, kwargs: dict
) -> list[torch.Tensor] | str | None:
    """Where an op combining ``guarded`` with other tensors puts its dim 0: the other operands
    whose dim 0 meets it in dim 0 of the result (a list, maybe empty), the reason it is refused
    (it goes elsewhere), or None where the op's arguments are not read here."""
    if name == "einsum":
        return _einsum_rows(guarded, args)
    if name in _MATMULS:
        first, second = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
        others = [t for t in (first, second) if t is not guarded]
        if any(t.dim() > guarded.dim() for t in others):
            return f"{name!r} with a tensor of more dims, which broadcasts it"
        if guarded.dim() > 2:  # a batch dim: paired with the other operand's dim 0
            return [t for t in others if t.dim() == guarded.dim()]
        return [] if first is guarded else f"{name!r}, which contracts its dim 0"
    tensors = args[0] if args else kwargs.get("tensors", ())
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(dim, int) or any(t.dim() != guarded.dim() for t in tensors):
        return None
    if dim % guarded.dim() == 0:
        return f"{name!r} along its dim 0, which puts other rows among its rows"
    return [t for t in tensors if t is not guarded]


def _einsum_rows(guarded: RowsInDoubt, args: tuple) -> list[torch.Tensor] | str | None:
    """``_rows_placed`` for ``einsum(equation, *operands)`` with an explicit output."""
    parsed = einsum_terms(args)
    if parsed is None:
        return None
    operands, terms, output = parsed
    at = next((i for i, t in enumerate(operands) if t is guarded), None)
    if at is None or not terms[at]:
        return None
    letter = terms[at][0]
    if output[:1] != letter:
        where = f"dim {output.index(letter)}" if letter in output else "a sum over it"
        return f"'einsum', which takes its dim 0 to {where} of the result"
    return [t for i, t in enumerate(operands) if i != at and terms[i][:1] == letter]
