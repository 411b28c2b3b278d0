"""``PerSampleStats``: exact per-example gradient statistics from an ordinary forward/backward.

Attach once to a model. During the forward pass a hook on each layer that owns trainable
parameters keeps a reference to the layer's input (a tensor autograd keeps for the backward
anyway) and puts a hook on the layer's output tensor (on each output its rule needs: a recurrent
layer's output sequence and final states), which receives the gradient of that output during
``loss.backward()``. A hook on each trainable parameter receives this backward's batch
gradient before it is accumulated into ``.grad`` and copies it (``.grad`` may be changed in place
later), into the previous step's copy when no statistics of that step are still held: one
tensor the size of the trainable parameters lives between steps instead of a fresh one being
allocated, and page-faulted in, at every backward. Nothing else runs during the step: norms,
dots, Gram matrices and weighted sums are computed on read, layer by layer, from those factors
(see ``grabkit.stats.rules``), never building a (B, d) tensor.

The first forward pass (with grad enabled) after a backward starts a new step and drops the
previous step's references, so the statistics always describe the latest backward's batch
(with gradient accumulation over micro-batches: the latest micro-batch). Forward passes under
``torch.no_grad()`` or inside ``torch.func`` transforms are ignored. Callables in
``step_listeners`` run just before that drop, so a consumer can keep each micro-batch's
statistics (``grabkit.order`` does, to balance every micro-batch of an accumulated step).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from grabkit.sharding import refuse_flat_parameters
from grabkit.stats.factors import ParameterFactor, as_dtype, combine
from grabkit.stats.fallback import TorchFuncFallbackRule
from grabkit.stats.gradient_batch import FlatLayout
from grabkit.stats.hook_batch import HookGradientBatch
from grabkit.stats.rules import LayerRule, find_rule
from grabkit.stats.source import StatisticsSource
from grabkit.stats.step import StepStatistics
from grabkit.taps import GradientTaps

__all__ = ["PerSampleStats", "unwrap_data_parallel"]

_LOSS_REDUCTIONS = ("mean", "sum")

# module -> the PerSampleStats whose hooks are on it (one engine per module at a time)
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, PerSampleStats] = weakref.WeakKeyDictionary()


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (where hooks go, so that
    parameter names and DDP's buckets and ``no_sync`` are those of the plain model)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _inside_backward() -> bool:
    """True while autograd runs a backward: a forward now is activation checkpointing's
    recomputation, part of the current step, not a new one."""
    return torch._C._current_graph_task_id() != -1


def _functorch_transform_active() -> bool:
    """True inside torch.func transforms (vmap, grad): such calls are not this model's step."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


class _Call:
    """One forward call of a tracked layer: what its rule kept, and its output's gradient.

    For a rule with ``multiple_outputs``, ``output_grad`` is a list with one slot per tracked
    output (None until the first of them receives a gradient) and ``batch_size`` is the number
    of examples the rule found in the call.
    """

    __slots__ = ("batch_size", "captured", "output_grad")

    def __init__(self, captured: object, batch_size: int | None = None) -> None:
        self.captured = captured
        self.output_grad: torch.Tensor | list[torch.Tensor | None] | None = None
        self.batch_size = batch_size


def _detached_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A call's (args, kwargs) with every tensor detached (references, not copies)."""

    def detach(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}


def _outer_dim_is_not_first(x: torch.Tensor) -> bool:
    """Whether some dim of size > 1 has a larger stride than dim 0 (a transposed view)."""
    if x.stride(0) == 0:  # dim 0 broadcast: the same activation for every example
        return False
    return any(x.stride(k) > x.stride(0) for k in range(1, x.dim()) if x.shape[k] > 1)


class _ModelBatch:
    """The examples of one step: dim 0 of the model's first tensor input, and its storages.

    ``align`` tells, for a layer's input, whether its dim 0 holds those examples or whether the
    input is shared by the whole batch (position ids ``torch.arange(T)`` of shape (T,), or
    Hugging Face's (1, T)): a shared input contributes the same activation to every example,
    so the layer's output is expanded to (B, ...) (a broadcast the model did anyway) and each
    example's own output gradient reaches the hook.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.size = tensors[0].shape[0]
        self.shape = tuple(tensors[0].shape)
        self._storages = {t.untyped_storage().data_ptr() for t in tensors}

    def _is_shared(self, x: torch.Tensor) -> bool:
        """A tensor made outside autograd and not a view of the model's inputs."""
        return x.grad_fn is None and x.untyped_storage().data_ptr() not in self._storages

    def check_batch_dim(self, name: str, size: int, x: torch.Tensor | None, dim: int) -> None:
        """Refuse a layer call that holds ``size`` examples (in dim ``dim`` of its input ``x``)
        unless they are this batch's, and an ``x`` whose batch dim cannot be told from another
        dim of the same size (the batch dim must be the outermost of them in memory)."""
        where = "its input" if x is None else f"dim {dim} of its input of shape {tuple(x.shape)}"
        if size != self.size:
            raise ValueError(
                f"layer {name!r} holds {size} examples in {where}, but the model's input has "
                f"{self.size} (dim 0 of {self.shape}). PerSampleStats needs the examples in dim "
                f"0 of the model's input and in the batch dim of every layer (check the layer's "
                f"batch_first, and that the model's input is batch-first)."
            )
        if x is None or size == 1:
            return
        rivals = [k for k in range(x.dim()) if k != dim and x.shape[k] == size]
        if any(x.stride(k) >= x.stride(dim) for k in rivals):
            raise ValueError(
                f"layer {name!r} got an input of shape {tuple(x.shape)} and strides "
                f"{x.stride()} whose batch dim {dim} has the size of dim(s) {rivals} and is not "
                f"the outermost of them in memory, so PerSampleStats cannot tell that it holds "
                f"the examples (a sequence-first model input with T == B?). Feed the model "
                f"batch-first inputs (a view such as x.transpose(0, 1) before a "
                f"batch_first=False layer is fine), or use a batch size that differs from the "
                f"other dims."
            )

    def align(
        self, name: str, x: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input as (B, ...), expanded output or None when the output is already per-example)."""
        b = self.size
        if x.dim() > 0 and x.shape[0] == b:
            if x.dim() < len(self.shape) and b in self.shape[1:] and self._is_shared(x):
                raise ValueError(
                    f"layer {name!r} got an input of shape {tuple(x.shape)} that is not derived "
                    f"from the model's input {self.shape}, whose batch size {b} also appears "
                    f"among its other dims: PerSampleStats cannot tell whether dim 0 holds the "
                    f"examples or is shared by all of them (say positions torch.arange(T) with "
                    f"T == B). Give that input an explicit batch dim (e.g. "
                    f"pos.unsqueeze(0).expand(B, -1)) or use a batch size that differs from "
                    f"the other dims."
                )
            if b in x.shape[1:] and _outer_dim_is_not_first(x):
                raise ValueError(
                    f"layer {name!r} got an input of shape {tuple(x.shape)} and strides "
                    f"{x.stride()}: dim 0 is not its outermost dim (a transposed, sequence-first "
                    f"view?), and the batch size {b} also appears among its other dims, so "
                    f"PerSampleStats cannot tell which dim holds the examples. Use batch_first "
                    f"layouts, or call .contiguous() on a batch-first input."
                )
            return x, None
        if not self._is_shared(x):
            raise ValueError(
                f"layer {name!r} got an input of shape {tuple(x.shape)} computed from the "
                f"model's input, but its dim 0 is not the batch ({b} examples, dim 0 of the "
                f"model's input {self.shape}). PerSampleStats needs the examples in dim 0 of "
                f"every layer's input: use batch_first layouts (batch_first=True, or transpose "
                f"before the layer)."
            )
        if x.dim() > 0 and x.shape[0] == 1 and output.dim() > 0 and output.shape[0] == 1:
            return x.expand(b, *x.shape[1:]), output.expand(b, *output.shape[1:])
        return x.unsqueeze(0).expand(b, *x.shape), output.unsqueeze(0).expand(b, *output.shape)


class _TrackedLayer:
    """A layer that owns trainable parameters: its rule and its parameters' full names."""

    def __init__(self, name: str, module: nn.Module, rule: LayerRule, params: dict[str, str]):
        self.name = name
        self.module = module
        self.rule = rule
        self.params = params  # local name ("weight") -> full name ("encoder.0.weight")
        self.calls: list[_Call] = []


class PerSampleStats(StatisticsSource):
    """Per-example gradient statistics of ``model`` read after each ``loss.backward()``.

    Here g_i is the gradient of example i's own loss term l_i, over the model's trainable
    parameters (frozen ones are skipped), where the batch loss is ``mean_i l_i``
    (``loss_reduction="mean"``) or ``sum_i l_i`` (``"sum"``) and example i is row i of dim 0 of
    every layer's input.

    Args:
        model: the ``nn.Module``; every layer that owns trainable parameters needs a rule
            (``grabkit.stats.rules.register_rule``).
        loss_reduction: ``"mean"`` or ``"sum"``, how the batch loss combines the examples.
        torch_func_fallback: layers with trainable parameters but no rule get their per-example
            gradients by ``torch.func`` (materialised for that layer only; see
            ``grabkit.stats.fallback``) instead of an error at attach time.
        keep_batch_gradients: keep each backward's batch gradient (a copy per parameter, for
            ``total()``, ``weighted_sum`` and ``statistics()``). With False only the parameters'
            names are noted (to catch a parameter used outside its layer) and only
            ``step_factors()`` can be read: the sketches of ``grabkit.stats.sketch`` need no more.
        batch_norm_constant_statistics: BatchNorm in training mode raises by default (its
            batch statistics couple the examples, so per-example gradients are not defined).
            With True it runs, and g_i is *defined* as each layer's per-example share of the
            batch gradient: sum_t D[i, t] A[i, t]^T from the batch loss's output gradient D and
            the layer input A (for BatchNorm's affine parameters D_i * xhat_i), i.e. the batch
            statistics held as constants. These g_i sum to the batch gradient but differ from
            the gradient of example i's loss alone for BatchNorm and every layer before it.

    Reads (after ``loss.backward()``): ``norms_squared()`` (B,), ``dot(vectors)`` (B,),
    ``gram()`` (B, B), ``weighted_sum(weights)`` {name: tensor}, ``total()`` {name: tensor},
    ``gradient_batch()`` (a ``GradientBatch`` in the flat layout of ``param_shapes``).

    Example::

        with PerSampleStats(model) as stats:
            loss_fn(model(x), y).backward()
            norms = stats.norms_squared()  # (B,)

    The examples are dim 0 of the model's first tensor input. A layer whose input is shared by
    the batch (no batch dim, such as ``wpe(torch.arange(T))``, or a leading dim of 1 such as
    Hugging Face's (1, T) position ids) gives every example the same activation: its output is
    expanded to (B, ...) (so the model sees the broadcast it would have done anyway) and each
    example gets its own share. Where dim 0 cannot be told apart from another dim, it raises.
    A parameter shared by several layers (tied embedding and output head) gets the sum of its
    uses, cross terms included. A layer called several times in one forward is handled exactly
    (its per-example gradient is the sum over the calls). BatchNorm in training mode raises
    unless ``batch_norm_constant_statistics=True``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: str = "mean",
        *,
        torch_func_fallback: bool = False,
        batch_norm_constant_statistics: bool = False,
        keep_batch_gradients: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleStats expects an nn.Module, but got {type(model).__name__}")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(
                f"`loss_reduction` should be one of {_LOSS_REDUCTIONS}, but got "
                f"loss_reduction={loss_reduction!r}"
            )
        refuse_flat_parameters(model.parameters(), "PerSampleStats")  # FSDP1
        self.model = model
        self.loss_reduction = loss_reduction
        self._check_not_attached(model)

        names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        if not names:
            raise ValueError("the model has no parameters that require grad; nothing to measure")
        first = next(p for p in model.parameters() if p.requires_grad)
        self.dtype = first.dtype
        self.device = first.device
        self.param_shapes: dict[str, torch.Size] = {
            name: p.shape for name, p in model.named_parameters() if p.requires_grad
        }
        self._layout = FlatLayout(self.param_shapes)
        self.torch_func_fallback = bool(torch_func_fallback)
        self.batch_norm_constant_statistics = bool(batch_norm_constant_statistics)
        self.keep_batch_gradients = bool(keep_batch_gradients)
        #: counts every change of the recorded statistics (a gradient arrived, a step began), so
        #: a reader can cache what it computed from them
        self.generation = 0
        self._layers = self._find_layers(model, names, self.torch_func_fallback)
        self._handles: list[Any] = []
        self._warned: set[nn.Module] = set()
        #: called (no arguments) after a backward, before the next step's first forward drops
        #: that backward's statistics; ``statistics()`` still reads them inside the call
        self.step_listeners: list[Callable[[], None]] = []
        self._new_step()
        self._attach(model)

    # -- attaching ---------------------------------------------------------------------------
    @staticmethod
    def _check_not_attached(model: nn.Module) -> None:
        for name, module in model.named_modules():
            if module in _ATTACHED:
                where = f"this model's submodule {name!r}" if name else "this model"
                raise RuntimeError(
                    f"a PerSampleStats is already attached to {where}; call close() on the "
                    f"existing one (or leave its `with` block) before attaching "
                    f"another."
                )

    @staticmethod
    def _find_layers(
        model: nn.Module, names: dict[int, str], fallback: bool
    ) -> list[_TrackedLayer]:
        layers: list[_TrackedLayer] = []
        seen: set[int] = set()
        for module_name, module in model.named_modules(remove_duplicate=False):
            if id(module) in seen:
                continue
            rule = find_rule(module)
            covers = bool(getattr(rule, "covers_children", False))
            own = {
                local: p for local, p in module.named_parameters(recurse=covers) if p.requires_grad
            }
            if not own:
                continue
            seen.update(id(m) for m in (module.modules() if covers else [module]))
            label = module_name or "<root>"
            if rule is None and fallback:
                rule = TorchFuncFallbackRule()
            if rule is None:
                raise ValueError(
                    f"layer {label!r} ({type(module).__name__}) owns trainable parameters "
                    f"{sorted(own)} but PerSampleStats has no rule for it. Freeze those "
                    f"parameters, build the layer from supported ones (Linear, Conv1d, Conv2d, "
                    f"MultiheadAttention, LSTM, GRU, RNN, transformers Conv1D, "
                    f"Embedding, LayerNorm, RMSNorm, GroupNorm, BatchNorm), or register a rule "
                    f"with grabkit.stats.register_rule({type(module).__name__}, rule), or pass "
                    f"torch_func_fallback=True (per-example gradients of that layer by torch.func)."
                )
            rule.check(module)
            params = {local: names[id(p)] for local, p in own.items()}
            layers.append(_TrackedLayer(label, module, rule, params))
        return layers

    def _attach(self, model: nn.Module) -> None:
        self._handles.append(
            model.register_forward_pre_hook(self._on_model_input, with_kwargs=True)
        )
        for layer in self._layers:
            hook = functools.partial(self._on_forward, layer)
            self._handles.append(layer.module.register_forward_hook(hook, with_kwargs=True))
            _ATTACHED[layer.module] = self
        # taps, not p.register_hook: under fully_shard the forward uses unsharded copies
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        on_grad = functools.partial(self._on_tapped_grad, [name for name, _ in named])
        self._handles.append(GradientTaps(named, on_grad, model))
        _ATTACHED[model] = self

    def close(self) -> None:
        """Remove every hook and drop the kept references; the object can no longer record."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in [self.model, *(layer.module for layer in self._layers)]:
            if _ATTACHED.get(module) is self:
                del _ATTACHED[module]
        self._new_step()
        self._spare_grads = {}

    def __enter__(self) -> PerSampleStats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- recording ---------------------------------------------------------------------------
    def _new_step(self) -> None:
        if getattr(self, "_backward_seen", False):
            for listener in list(self.step_listeners):
                listener()  # before the finished step's data is dropped
        for layer in getattr(self, "_layers", []):
            layer.calls = []
        copies = getattr(self, "_param_grads", {})
        readers = getattr(self, "_readers", [])
        self._param_grads: dict[str, torch.Tensor | None] = {}
        self._backward_seen = False
        self.generation = getattr(self, "generation", 0) + 1
        self._statistics: StepStatistics | None = None
        self._batch: _ModelBatch | None = None
        # StepStatistics built on this step (weakly): while one lives, its copies are its own
        self._readers: list[weakref.ref[StepStatistics]] = []
        if all(reader() is None for reader in readers):
            # Nothing outside the engine holds the finished step's gradient copies: the next
            # backward copies into them instead of into fresh memory (a fresh tensor the size of
            # a large layer costs more in page faults than the copy itself, on the CPU).
            self._spare_grads: dict[str, torch.Tensor] = copies

    def _on_model_input(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Record the batch size from the model's first tensor input (dim 0): the examples.

        A 1-D floating input is one unbatched vector, not a batch: nothing is recorded and the
        layers' rules report it.
        """
        if not torch.is_grad_enabled() or _functorch_transform_active():
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0 or _inside_backward():
            return
        if tensors[0].dim() == 1 and tensors[0].is_floating_point():
            return
        if self._backward_seen:
            self._new_step()
        self._batch = _ModelBatch(tensors)

    def _on_forward(
        self,
        layer: _TrackedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        if not torch.is_grad_enabled() or _functorch_transform_active():
            return None
        if layer.rule.multiple_outputs:
            replaced = layer.rule.replace_output(module, output)
            output = output if replaced is None else replaced
            self._record_multiple_outputs(layer, module, (args, kwargs, output))
            return replaced
        if layer.rule.whole_call and isinstance(output, tuple) and output:
            output = output[0]  # e.g. MultiheadAttention's (out, weights)
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        # A recomputed call (checkpointing) is recorded as one more call: with use_reentrant=True
        # only it receives the output gradient; with False only the original call does.
        if self._backward_seen and not _inside_backward():
            self._new_step()
        self._check_training_mode(layer, module)
        layer_input, expanded = self._layer_input(layer, args, kwargs, output)
        call = _Call(layer.rule.capture(module, layer_input))
        layer.calls.append(call)
        hooked = output if expanded is None else expanded
        hooked.register_hook(functools.partial(self._on_output_grad, call))
        return expanded

    def _record_multiple_outputs(
        self, layer: _TrackedLayer, module: nn.Module, whole_call: tuple[tuple, dict, Any]
    ) -> None:
        """Record a call ``(args, kwargs, output)`` of a ``multiple_outputs`` rule: a hook on each
        output tensor it needs."""
        args, kwargs, output = whole_call
        tensors = layer.rule.output_tensors(module, output)
        hooked = [
            (slot, t)
            for slot, t in enumerate(tensors)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not hooked:
            return
        if self._backward_seen and not _inside_backward():
            self._new_step()
        self._check_training_mode(layer, module)
        x, dim, size = layer.rule.call_batch(module, args, kwargs)
        if self._batch is not None:
            self._batch.check_batch_dim(layer.name, size, x, dim)
        call = _Call(layer.rule.capture(module, whole_call), batch_size=size)
        layer.calls.append(call)
        for slot, t in hooked:
            t.register_hook(functools.partial(self._on_output_slot_grad, call, slot, len(tensors)))

    def _layer_input(
        self,
        layer: _TrackedLayer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: torch.Tensor,
    ) -> tuple[Any, torch.Tensor | None]:
        """(what the rule keeps from the call, the output expanded to (B, ...) or None).

        The first input is checked against the step's batch (``_ModelBatch.align``); a rule
        with ``whole_call`` keeps every input instead.
        """
        layer_input = args[0] if args else next(iter(kwargs.values()))
        expanded = None
        if isinstance(layer_input, torch.Tensor):
            if self._batch is not None:
                layer_input, expanded = self._batch.align(layer.name, layer_input, output)
            if layer.rule.whole_call and expanded is not None:
                raise NotImplementedError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}) got an input shared "
                    f"by the batch (shape {tuple(layer_input.shape)}), which its rule cannot "
                    f"take; give the input an explicit batch dim (expand it to (B, ...))."
                )
            layer_input = layer_input.detach()  # a reference, not a copy
        if layer.rule.whole_call:
            layer_input = _detached_call(args, kwargs)
        return layer_input, expanded

    def _check_training_mode(self, layer: _TrackedLayer, module: nn.Module) -> None:
        message = layer.rule.training_mode_warning
        if not message or not module.training:
            return
        if not self.batch_norm_constant_statistics:
            raise ValueError(
                f"layer {layer.name!r} ({type(module).__name__}) runs in training mode, where it "
                f"normalises with the batch's mean and variance: every example's output (and so "
                f"the gradient of every layer before it) depends on the whole batch, so "
                f"per-example gradients are not defined. Use eval mode for it "
                f"(module.eval(): running statistics, exact), replace it with GroupNorm or "
                f"LayerNorm, or pass batch_norm_constant_statistics=True to PerSampleStats "
                f"(documented approximation: batch statistics held as constants)."
            )
        if module not in self._warned:
            self._warned.add(module)
            warnings.warn(f"layer {layer.name!r}: {message}", stacklevel=3)

    def _on_output_grad(self, call: _Call, grad: torch.Tensor) -> None:
        grad = grad.detach()
        call.output_grad = grad if call.output_grad is None else call.output_grad + grad
        self._gradient_arrived()

    def _gradient_arrived(self) -> None:
        """A hook received a gradient: the step has a backward, and what was read is stale."""
        self._backward_seen = True
        self._statistics = None
        self.generation += 1

    def _on_output_slot_grad(self, call: _Call, slot: int, slots: int, grad: torch.Tensor) -> None:
        if call.output_grad is None:
            call.output_grad = [None] * slots
        previous = call.output_grad[slot]
        grad = grad.detach()
        call.output_grad[slot] = grad if previous is None else previous + grad
        self._gradient_arrived()

    def _on_tapped_grad(self, names: list[str], index: int, grad: torch.Tensor) -> None:
        self._on_param_grad(names[index], grad)

    def _on_param_grad(self, name: str, grad: torch.Tensor) -> None:
        self._gradient_arrived()
        if not self.keep_batch_gradients:
            self._param_grads[name] = None  # noted: the gradient came (see the layer check)
            return
        # A copy: autograd may adopt this very tensor as .grad and later change it in place
        # (accumulation, clipping), which must not change this step's total.
        previous = self._param_grads.get(name)
        grad = grad.detach()
        if previous is not None:
            self._param_grads[name] = previous + grad
            return
        spare = self._spare_grads.pop(name, None)
        if (
            spare is not None
            and spare.shape == grad.shape
            and spare.dtype == grad.dtype
            and spare.device == grad.device
        ):
            self._param_grads[name] = spare.copy_(grad)
        else:
            self._param_grads[name] = grad.clone()

    # -- reading -----------------------------------------------------------------------------
    @property
    def backward_seen(self) -> bool:
        """Whether a backward ran since this step's first forward (statistics can be read)."""
        return self._backward_seen

    def statistics(self) -> StepStatistics:
        """This step's statistics by parameter name (built on first read, then cached)."""
        if self._statistics is None:
            self._statistics = self._build()
            self._readers.append(weakref.ref(self._statistics))
        return self._statistics

    def _batch_size(self) -> int:
        sizes: dict[str, list[int]] = {}
        for layer in self._layers:
            for call in layer.calls:
                if call.output_grad is not None:
                    size = call.batch_size
                    size = call.output_grad.shape[0] if size is None else size
                    sizes.setdefault(layer.name, []).append(size)
        if not sizes:
            raise RuntimeError(
                "PerSampleStats has no statistics yet: run a forward pass with grad enabled and "
                "loss.backward() before reading."
            )
        distinct = {size for per_layer in sizes.values() for size in per_layer}
        if self._batch is not None:
            distinct.add(self._batch.size)
        if len(distinct) > 1:
            raise ValueError(
                f"layers saw different batch sizes in dim 0 ({sizes}, per layer and call; the "
                f"model's input has {self._batch.size if self._batch else '?'} examples); "
                f"PerSampleStats needs the batch in dim 0 of every layer's input (use "
                f"batch_first layouts) and, for a layer called several times, the same "
                f"examples in every call."
            )
        return distinct.pop()

    def _check_gradients_came_through_layers(self) -> None:
        for layer in self._layers:
            if any(call.output_grad is not None for call in layer.calls):
                continue
            for name in layer.params.values():
                if name in self._param_grads:
                    raise RuntimeError(
                        f"parameter {name!r} received a gradient in this backward, but its "
                        f"layer {layer.name!r} never passed one through its forward hook (the "
                        f"parameter was used functionally, e.g. F.linear(x, layer.weight) or "
                        f"nn.MultiheadAttention's out_proj). Call the layer as a module, or "
                        f"freeze the parameter."
                    )

    def step_factors(self) -> tuple[dict[str, ParameterFactor | None], int, float]:
        """(name -> merged factor or None, batch size B, scale) of the latest backward.

        The factors hold g_i / scale (``scale`` is B for a mean-reduced loss); a parameter used
        by several layers or calls gets their combination (``grabkit.stats.factors.combine``).
        """
        self._check_gradients_came_through_layers()
        batch_size = self._batch_size()
        scale = float(batch_size) if self.loss_reduction == "mean" else 1.0
        factors: dict[str, ParameterFactor | None] = dict.fromkeys(self.param_shapes)
        for layer in self._layers:
            wanted = set(layer.params)
            for call in layer.calls:
                if call.output_grad is None:
                    continue
                grad = call.output_grad
                grad = tuple(grad) if isinstance(grad, list) else grad
                made = layer.rule.factors(layer.module, call.captured, grad, wanted)
                for local, factor in made.items():
                    full = layer.params[local]
                    previous = factors[full]
                    factors[full] = factor if previous is None else combine(previous, factor)
        return factors, batch_size, scale

    def _build(self) -> StepStatistics:
        if not self.keep_batch_gradients:
            raise RuntimeError(
                "this PerSampleStats was built with keep_batch_gradients=False, so it keeps no "
                "batch gradient and answers step_factors() only; build it with "
                "keep_batch_gradients=True to read norms, Gram matrices, dots and sums."
            )
        factors, batch_size, scale = self.step_factors()
        batch_gradients = {
            name: as_dtype(self._param_grads[name], self.dtype)
            if name in self._param_grads
            else torch.zeros(shape, dtype=self.dtype, device=self.device)
            for name, shape in self.param_shapes.items()
        }
        return StepStatistics(
            self.param_shapes, factors, batch_gradients, batch_size, self.dtype, self.device, scale,
            layout=self._layout,
        )  # fmt: skip

    def norms_squared(self) -> torch.Tensor:
        """(B,) ||g_i||^2 over the trainable parameters."""
        return self.statistics().norms_squared()

    def gram(self) -> torch.Tensor:
        """(B, B) <g_i, g_j>."""
        return self.statistics().gram()

    def dot(self, vectors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B,) <v, g_i> for v given as {name: tensor shaped like the parameter}.

        Names as in ``model.named_parameters()``; trainable parameters left out count as zero.
        """
        stacked = {name: v.unsqueeze(0) for name, v in self._check_named(vectors).items()}
        return self.statistics().dot_stacked(stacked)[:, 0]

    def weighted_sum(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: sum_i w_i g_i} for (B,) weights ``w``."""
        stats = self.statistics()
        if not isinstance(weights, torch.Tensor) or weights.shape != (stats.batch_size,):
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
            raise ValueError(
                f"`weights` should be a tensor of shape ({stats.batch_size},), one weight per "
                f"example, but got {shape}"
            )
        sums = stats.weighted_sum_stacked(weights.unsqueeze(1))
        return {name: s[0] for name, s in sums.items()}

    def total(self) -> dict[str, torch.Tensor]:
        """{name: sum_i g_i}: the batch gradient autograd computed, rescaled to a sum."""
        return self.statistics().total_named()

    def gradient_batch(self) -> HookGradientBatch:
        """This step's statistics as a ``GradientBatch`` in the flat layout of ``param_shapes``."""
        return HookGradientBatch(self.statistics())

    def _check_named(self, vectors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if not isinstance(vectors, Mapping):
            raise TypeError(
                f"`vectors` should be a dict name -> tensor (names as in "
                f"model.named_parameters()), but got {type(vectors).__name__}"
            )
        for name, v in vectors.items():
            if name not in self.param_shapes:
                raise ValueError(
                    f"`vectors` has an entry {name!r} that is not a trainable parameter of the "
                    f"model; expected names among {list(self.param_shapes)}"
                )
            if tuple(v.shape) != tuple(self.param_shapes[name]):
                raise ValueError(
                    f"`vectors[{name!r}]` should have the parameter's shape "
                    f"{tuple(self.param_shapes[name])}, but got {tuple(v.shape)}"
                )
        return vectors
