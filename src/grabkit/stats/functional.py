"""Functional uses of tracked weights inside the model's forward, recorded as extra layer calls.

A weight is usually used by calling its layer, where the layer's hooks see the input and the
output gradient. The same weight may also be used *functionally*: the tied head
``logits = F.linear(h, self.wte.weight)`` of a language model whose ``wte`` is also called as a
module, ``h @ self.wte.weight.T``, ``F.embedding(idx, self.head.weight)``. Those uses are
products of tensors the engine can reach as well, so ``FunctionalUses`` (a
``torch.overrides.TorchFunctionMode`` active only during the model's forward) intercepts them
and records each as one more call with the rule of the equivalent layer:

* ``F.linear(x, W, b)`` and ``x @ W.T`` / ``torch.matmul(x, W.t())`` / ``F.linear(x, W.T.T)``: as
  ``nn.Linear`` (W's gradient sum_t D_t x_t^T; b's sum_t D_t);
* ``x @ W`` / ``torch.matmul(x, W)``: as transformers' ``Conv1D`` (W stored (in, out));
* ``F.embedding(idx, W, padding_idx=...)``: as ``nn.Embedding``.

Any other operation that takes a tracked parameter outside its own layer and returns a tensor
that requires grad (``W.sum()``, ``W * mask``, ``F.conv2d(x, other.weight)``, ...) is noted, and
reading the step's statistics raises ``NotImplementedError`` naming the parameter and the
operation (no per-example factor exists for it). So is any use inside a ``torch.func``
transform (``torch.vmap(lambda row: W @ row)(h)``): a batched tensor there reports no
``requires_grad``, yet the gradient reaches W, through rows no rule reads. Uses that carry no
gradient pass: shape and dtype queries, ``W.detach()``, anything under ``torch.no_grad()``.

"Its own layer" is the tracked layer whose forward is running (the engine keeps a stack of
them): ``nn.Linear``'s own ``F.linear(input, self.weight)`` is the layer's call, not a
functional use; so is ``nn.MultiheadAttention`` reading ``out_proj.weight`` (its rule covers its
children). Cost: one Python call per torch function in the model's forward (about 10-20 us
per intercepted function on a loaded CPU, 7% of a small MLP's step), so by default
(``functional_uses="auto"``) the engine watches only the forwards of the first step with a
backward and keeps watching if that step made a functional use; ``True`` watches every forward,
``False`` none. A use the watch did not see is reported by the identity check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from grabkit.stats.rules import EmbeddingRule, LayerRule, LinearRule, TransposedLinearRule

__all__ = ["TRANSFORMED", "FunctionalUse", "FunctionalUses", "functorch_transform_active"]


def _no_transform() -> bool:
    return False


#: True inside torch.func transforms (vmap, grad) (the C function itself, called in every hook)
functorch_transform_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", _no_transform
)

#: how a refused use inside a transform is named (``PerSampleStats`` adds the fix)
TRANSFORMED = "inside a torch.func transform (torch.vmap, torch.func.grad)"

_LINEAR = {F.linear, torch._C._nn.linear}
_EMBEDDING = {F.embedding, torch.embedding}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_TRANSPOSES = {torch.t, torch.Tensor.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__}
_TRANSPOSE_DIMS = {torch.transpose, torch.Tensor.transpose}


@dataclass
class FunctionalUse:
    """The layer-like stand-in a rule reads for one kind of functional use of a weight
    (``in_features`` etc. as the equivalent module has them)."""

    kind: str  # "linear", "transposed-linear" or "embedding"
    weight: nn.Parameter
    bias: nn.Parameter | None = None
    padding_idx: int | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def rule(self) -> LayerRule:
        return _RULES[self.kind]


_RULES: dict[str, LayerRule] = {
    "linear": LinearRule(),
    "transposed-linear": TransposedLinearRule(),
    "embedding": EmbeddingRule(),
}


@dataclass
class _Hit:
    """A tracked parameter (or a transposed view of one) among a call's arguments."""

    name: str
    param: nn.Parameter
    position: int  # in args, or -1 for a keyword
    transposed: bool


def _is_transpose(func, args: tuple, kwargs: dict, hit: _Hit) -> bool:
    """Whether ``func`` transposes the 2-D tracked parameter ``hit`` (a module-level function,
    not a static method: Dynamo fails to guard a static method read through the mode when a
    compiled submodule's forward is traced under the watch)."""
    if hit.transposed or hit.param.dim() != 2 or hit.position != 0:
        return False
    if func in _TRANSPOSES:
        return True
    if func in _TRANSPOSE_DIMS:
        dims = [*args[1:3], *kwargs.values()]
        return len(dims) == 2 and {int(d) % 2 for d in dims} == {0, 1}
    return False


def _transposes(view: torch.Tensor, param: nn.Parameter) -> bool:
    """Whether ``view`` (a view of ``param``) is its transpose: W.T's shape and strides."""
    return (
        param.dim() == 2
        and view.shape == param.shape[::-1]
        and view.stride() == param.stride()[::-1]
        and view.storage_offset() == param.storage_offset()
    )


class FunctionalUses(TorchFunctionMode):
    """Sees every torch function of the model's forward; hands functional uses to ``record``.

    Args:
        owners: id(parameter) -> (full name, parameter, ids of the tracked layer modules that
            own it).
        record: called as ``record(use, name_of_weight, name_of_bias, layer_input, output)`` for a
            use a rule covers; it hooks the output and returns what the model should see.
        refuse: called as ``refuse(parameter_name, operation_name)`` for any other use.
    """

    def __init__(
        self,
        owners: dict[int, tuple[str, nn.Parameter, frozenset[int]]],
        record: Callable[..., torch.Tensor],
        refuse: Callable[[str, str], None],
    ) -> None:
        super().__init__()
        self.owners = owners
        self.record, self.refuse = record, refuse
        self.running: list[int] = []  # ids of the tracked layer modules whose forward runs

    def reset(self) -> None:
        self.running.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = self._tracked_argument(args, kwargs)
        if hit is None:
            return func(*args, **kwargs)
        return self._use(func, args, kwargs, hit)

    def _tracked_argument(self, args: tuple, kwargs: dict) -> _Hit | None:
        for position, value in enumerate(args):
            hit = self._hit(value, position)
            if hit is not None:
                return hit
        for value in kwargs.values():
            hit = self._hit(value, -1)
            if hit is not None:
                return hit
        return None

    def _hit(self, value: Any, position: int) -> _Hit | None:
        key = id(value)
        owner = self.owners.get(key)
        if owner is not None:
            name, param, layers = owner
            if self.running and self.running[-1] in layers:
                return None  # the layer's own use
            return _Hit(name, param, position, False)
        return self._transposed_hit(value, position)

    def _transposed_hit(self, value: Any, position: int) -> _Hit | None:
        """``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` of a tracked 2-D parameter W, told by
        its layout (a view of W, shape and strides reversed), not by the id of the view: the
        view is made anew at every call, and Dynamo cannot guard an id inside a compiled
        submodule."""
        # a plain tensor only: a subclass's attributes are its own (an expanded shared output
        # refuses them), and a view of a parameter is a plain tensor
        base = value._base if type(value) is torch.Tensor else None
        owner = None if base is None else self.owners.get(id(base))
        if owner is None or value.grad_fn is None or not _transposes(value, owner[1]):
            return None  # (a view made under no_grad has no grad_fn: no gradient reaches W)
        name, param, layers = owner
        if self.running and self.running[-1] in layers:
            return None  # the layer's own use
        return _Hit(name, param, position, True)

    def _use(self, func, args: tuple, kwargs: dict, hit: _Hit) -> Any:
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if functorch_transform_active():  # its rows are not the batch's: no rule reads them
            self.refuse(hit.name, f"{getattr(func, '__name__', repr(func))} {TRANSFORMED}")
            return func(*args, **kwargs)
        if func in _LINEAR and hit.position == 1:
            return self._linear(args, kwargs, hit)
        if func in _MATMUL and hit.position == 1 and len(args) == 2:
            kind = "linear" if hit.transposed else "transposed-linear"
            return self.record(FunctionalUse(kind, hit.param), hit.name, None, args[0], func(*args))
        if func in _EMBEDDING and hit.position == 1 and not hit.transposed:
            return self._embedding(func, args, kwargs, hit)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out  # a shape or dtype query, a detached copy: no gradient flows
        if _is_transpose(func, args, kwargs, hit):
            return out  # seen as W's transpose where it is used (``_transposed_hit``)
        self.refuse(hit.name, getattr(func, "__name__", repr(func)))
        return out

    def _linear(self, args: tuple, kwargs: dict, hit: _Hit) -> Any:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        out = F.linear(*args, **kwargs)
        bias_name = None
        if isinstance(bias, torch.Tensor) and bias.requires_grad:
            owner = self.owners.get(id(bias))
            if owner is None:
                self.refuse(hit.name, "F.linear with a bias that is not a tracked parameter")
                return out
            bias_name = owner[0]
        kind = "transposed-linear" if hit.transposed else "linear"
        use = FunctionalUse(kind, hit.param, bias if bias_name else None)
        return self.record(use, hit.name, bias_name, args[0], out)

    def _embedding(self, func, args: tuple, kwargs: dict, hit: _Hit) -> Any:
        options = dict(zip(("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                            "sparse"), args[2:], strict=False))  # fmt: skip
        options.update(kwargs)
        out = func(*args, **kwargs)
        if options.get("scale_grad_by_freq") or options.get("sparse"):
            self.refuse(hit.name, "F.embedding with scale_grad_by_freq or sparse")
            return out
        padding = options.get("padding_idx")
        if padding is not None and padding < 0:
            padding += hit.param.shape[0]
        use = FunctionalUse("embedding", hit.param, padding_idx=padding)
        return self.record(use, hit.name, None, args[0], out)
