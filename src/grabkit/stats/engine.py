"""``PerSampleStats``: exact per-example gradient statistics from an ordinary forward/backward.

Attach once to a model. During the forward pass a hook on each layer that owns trainable
parameters keeps a reference to the layer's input (a tensor autograd keeps for the backward
anyway) and puts a hook on the layer's output tensor (on each output its rule needs: a recurrent
layer's output sequence and final states), which receives the gradient of that output during
``loss.backward()``. A hook on each trainable parameter's ``AccumulateGrad`` node receives the
gradient a backward adds into ``.grad`` (local: before any DDP all-reduce) and copies it
(``.grad`` may be changed in place later), into the previous step's copy when no statistics of
that step are still held: one tensor the size of the trainable parameters lives between steps
instead of a fresh one being allocated, and page-faulted in, at every backward. Nothing else
runs during the step but the identity check's probe of that gradient (see
``grabkit.stats.identity``): norms, dots, Gram matrices and weighted sums are computed on read,
layer by layer, from those factors (see ``grabkit.stats.rules``), never building a (B, d)
tensor.

The first forward pass (with grad enabled) after a backward starts a new step and drops the
previous step's references, so the statistics always describe the latest backward's batch
(with gradient accumulation over micro-batches: the latest micro-batch). Forward passes under
``torch.no_grad()`` or inside ``torch.func`` transforms (a reference over the whole model) are
ignored. Callables in ``step_listeners`` run just before that drop, so a consumer can keep each
micro-batch's statistics (``grabkit.order`` does, to balance every micro-batch of an
accumulated step).

Seams with other autograd work in the same step, each defined:

* **Only backwards that accumulate into ``.grad`` belong to the step** (``grabkit.stats.
  backwards``): the output-gradient hooks of ``torch.autograd.grad(loss, x)`` (saliency, FGSM),
  of a ``torch.autograd.grad(loss, params)`` look-ahead, are discarded, and the forward after
  them does not start a new step.
* **Double backward**: statistics of a step in which an ``autograd.grad(..., create_graph=True)``
  ran over the step's layers (an input-gradient penalty: WGAN-GP, R1) are refused
  (``NotImplementedError``): the per-example gradient of such a loss has second-order parts the
  layer hooks do not see. A ``loss.backward(create_graph=True)`` is exact (its first-order
  gradient is what the hooks see).
* **A weight used functionally** inside the model's forward (``F.linear(h, wte.weight)``) is
  recorded as one more call (``grabkit.stats.functional``); an unsupported use is refused, as
  is a tracked layer or weight used inside a ``torch.func`` transform within the forward
  (``torch.vmap(self.layer)(h)``: its calls hold the transform's rows, not the batch's).
* **The trainable set** is read at every forward: parameters unfrozen later are attached and
  frozen ones dropped, from norms, Gram matrices and totals alike (``param_shapes`` follows);
  layers and parameters replaced or added after attaching are followed the same way, at the
  first forward after any module registered a parameter or submodule
  (``grabkit.stats.structure``).
* **Layers called outside the model's forward** (a step that calls ``model.body`` and
  ``model.head`` itself) are refused: every batch-dim check reads the model's forward input.
* **BatchNorm using the batch's statistics** is refused wherever a trainable layer ran before
  it in the step, also where it owns no trainable parameter (frozen or ``affine=False``), unless
  ``batch_norm_constant_statistics=True``.
* **A shared input's expanded output** can only meet the batch by a broadcast, checked at run
  time (``grabkit.stats.shared_inputs``); a sequence-first copy of the model's input is refused.
* **Loss terms that are not sums over examples** are declared with ``batch_term``.
* **A layer's output changed after the call** (in place, even where the output is a view; by a
  forward hook of the user's; by a gradient hook on it): the engine's forward hook runs first
  and reads the layer's own output, and its gradient is taken by a pre-hook on the node that
  made it, after the tensor's own hooks (``PerSampleStats._hook_output``).
* **A layer on a parameter or buffer** of the model is shared by the batch, even where its dim
  0 has the batch size (``_ModelBatch._is_model_state``).
* **A sequence-first copy of an activation** whose dim 0 has the batch size (T == B), and
  **rows reordered between layers** (sorted inside the forward and back), are refused: dim 0
  is followed back through the autograd graph to an earlier layer's output
  (``grabkit.stats.batch_dim``).
* **Weights computed from other parameters** (``torch.nn.utils.parametrize``) are pulled back
  through the parametrization (``grabkit.stats.parametrized``); the deprecated weight-norm and
  spectral-norm hooks are refused at attach.
* **Parameters changed in place after the forward** (``optimizer.step()`` before the read):
  refused for rules that replay the layer from its weights (``LayerRule.reads_parameters``),
  from the parameters' version counters.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.nn.modules.batchnorm import _BatchNorm

from grabkit.sharding import is_sharded, refuse_flat_parameters
from grabkit.stats.backwards import Backwards, GradientsByTask
from grabkit.stats.batch_dim import Anchor, made_from_layer_outputs, moved_batch_dim
from grabkit.stats.batch_terms import BatchTerm, gate
from grabkit.stats.factors import ParameterFactor, as_dtype, combine
from grabkit.stats.fallback import TorchFuncFallbackRule
from grabkit.stats.functional import TRANSFORMED, FunctionalUse, FunctionalUses
from grabkit.stats.functional import functorch_transform_active as _functorch_transform_active
from grabkit.stats.gradient_batch import FlatLayout
from grabkit.stats.hook_batch import HookGradientBatch
from grabkit.stats.identity import IdentityCheck, PendingIdentityCheck, unit_roundoff
from grabkit.stats.parametrized import (
    ParametrizedRule,
    is_parametrized,
    parametrization_parameters,
    refuse_weight_hooks,
)
from grabkit.stats.rows import UNANNOUNCED_GROUPS_HELP, GroupRows, StepRows
from grabkit.stats.rows_in_doubt import RowsInDoubt, guard_rows
from grabkit.stats.rules import BatchNormRule, LayerRule, find_rule, uses_batch_statistics
from grabkit.stats.shared_inputs import expand_for_batch
from grabkit.stats.source import BackwardMark, StatisticsSource, gradients_taken
from grabkit.stats.step import StepStatistics
from grabkit.stats.structure import registrations
from grabkit.taps import GradientTaps

__all__ = ["PerSampleStats", "unwrap_data_parallel"]

_LOSS_REDUCTIONS = ("mean", "sum")

# parameter dtype -> unit roundoff of the arithmetic its statistics use (at least float32's)
_OWN_ROUNDOFF: dict[torch.dtype, float] = {}

# module -> a weak reference to the PerSampleStats whose hooks are on it (one engine per module
# at a time); weak, as the hooks' own references are, so that an engine dropped without close()
# is collected and its finalizer removes the hooks
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[PerSampleStats]] = (
    weakref.WeakKeyDictionary()
)


class _WeakHook:
    """A hook calling ``method`` of an engine it holds weakly (``args`` first): the model's hooks
    never keep an engine alive, and once it is collected they do nothing until its finalizer
    removes them."""

    __slots__ = ("_args", "_engine", "_function", "_method")

    def __init__(
        self, engine: Callable[[], PerSampleStats | None], method: str, *args: Any
    ) -> None:
        self._engine, self._method, self._args = engine, method, args
        self._function = getattr(PerSampleStats, method)  # unbound: no bound method per call

    def __call__(self, *hook_args: Any) -> Any:
        engine = self._engine()
        if engine is None:
            return None
        return self._function(engine, *self._args, *hook_args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _WeakHook:
        """A copy of the model (``copy.deepcopy``: an EMA or teacher copy) is not the model
        measured: its copies of the hooks do nothing."""
        return type(self)(_no_engine, self._method)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with the model (``torch.save(model)``): unpickled, it does nothing."""
        return (type(self), (_no_engine, self._method))


class _WeakModuleHook(_WeakHook):
    """A ``_WeakHook`` on a module's forward, run eagerly where Dynamo traces the module (a
    model compiled after the engine attached: its hooks sit on the module ``torch.compile``
    traces). Traced, the engine's bookkeeping would be replayed from the trace, not run on
    the step's tensors (the first step of such a model read its input as changed in place).
    Gradient hooks run in autograd, outside any trace, and stay plain ``_WeakHook`` s."""

    __slots__ = ()

    # torch's lazy form of ``torch.compiler.disable`` (Dynamo imported at the first call, not
    # with grabkit); about 0.7 us a call on the CPU
    __call__ = getattr(torch, "_disable_dynamo", torch.compiler.disable)(_WeakHook.__call__)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, or ``t`` itself where it takes part in no graph (a tensor operation
    saved in every hook: most gradients and a model's input do not require grad)."""
    return t.detach() if t.requires_grad else t


def _no_engine() -> None:
    """The engine of a copied hook: none."""
    return None


def _attached(module: nn.Module) -> PerSampleStats | None:
    """The live engine whose hooks are on ``module``, if any."""
    engine = _ATTACHED.get(module)
    return None if engine is None else engine()


def _detach(
    handle_lists: tuple[list[Any], ...],
    nodes: list[Any],
    engine: weakref.ref[PerSampleStats],
) -> None:
    """Remove an engine's hooks and registrations (by ``close()``, or when it is collected)."""
    for handles in handle_lists:
        for handle in handles:
            handle.remove()
        handles.clear()
    nodes.clear()
    for module, ref in list(_ATTACHED.items()):
        if ref is engine:
            del _ATTACHED[module]


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (where hooks go, so that
    parameter names and DDP's buckets and ``no_sync`` are those of the plain model)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _inside_backward() -> bool:
    """True while autograd runs a backward: a forward now is activation checkpointing's
    recomputation, part of the current step, not a new one."""
    return torch._C._current_graph_task_id() != -1


class _Call:
    """One forward call of a tracked layer: what its rule kept, and its outputs' gradients.

    ``grads`` maps each autograd graph task that sent a gradient to the output to that gradient
    (only the tasks that accumulate into the layer's parameters are read; see
    ``grabkit.stats.backwards``). For a rule with ``multiple_outputs`` each entry is a list with
    one slot per tracked output (None until that output receives a gradient) and
    ``batch_size`` is the number of examples the rule found in the call. The gradient edges of
    its hooked outputs are the engine's (``PerSampleStats._output_edges``), not the call's: a
    call holding its output's node, whose pre-hook holds the call, would be a reference cycle,
    left each step for the cyclic garbage collector (with the tensors it holds). ``group``: the
    group of a grouped batch the call's rows hold (``grabkit.stats.rows``), None for an
    ordinary batch. ``weights``: for a rule that reads the
    layer's parameters at read time (``LayerRule.reads_parameters``), each parameter the call
    ran on and its version counter then, so that a read after an in-place update is refused.
    """

    __slots__ = ("batch_size", "captured", "grads", "group", "weights")

    def __init__(
        self, captured: object, batch_size: int | None = None, group: GroupRows | None = None
    ) -> None:
        self.captured = captured
        self.grads: GradientsByTask = {}
        self.batch_size = batch_size
        self.group = group
        self.weights: tuple[tuple[torch.Tensor, int], ...] = ()


def _detached_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A call's (args, kwargs) with every tensor detached (references, not copies)."""

    def detach(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}


def _gradient_source(output: torch.Tensor) -> torch.Tensor:
    """The tensor whose gradient hook gives ``output``'s gradient: ``output`` itself, or, for an
    output that is a view of a tensor of the same size and layout made inside the layer (a
    Linear on a 3-D input computes a matmul and returns a view of it), that tensor. An in-place
    op on such a view (``h.relu_()``, ``F.relu(h, inplace=True)``, ``h[:, 0] *= 2``) rebuilds the
    view's graph and the hooks on the view never fire; hooks on the tensor it views receive the
    gradient of the values the layer returned (as hooks on a tensor that is not a view do)."""
    base = output._base
    if (
        base is None
        or base.grad_fn is None
        or base.numel() != output.numel()
        or not base.is_contiguous()
        or not output.is_contiguous()
    ):
        return output
    return base


_FIRST_INPUT_HELP = (
    "(The examples are dim 0 of the model's first tensor argument: if that argument is not the "
    "batch, such as a mask, a weight or a table passed before the inputs, pass the batch first.)"
)


# nodes that keep the rows of their input, in order (a reshape, a copy): looked through
_ROW_KEEPING_NODES = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
    }
)


def _row_selection(x: torch.Tensor, batch: int) -> tuple[int, ...] | None:
    """The shape of the tensor ``x``'s rows were picked from by indexing, where they are not one
    per example (a mixture-of-experts' routed tokens, a head on masked positions); else None.

    Looks at the node that made ``x`` (through reshapes and copies): an advanced index or an
    ``index_select`` along dim 0 whose source's dim 0 is not the batch (tokens of a flattened
    (B * T, d) tensor), a boolean mask over more than the batch dim, or a second index
    tensor (positions) with a first one that is not every example once (``h[arange(B), last]``
    is). A few attribute reads per layer call; only a multi-index selection reads values.
    """
    node = x.grad_fn
    for _ in range(3):
        if node is None or node.name() not in _ROW_KEEPING_NODES:
            break
        node = node.next_functions[0][0]
    if node is None:
        return None
    name = node.name()
    if name == "IndexSelectBackward0":
        source = tuple(node._saved_self_sym_sizes)
        return source if node._saved_dim == 0 and source[0] != batch else None
    if name != "IndexBackward0":
        return None
    source, indices = tuple(node._saved_self_sym_sizes), node._saved_indices
    first = indices[0] if indices else None
    if first is None or source[0] != batch:
        return source
    if first.dtype == torch.bool:
        return source if first.dim() > 1 else None
    if sum(index is not None for index in indices) == 1:
        return None  # whole examples (a reorder of a layer's output: ``batch_dim`` refuses it)
    once = first.dim() == 1 and torch.bincount(first.reshape(-1), minlength=batch).eq(1).all()
    return None if bool(once) else source


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

    def __init__(self, tensors: list[torch.Tensor], model: nn.Module) -> None:
        self.size = tensors[0].shape[0]
        self.shape = tuple(tensors[0].shape)
        self.tensors = tensors  # the batch, for ``PerSampleStats.step_inputs``
        #: the examples' tensor's version counter when the model's forward ended
        self.version: int | None = None
        self._storages = {t.untyped_storage().data_ptr() for t in tensors}
        self._model = model
        self._state_storages: set[int] | None = None  # read on first need, once per step
        # inputs whose dim 0 has the batch size while it also sits in another dim of one of
        # them: a layer reading one is checked against the rest (``_check_given_input``); one
        # example needs no check (its gradient is the batch's, whatever dim 0 held)
        several = self.size > 1
        candidates = [t for t in tensors if t.dim() and t.shape[0] == self.size]
        ambiguous = several and any(self.size in t.shape[1:] for t in candidates)
        self._rivals = candidates if ambiguous else []
        #: the widest input holding the batch size in a dim other than 0 (None: none does): a
        #: tensor made in the forward with fewer dims and the batch size in dim 0 is ambiguous
        holders = [t for t in tensors if several and self.size in t.shape[1:]]
        self._holder = max(holders, key=lambda t: t.dim()).shape if holders else None

    def _is_shared(self, x: torch.Tensor) -> bool:
        """A tensor made outside autograd and not a view of the model's inputs."""
        return x.grad_fn is None and not self.holds_input(x)

    def rows_in_doubt(self, x: Any) -> bool:
        """Whether the layer input ``x`` (as the model passed it, not detached), taken to hold
        the examples, was taken so by its shape alone: a tensor made in the forward without
        autograd (not a view of the model's input, a parameter, a buffer, or a leaf that
        requires grad such as a reentrant checkpoint's recomputed input) whose dim 0 has the
        batch size while another dim of it, or of one of the model's inputs, has it too (T ==
        B). Indices (BERT's token types, T5's position buckets) and floating tensors (a float
        relative-position feature, a sinusoidal table, a float copy of given positions) alike:
        ``grabkit.stats.rows_in_doubt`` checks what the model does with the layer's output."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.is_complex():
            return False
        b = self.size
        if b < 2 or x.shape[0] != b or not x.stride(0) or x.requires_grad:
            return False
        by_chance = b in x.shape[1:] or self._holder is not None
        return by_chance and self._is_shared(x) and not self._is_model_state(x)

    def narrower_than_holder(self, x: torch.Tensor) -> bool:
        """Whether ``x`` has fewer dims than a model input that holds the batch size in a dim
        other than 0, and was made without autograd: its dim 0 may be that dim's positions (a
        table of the H rows beside (B, C, H, W) images with H == B) as well as the examples (a
        time-step embedding). Only the model's use of the layer's output can tell: guarded
        strictly (``grabkit.stats.rows_in_doubt``), or refused where no guard applies."""
        holder = self._holder
        return holder is not None and x.dim() < len(holder) and self._is_shared(x)

    def holds_input(self, x: torch.Tensor) -> bool:
        """Whether ``x`` shares storage with the model's input (a view of the examples)."""
        return x.untyped_storage().data_ptr() in self._storages

    def _is_model_state(self, x: torch.Tensor) -> bool:
        """A tensor made outside autograd that is (a view of) one of the model's parameters or
        buffers (learned latent queries, a slice of a position table): shared by the batch
        whatever the size of its dim 0, which may equal the batch size by chance."""
        if not self._is_shared(x):
            return False
        if self._state_storages is None:
            state = [*self._model.parameters(), *self._model.buffers()]
            self._state_storages = {t.untyped_storage().data_ptr() for t in state}
        return x.untyped_storage().data_ptr() in self._state_storages

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
                f"batch_first, and that the model's input is batch-first). {_FIRST_INPUT_HELP}"
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

    def _check_given_input(self, name: str, x: torch.Tensor) -> None:
        """Refuse a layer input that is (a view of) one of the model's inputs whose dim 0 has
        the batch size, where the batch size also sits in another dim of one of those inputs
        (T == B), and the rows of ``x`` may not be the examples: a view across another dim of
        the input (``ids[0]``), or a view of an input that could be broadcast along a dim of a
        wider input holding B there (position ids (T,) given beside (B, T) tokens, which the
        model broadcasts along T). The examples are then told apart from positions by nothing
        but the order of the arguments. A view along the examples of an input that cannot be
        broadcast so ((B, f) features beside (B, C, H, W) images with C == B), or with dim 0
        broadcast (``position_ids.expand(B, -1)``: every example the same rows) is exact. Where
        several inputs share ``x``'s storage (ids and labels cut from one collated buffer), one
        that explains ``x`` as the examples is enough."""
        if x.stride(0) == 0:
            return
        storage = x.untyped_storage().data_ptr()
        sources = [t for t in self._rivals if t.untyped_storage().data_ptr() == storage]
        reasons = [self._why_not_examples(x, source) for source in sources]
        if not reasons or any(reason is None for reason in reasons):
            return
        raise ValueError(
            f"layer {name!r} got an input of shape {tuple(x.shape)} whose dim 0 has the batch "
            f"size {self.size} but may not hold the examples: it is {reasons[0]}. With T == B "
            f"PerSampleStats cannot tell positions from examples. Give such an input an "
            f"explicit batch dim (position_ids.expand(B, -1)); where its dim 0 does hold the "
            f"examples (one id per example beside (B, T) tokens), give it a trailing dim, "
            f"(B, 1); or use a batch size that differs from the other dims."
        )

    def _why_not_examples(self, x: torch.Tensor, source: torch.Tensor) -> str | None:
        """Why ``x``, a view of the model's input ``source``, may not hold the examples in its
        dim 0 (None: it does)."""
        if x.stride(0) != source.stride(0):
            return f"a view across another dim of the model's input of shape {tuple(source.shape)}"
        k = source.dim()
        for wider in self._rivals:
            for j in range(1, wider.dim() - k + 1):
                aligned = zip(source.shape, wider.shape[j : j + k], strict=True)
                if wider.shape[j] == self.size and all(a == b or 1 in (a, b) for a, b in aligned):
                    return (
                        f"the model's input of shape {tuple(source.shape)}, which broadcasts "
                        f"against dims {j}.. of the input of shape {tuple(wider.shape)} (like "
                        f"position ids (T,) given beside (B, T) tokens, broadcast along T)"
                    )
        return None

    def align(
        self, name: str, x: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input as (B, ...), expanded output or None when the output is already per-example)."""
        b = self.size
        batched = x.dim() > 0 and x.shape[0] == b
        model_state = batched and x.grad_fn is None and self._is_model_state(x)
        if batched and not model_state:
            if self.narrower_than_holder(x) and not self.rows_in_doubt(x):
                holder = self._holder
                raise ValueError(
                    f"layer {name!r} got an input of shape {tuple(x.shape)} that is not derived "
                    f"from the model's input {tuple(holder)}, whose batch size {b} also appears "
                    f"among its other dims: PerSampleStats cannot tell whether dim 0 holds the "
                    f"examples or is shared by all of them (say positions torch.arange(T) with "
                    f"T == B). Give that input an explicit batch dim (e.g. "
                    f"pos.unsqueeze(0).expand(B, -1)) or use a batch size that differs from "
                    f"the other dims."
                )
            selected_from = _row_selection(x, b) if x.grad_fn is not None else None
            if selected_from is not None:
                raise ValueError(
                    f"layer {name!r} got an input of shape {tuple(x.shape)} whose rows were "
                    f"selected by indexing from a tensor of shape {selected_from} (the tokens "
                    f"routed to a mixture-of-experts' expert, a head on masked positions): its "
                    f"dim 0 has the batch size {b} by chance, but its rows are not the batch's "
                    f"examples, so per-example gradients cannot be read from it. Apply the "
                    f"layer to every position in a (B, T, ...) layout and select after it (mask "
                    f"the loss instead), or freeze the layer's parameters."
                )
            if b in x.shape[1:] and _outer_dim_is_not_first(x):
                raise ValueError(
                    f"layer {name!r} got an input of shape {tuple(x.shape)} and strides "
                    f"{x.stride()}: dim 0 is not its outermost dim (a transposed, sequence-first "
                    f"view?), and the batch size {b} also appears among its other dims, so "
                    f"PerSampleStats cannot tell which dim holds the examples. Use batch_first "
                    f"layouts (a .contiguous() copy of a sequence-first view is sequence-first "
                    f"too: transpose back to batch-first before the layer)."
                )
            if self._rivals and x.grad_fn is None:
                self._check_given_input(name, x)
            return x, None
        one_row = x.dim() > 0 and x.shape[0] == 1 and x.grad_fn is None  # broadcast: HF's (1, T)
        if not (one_row or self._is_shared(x)):
            raise ValueError(
                f"layer {name!r} got an input of shape {tuple(x.shape)} computed from the "
                f"model's input, but its dim 0 is not the batch ({b} examples, dim 0 of the "
                f"model's input {self.shape}). PerSampleStats needs the examples in dim 0 of "
                f"every layer's input: use batch_first layouts (batch_first=True, or transpose "
                f"before the layer). {_FIRST_INPUT_HELP}"
            )
        if not model_state and b > 1 and b in x.shape and x.shape[0] != 1:  # (1, T): HF's ids
            raise ValueError(
                f"layer {name!r} got an input of shape {tuple(x.shape)} whose dim 0 is not the "
                f"batch ({b} examples, dim 0 of the model's input {self.shape}) but which has "
                f"the batch size in another dim: a sequence-first copy of the model's input "
                f"(x.t().contiguous()), made without autograd, so PerSampleStats cannot tell it "
                f"from an input shared by the batch. PerSampleStats needs the examples in dim 0 "
                f"of every layer's input: use batch_first layouts (batch_first=True, or "
                f"transpose the layer's output instead). {_FIRST_INPUT_HELP}"
            )
        if x.dim() > 0 and x.shape[0] == 1 and output.dim() > 0 and output.shape[0] == 1:
            return x.expand(b, *x.shape[1:]), output.expand(b, *output.shape[1:])
        return x.unsqueeze(0).expand(b, *x.shape), output.unsqueeze(0).expand(b, *output.shape)


class _TrackedLayer:
    """A layer that owns trainable parameters (or a functional use of a tracked weight): its
    rule and its parameters' full names."""

    def __init__(
        self, name: str, module: nn.Module | FunctionalUse, rule: LayerRule, params: dict[str, str]
    ) -> None:
        self.name = name
        self.module = module
        self.rule = rule
        self.params = params  # local name ("weight") -> full name ("encoder.0.weight")
        self.locals = frozenset(params)
        self.calls: list[_Call] = []

    def __deepcopy__(self, memo: dict) -> _TrackedLayer:
        return self  # only a copied model's inert hooks hold it (see PerSampleStats.__deepcopy__)


def _tensors_in(value: Any, found: list[torch.Tensor], depth: int = 0) -> None:
    """Append the tensors in ``value`` (a model's arguments: tensors in tuples, lists, dicts and
    other mappings, dataclasses, nested a few levels deep) to ``found``, in order."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth >= _INPUT_DEPTH or isinstance(value, (str, bytes)):
        return
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors_in(item, found, depth + 1)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors_in(item, found, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _tensors_in(getattr(value, field.name), found, depth + 1)


#: how deep in nested containers the model's input tensors are looked for
_INPUT_DEPTH = 4


def _dtypes(value: Any, found: set[torch.dtype]) -> None:
    """The floating dtypes of the tensors in ``value`` (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.add(value.dtype)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _dtypes(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _dtypes(item, found)


def _accumulate_grad_node(p: nn.Parameter) -> Any:
    """The ``AccumulateGrad`` node of a leaf parameter: its pre-hooks see exactly what a
    backward adds into ``.grad`` (not ``torch.autograd.grad``'s captures)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def _no_rule_message(label: str, module: nn.Module, own: list[str], parametrized: bool) -> str:
    """Why a layer with trainable parameters cannot be measured, and the fixes."""
    kind = type(module).__mro__[1] if parametrized else type(module)  # parametrize's subclass
    fallback = (
        "(the torch.func fallback does not replay parametrizations: register a rule for "
        f"{kind.__name__}, and its parametrized weights are pulled back through them)"
        if parametrized
        else "or pass torch_func_fallback=True (per-example gradients of that layer by torch.func)"
    )
    return (
        f"layer {label!r} ({type(module).__name__}) owns trainable parameters {own} but "
        f"PerSampleStats has no rule for it. Freeze those parameters, build the layer from "
        f"supported ones (Linear, Conv1d, Conv2d, MultiheadAttention, LSTM, GRU, RNN, "
        f"transformers Conv1D, Embedding, LayerNorm, RMSNorm, GroupNorm, BatchNorm), or register "
        f"a rule with grabkit.stats.register_rule({kind.__name__}, rule), {fallback}."
    )


def _parametrized_hint(refused: list[tuple[str, str]]) -> str:
    """For a refused use of a parametrization's parameter: where the use comes from."""
    names = sorted({name for name, _ in refused if ".parametrizations." in name})
    if not names:
        return ""
    return (
        f" {names} belong to parametrizations (torch.nn.utils.parametrize): their layer's "
        f"weight was computed outside the layer's own call (a tied head reading "
        f"embedding.weight, a penalty on layer.weight), which PerSampleStats does not pull "
        f"back; read the parametrized weight only inside its layer's call, or freeze them."
    )


def _transform_hint(refused: list[tuple[str, str]]) -> str:
    """For a use inside a torch.func transform: what to do instead."""
    if not any(operation.endswith(TRANSFORMED) for _, operation in refused):
        return ""
    return (
        " A transform's calls hold its own rows, not the batch's examples: apply the layer or "
        "the product to the whole batch (a Linear or a matmul takes (B, ..., d) as it is), or "
        "keep the transform away from tracked parameters."
    )


def _refuse_uninitialized(model: nn.Module) -> None:
    """Lazy modules' parameters have no shape until the first forward: nothing to attach to."""
    lazy = [
        name
        for name, p in model.named_parameters()
        if isinstance(p, nn.parameter.UninitializedParameter)
    ]
    if lazy:
        raise ValueError(
            f"the model's parameters {lazy} are not initialized yet (lazy modules such as "
            f"nn.LazyLinear take their shapes from the first forward), so PerSampleStats cannot "
            f"attach to them. Run one forward (a batch under torch.no_grad() will do) before "
            f"attaching statistics or a hook-mode sampler."
        )


def _pruning_hint(refused: list[tuple[str, str]]) -> str:
    """For a refused use of a parameter named like ``torch.nn.utils.prune``'s ``weight_orig``."""
    names = sorted({name for name, _ in refused if name.endswith("_orig")})
    if not names:
        return ""
    return (
        f" {names} look like torch.nn.utils.prune's originals (weight = weight_orig * "
        f"weight_mask, computed in a forward pre-hook, outside the layer's call): express the "
        f"mask as a parametrization instead (torch.nn.utils.parametrize.register_"
        f"parametrization(module, 'weight', a module returning weight * mask), computed "
        f"exactly), or make the pruning permanent with prune.remove(module, 'weight')."
    )


def _inert() -> PerSampleStats:
    """An engine that records nothing (what a copied model's hooks call)."""
    stats = PerSampleStats.__new__(PerSampleStats)
    stats._inert = True
    return stats


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
    return type(value).__name__


class PerSampleStats(StatisticsSource):
    """Per-example gradient statistics of ``model`` read after each ``loss.backward()``.

    Here g_i is the gradient of example i's own loss term l_i, over the model's trainable
    parameters (frozen ones are skipped), where the batch loss is ``mean_i l_i``
    (``loss_reduction="mean"``) or ``sum_i l_i`` (``"sum"``), plus any terms declared with
    ``batch_term`` (left out of every g_i), and example i is row i of dim 0 of every layer's
    input.

    Args:
        model: the ``nn.Module``; every layer that owns trainable parameters needs a rule
            (``grabkit.stats.rules.register_rule``).
        loss_reduction: ``"mean"`` or ``"sum"``, how the batch loss combines the examples.
            g_i is read in that scale from the gradient the backward delivers: a loss divided
            by a count that changes from batch to batch (a token-level mean over a padded
            batch, ``(l * mask).sum() / mask.sum()``) gives, with ``"mean"``, B / count times
            the gradient of example i's token sum (divide it out, as
            ``GraBSampler.step(grad_scale=B / count)`` does).
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
        check_identity: verify, per parameter and per backward, that sum_i g_i equals the
            gradient autograd delivered (``grabkit.stats.identity``: random probes, a few small
            tensor operations per parameter), and raise ``IdentityCheckError`` instead of
            returning statistics when it does not. True (the default): every step of the first
            ``WARMUP_STEPS`` and of the first ones after the step's structure changed (its layer
            calls, its declared batch terms, the trainable set), then randomly chosen steps at
            the rate that keeps the check within ``BUDGET`` (0.3%) of the step's time,
            measured as it runs (1.5-1.7% of a small MLP's plain step); "always": every step
            (on a small MLP 12-19% of a plain step; cost in ``benchmarks/RESULTS.md``). Turning
            it off (False) is for a user who knows the difference is intended: the statistics
            may then silently describe another loss (a penalty counted into some example, a
            weight use the hooks did not see).
        functional_uses: record ``F.linear`` / ``F.embedding`` / ``matmul`` uses of tracked
            weights outside their layers, made inside the model's forward (a tied head), as
            extra calls (``grabkit.stats.functional``). Watching a forward costs a Python call
            per torch function in it, so ``"auto"`` (the default) watches the forwards of the
            first step with a backward and keeps watching only if that step made such a use
            (a use that first appears later is reported by the identity check, which names
            this option); True watches every forward; False none (the identity check reports
            such a use).

    Reads (after ``loss.backward()``): ``norms_squared()`` (B,), ``dot(vectors)`` (B,),
    ``gram()`` (B, B), ``weighted_sum(weights)`` {name: tensor}, ``total()`` {name: tensor},
    ``gradient_batch()`` (a ``GradientBatch`` in the flat layout of ``param_shapes``).

    Example::

        with PerSampleStats(model) as stats:
            loss_fn(model(x), y).backward()
            norms = stats.norms_squared()  # (B,)

    The examples are dim 0 of the model's first tensor input (looked for in dicts, lists,
    tuples and dataclasses too: ``model(batch)``). A layer whose input is shared by
    the batch (no batch dim, such as ``wpe(torch.arange(T))``, or a leading dim of 1 such as
    Hugging Face's (1, T) position ids) gives every example the same activation: its output is
    expanded to (B, ...) (a view that the model may only broadcast against the batch, checked
    at run time by ``grabkit.stats.shared_inputs``) and each example gets its own share. Where
    dim 0 cannot be told apart from another dim, it raises. A parameter shared by several
    layers (tied embedding and output head) gets the sum of its uses, cross terms included. A
    layer called several times in one forward is handled exactly (its per-example gradient is
    the sum over the calls). BatchNorm in training mode raises unless
    ``batch_norm_constant_statistics=True``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: str = "mean",
        *,
        torch_func_fallback: bool = False,
        batch_norm_constant_statistics: bool = False,
        keep_batch_gradients: bool = True,
        check_identity: bool | str = True,
        functional_uses: bool | str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleStats expects an nn.Module, but got {type(model).__name__}")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(
                f"`loss_reduction` should be one of {_LOSS_REDUCTIONS}, but got "
                f"loss_reduction={loss_reduction!r}"
            )
        refuse_flat_parameters(model.parameters(), "PerSampleStats")  # FSDP1
        _refuse_uninitialized(model)
        self.model = model
        self.loss_reduction = loss_reduction
        self._check_not_attached(model)
        self.torch_func_fallback = bool(torch_func_fallback)
        self.batch_norm_constant_statistics = bool(batch_norm_constant_statistics)
        self.keep_batch_gradients = bool(keep_batch_gradients)
        if check_identity not in (True, False, "always"):
            raise ValueError(
                f"`check_identity` should be True (scheduled within 2% of the step's time), "
                f"'always' (every step) or False (off), but got {check_identity!r}"
            )
        self.check_identity = check_identity
        if functional_uses not in (True, False, "auto"):
            raise ValueError(
                f"`functional_uses` should be True, False or 'auto', but got {functional_uses!r}"
            )
        self.functional_uses = functional_uses
        # "auto": watching until the first step with a backward shows whether the model makes
        # functional uses (then it keeps watching) or not (then it stops)
        self._discovering = functional_uses == "auto"
        self._functional_seen = False
        #: counts every change of the recorded statistics (a gradient arrived, a step began), so
        #: a reader can cache what it computed from them
        self.generation = 0
        self._me = weakref.ref(self)  # what the hooks and the registry hold
        self._model_handles: list[Any] = []
        self._handles: list[Any] = []
        self._enter_handles: list[Any] = []
        #: id of a replayed layer running on an output whose rows are in doubt -> (the layer
        #: in doubt, its input's shape, whether its guard is strict), for its own output
        #: (``_on_replayed_layer_enter``)
        self._doubt_carried: dict[int, tuple[str, torch.Size, bool] | None] = {}
        self._grad_nodes: list[Any] = []
        self._warned: set[nn.Module] = set()
        self._layers: list[_TrackedLayer] = []
        self._functional: dict[tuple, _TrackedLayer] = {}
        self._watch: FunctionalUses | None = None
        self._watching = 0  # model forwards running with the watch on
        #: one entry per model forward running: whether it is a step's (grad enabled, outside
        #: any torch.func transform), so that a layer called inside a transform within it is
        #: told from a reference that calls the whole model inside one
        self._model_forwards: list[bool] = []
        #: called (no arguments) after a backward, before the next step's first forward drops
        #: that backward's statistics; ``statistics()`` still reads them inside the call
        self.step_listeners: list[Callable[[], None]] = []
        self._read_parameters()
        self._trainable = [p.requires_grad for p in self._param_list]
        self._attach_trainable()
        self._new_step()
        self._attach_model()

    # -- attaching ---------------------------------------------------------------------------
    @staticmethod
    def _check_not_attached(model: nn.Module) -> None:
        for name, module in model.named_modules():
            if _attached(module) is not None:
                where = f"this model's submodule {name!r}" if name else "this model"
                raise RuntimeError(
                    f"a PerSampleStats is already attached to {where} (directly, or held by "
                    f"a SketchedStats, a hook-mode GraBSampler(model=...) or an integration's "
                    f"callback); one model carries one at a time. Call close() on the existing "
                    f"one (or leave its `with` block) before attaching another; to read "
                    f"statistics beside a hook-mode sampler, read them from the sampler's own "
                    f"(sampler.stats)."
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
            parametrized = not covers and is_parametrized(module)
            if parametrized:  # its weights computed from the parametrizations' parameters
                own.update(parametrization_parameters(module))
            if not own:
                continue
            seen.update(id(m) for m in (module.modules() if covers else [module]))
            if parametrized:
                seen.update(id(m) for m in module.parametrizations.modules())
            label = module_name or "<root>"
            if rule is None and fallback and not parametrized:
                rule = TorchFuncFallbackRule()
            if rule is not None and parametrized:
                rule = ParametrizedRule(rule)
            if rule is None:
                raise ValueError(_no_rule_message(label, module, sorted(own), parametrized))
            refuse_weight_hooks(label, module, own)
            rule.check(module)
            params = {local: names[id(p)] for local, p in own.items()}
            layers.append(_TrackedLayer(label, module, rule, params))
        return layers

    def _attach_trainable(self) -> None:
        """Find the layers and hooks for the parameters that require grad now."""
        names = {id(p): name for name, p in self._params if p.requires_grad}
        if not names:
            raise ValueError("the model has no parameters that require grad; nothing to measure")
        first = next(p for _, p in self._params if p.requires_grad)
        self._first_trainable = first
        self.dtype = first.dtype
        self.device = first.device
        self._accumulators_replaced = False
        self.param_shapes: dict[str, torch.Size] = {
            name: p.shape for name, p in self._params if p.requires_grad
        }
        self._layout = FlatLayout(self.param_shapes)
        self._layers = self._find_layers(self.model, names, self.torch_func_fallback)
        self._functional = {}
        self._identity = (
            IdentityCheck(
                self.param_shapes,
                shared_rows=self._shared_rows(),
                every_step=self.check_identity == "always",
                structure=self._step_structure,
            )
            if self.check_identity
            else None
        )
        self._attach_layers()

    def _step_structure(self) -> tuple:
        """What the engine saw of this step so far, for the identity check's schedule: the
        number of calls of each layer and functional use, the declared batch terms, whether
        the batch is grouped (a change starts a new run of checked steps)."""
        functional = self._functional
        return (
            tuple([len(layer.calls) for layer in self._layers]),
            tuple([(key, len(f.calls)) for key, f in functional.items()]) if functional else (),
            len(self._batch_terms),
            self._rows.grouped,
        )

    def _shared_rows(self) -> dict[str, str]:
        """vector parameter -> matrix parameter of the same layer whose row probe it shares (a
        Linear's bias and weight read the same output gradients: one product serves both)."""
        shared = {}
        for layer in self._layers:
            full = {local: self.param_shapes[name] for local, name in layer.params.items()}
            for local, shape in full.items():
                if len(shape) != 1:
                    continue
                for other, other_shape in full.items():
                    if len(other_shape) >= 2 and other_shape[0] == shape[0]:
                        shared[layer.params[local]] = layer.params[other]
                        break
        return shared

    def _attach_layers(self) -> None:
        me = self._me
        for layer in self._layers:
            hook = _WeakModuleHook(me, "_on_forward", layer)
            # first: the engine reads the layer's own output, before a forward hook of the
            # user's replaces it (its change is then part of the model, after the layer)
            handle = layer.module.register_forward_hook(hook, with_kwargs=True, prepend=True)
            self._handles.append(handle)
            if layer.rule.whole_call or layer.rule.multiple_outputs:
                enter = _WeakModuleHook(me, "_on_replayed_layer_enter")
                handle = layer.module.register_forward_pre_hook(enter, with_kwargs=True)
                self._handles.append(handle)
            if self._watching_forwards:
                enter = _WeakModuleHook(me, "_on_layer_enter")
                handle = layer.module.register_forward_pre_hook(enter)
                self._handles.append(handle)
                self._enter_handles.append(handle)
            _ATTACHED[layer.module] = me
        tracked = {id(layer.module) for layer in self._layers}
        for name, module in self.model.named_modules():
            if isinstance(module, _BatchNorm) and id(module) not in tracked:
                hook = _WeakModuleHook(me, "_on_untracked_norm", name or "<root>")
                self._handles.append(module.register_forward_hook(hook))
        sharded = []
        self._hooked_nodes: dict[str, Any] = {}  # name -> the AccumulateGrad node hooked
        for name, p in self._params:
            if not p.requires_grad:
                continue
            if is_sharded(p):  # fully_shard: the forward differentiates an unsharded copy
                sharded.append((name, p))
                continue
            node = _accumulate_grad_node(p)
            self._handles.append(node.register_prehook(_WeakHook(me, "_on_param_grad", name)))
            self._grad_nodes.append(node)  # kept alive: the hook lives on this very node
            self._hooked_nodes[name] = node
        if sharded:  # taps on the unsharded copies (grabkit.taps)
            on_grad = _WeakHook(me, "_on_tapped_grad", [name for name, _ in sharded])
            self._handles.append(GradientTaps(sharded, on_grad, self.model))
        self._watch = None
        if self._watching_forwards:
            self._watch = FunctionalUses(self._owners(), self._record_functional, self._refuse)

    @property
    def _watching_forwards(self) -> bool:
        return self.functional_uses is True or self._discovering

    def _end_discovery(self) -> None:
        """``functional_uses="auto"``: after the first step with a backward, keep watching only
        if it made a functional use (the watch and its layer pre-hooks go otherwise)."""
        self._discovering = False
        if self._functional_seen:
            self.functional_uses = True
            return
        for handle in self._enter_handles:
            handle.remove()
        self._enter_handles.clear()
        self._watch = None

    def _owners(self) -> dict[int, tuple[str, nn.Parameter, frozenset[int]]]:
        """id(parameter) -> (full name, parameter, ids of the tracked layers' modules owning it)."""
        params = dict(self._params)
        layers_of: dict[str, set[int]] = {}
        for layer in self._layers:
            for name in layer.params.values():
                layers_of.setdefault(name, set()).add(id(layer.module))
        return {
            id(params[name]): (name, params[name], frozenset(ids))
            for name, ids in layers_of.items()
        }

    def _attach_model(self) -> None:
        model, me = self.model, self._me
        enter = _WeakModuleHook(me, "_on_model_input")
        self._model_handles.append(  # first: the model's own layer hooks may follow
            model.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
        )
        leave = _WeakModuleHook(me, "_on_model_output")
        self._model_handles.append(model.register_forward_hook(leave, always_call=True))
        _ATTACHED[model] = me
        # run by close(), or when the engine is collected unclosed: the hooks go either way
        self._detach = weakref.finalize(
            self, _detach, (self._handles, self._model_handles), self._grad_nodes, me
        )

    def _detach_layers(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._enter_handles.clear()
        self._grad_nodes.clear()
        for layer in self._layers:
            if _ATTACHED.get(layer.module) is self._me and layer.module is not self.model:
                del _ATTACHED[layer.module]

    def _read_parameters(self) -> None:
        """Read the model's parameters (at attach, and after parameters or layers were
        registered anywhere since: ``grabkit.stats.structure``)."""
        self._registrations = registrations()
        self._params = list(self.model.named_parameters())
        self._param_list = [p for _, p in self._params]
        #: id -> name of the model's own parameters (``fully_shard``'s sharded ones left out)
        self._param_names = {id(p): name for name, p in self._params if not is_sharded(p)}
        #: name -> parameter, the same ones (for the check of gradients reset unused)
        self._param_by_name = {name: p for name, p in self._params if not is_sharded(p)}

    def _parameters_replaced(self) -> bool:
        """Whether the model's parameters are other objects or names than those attached to
        (a layer or parameter replaced or added since: ``model.head = nn.Linear(...)``,
        ``load_state_dict(..., assign=True)``). One integer compared per forward; the model's
        parameters are walked only when a registration happened anywhere since."""
        if registrations() == self._registrations:
            return False
        before = [(name, id(p)) for name, p in self._params]
        self._read_parameters()
        return before != [(name, id(p)) for name, p in self._params]

    def _model_cast(self) -> bool:
        """Whether the parameters' gradient accumulators, on which the engine's hooks sit, may
        have been replaced since attaching: PyTorch gives a parameter a new one when its data
        changes dtype or device (``model.to(...)``, ``.double()``, ``.cuda()``). Told at every
        forward from the first trainable parameter (a whole model cast or moved); a part of the
        model cast alone is found at the read (``_check_accumulators``), which asks for this."""
        if self._accumulators_replaced:
            return True
        first = self._first_trainable
        return first.dtype != self.dtype or first.device != self.device

    def _follow_trainable_set(self) -> None:
        """Re-attach when parameters were frozen or unfrozen since the last forward (cheap to
        tell: one flag per parameter), replaced or added (``_parameters_replaced``), or cast or
        moved (``_model_cast``)."""
        replaced = self._parameters_replaced()
        trainable = [p.requires_grad for p in self._param_list]
        if trainable == self._trainable and not replaced and not self._model_cast():
            return
        self._trainable = trainable
        self._detach_layers()
        if not any(trainable):  # all frozen (an adversarial attack's forward): nothing to measure
            self._layers, self._functional, self._watch = [], {}, None
            self._new_step()
            return
        if self.functional_uses == "auto":  # no use seen so far: the new model is watched anew
            self._discovering = True
        self._attach_trainable()
        self._new_step()

    def close(self) -> None:
        """Remove every hook and drop the kept references; the object can no longer record.

        An engine dropped without ``close()`` is collected (the model's hooks hold it weakly),
        and collection removes its hooks the same way."""
        self._detach()
        self._new_step()
        self._spare_grads = {}

    def __enter__(self) -> PerSampleStats:
        return self

    def __deepcopy__(self, memo: dict) -> PerSampleStats:
        """A copy of a model (``copy.deepcopy``, pickling) carries this engine's forward hooks
        along; they get an inert engine, which records nothing: attach a new
        ``PerSampleStats`` to the copy to measure it."""
        return _inert()

    def __reduce__(self) -> tuple:
        return (_inert, ())

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- recording ---------------------------------------------------------------------------
    def _new_step(self) -> None:
        if getattr(self, "_backward_seen", False):
            for listener in list(self.step_listeners):
                listener()  # before the finished step's data is dropped
            if self._discovering and self._watching == 0:
                self._end_discovery()
        for layer in [*self._layers, *self._functional.values()]:
            layer.calls = []
        copies = getattr(self, "_param_grads", {})
        readers = getattr(self, "_readers", [])
        self._param_grads: dict[str, torch.Tensor | None] = {}
        #: the step this one replaces had a backward (named when a read finds nothing)
        self._closed_a_backward = getattr(self, "_backward_seen", False)
        self._backward_seen = False  # a backward accumulated into .grad: statistics to read
        self._gradient_seen = False  # any hook received a gradient: the next forward is new
        #: ``backward_mark``: the first parameter a backward of this step reached, its version
        #: and whether its ``.grad`` was empty then (() for a sharded one)
        self._first_reached: BackwardMark | tuple[()] | None = None
        self._backwards = Backwards()
        self._batch_terms: list[BatchTerm] = []
        #: (call, node, output number, output shape) of each hooked output of this step, for
        #: ``batch_term`` (the edge, not the tensor: holding the tensor would keep every layer's
        #: output alive; plain tuples, made into ``GradientEdge``s only there)
        self._output_edges: list[tuple[_Call, Any, int, torch.Size]] = []
        self._refused: list[tuple[str, str]] = []
        self._unread_outputs: list[str] = []  # layers whose later outputs received a gradient
        # id of the node that made each layer output of the step -> (node, layer name, output
        # number, shape): dim 0 of those holds the examples (``grabkit.stats.batch_dim``)
        self._batch_first_nodes: dict[int, Anchor] = {}
        self._doubted_layers: set[str] = set()  # layers whose outputs the model got guarded
        if self._identity is not None:
            self._identity.begin_step()
        self.generation += 1
        self._statistics: StepStatistics | None = None
        self._batch: _ModelBatch | None = None
        self._model_called = False  # the model's own forward ran in this step
        self._rows = StepRows()  # the grouped batch this step's calls came from, if any
        self._group_batches: dict[int, _ModelBatch] = {}  # id(group) -> its input's batch
        # StepStatistics built on this step (weakly): while one lives, its copies are its own
        self._readers: list[weakref.ref[StepStatistics]] = []
        if all(reader() is None for reader in readers):
            # Nothing outside the engine holds the finished step's gradient copies: the next
            # backward copies into them instead of into fresh memory (a fresh tensor the size of
            # a large layer costs more in page faults than the copy itself, on the CPU).
            self._spare_grads: dict[str, torch.Tensor] = copies

    _inert = False  # a copy carried along with a copied model (see __deepcopy__)

    def _on_model_input(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Record the batch size from the model's first tensor input with a dim 0: the
        examples (a 0-dim input, such as a diffusion model's time step, holds none).

        A 1-D floating input is one unbatched vector, not a batch: nothing is recorded and the
        layers' rules report it. The trainable set is read here (parameters frozen or unfrozen
        since the last forward are followed), and the functional-use watch switched on.
        """
        if self._inert:
            return
        counted = torch.is_grad_enabled() and not _functorch_transform_active()
        self._model_forwards.append(counted)
        if not counted:
            return
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
            tensors = [args[0]]  # the usual call, model(x): no containers to look into
        else:
            tensors = []
            _tensors_in((args, kwargs), tensors)
        if tensors and tensors[0].dim() == 0:
            tensors = [t for t in tensors if t.dim()]
        if not tensors or _inside_backward():
            return
        if self._gradient_seen and self._step_finished():
            self._new_step()
        self._follow_trainable_set()
        self._model_called = True
        if self._watch is not None:
            self._watch_on()
        if tensors[0].dim() == 1 and tensors[0].is_floating_point():
            return
        self._batch = _ModelBatch(tensors, self.model)

    def _step_finished(self) -> bool:
        """Whether a forward now starts a new step: a hook received a gradient since this
        step's first forward, and the forward is neither checkpointing's recomputation nor the
        next group of the grouped batch being run (``backward_by_group``)."""
        return self._gradient_seen and not _inside_backward() and not self._rows.continues()

    def _watch_on(self) -> None:
        if self._watch is None:
            return
        if self._watching == 0:
            self._watch.reset()
            self._watch.__enter__()
        self._watching += 1

    def _on_model_output(self, model: nn.Module, args: Any, output: Any) -> None:
        """The model's forward ended (or raised): the functional-use watch goes off, and the
        input's version counter is noted (a read refuses an input changed in place since)."""
        batch = self._batch
        if batch is not None:
            batch.version = batch.tensors[0]._version
        if not self._inert and self._model_forwards:
            self._model_forwards.pop()
        if not self._inert and self._watching:
            self._watching -= 1
            if self._watching == 0 and self._watch is not None:
                self._watch.__exit__(None, None, None)

    def _on_layer_enter(self, module: nn.Module, args: Any) -> None:
        if not self._inert and self._watching and self._watch is not None:
            self._watch.running.append(id(module))

    def _on_replayed_layer_enter(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A layer whose rule takes its whole call (attention, recurrent, the torch.func
        fallback) called on an output whose rows are in doubt (``grabkit.stats.rows_in_doubt``):
        its forward runs on the plain tensors, since what it does inside (``MultiheadAttention``
        transposes its batch-first input) is the layer's, whose rule knows where its batch dim
        is; ``_record_call`` guards its output in turn (a recurrent layer's is left plain)."""
        guarded = [a for a in (*args, *kwargs.values()) if isinstance(a, RowsInDoubt)]
        first = guarded[0] if guarded else None
        carried = (
            None
            if first is None
            else (first.grabkit_layer, first.grabkit_input_shape, first.grabkit_strict)
        )
        self._doubt_carried[id(module)] = carried
        if first is None:
            return None
        with torch._C.DisableTorchFunctionSubclass():
            plain = {id(a): a.as_subclass(torch.Tensor) for a in guarded}
        args = tuple(plain.get(id(a), a) for a in args)
        return args, {k: plain.get(id(v), v) for k, v in kwargs.items()}

    def _on_layer_exit(self, layer: _TrackedLayer) -> None:
        if self._watching and self._watch is not None:
            running = self._watch.running
            if running and running[-1] == id(layer.module):
                running.pop()

    def _on_forward(
        self,
        layer: _TrackedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        if self._inert:
            return None
        if self._watching:
            self._on_layer_exit(layer)
        if not torch.is_grad_enabled():
            return None
        if _functorch_transform_active():
            self._refuse_transformed_call(layer)
            return None
        # The engine's own tensor work is not the model's: no functional-use watch, and it may
        # read shapes of an expanded shared output that the model may not.
        with torch._C.DisableTorchFunction():
            return self._record_call(layer, module, args, kwargs, output)

    def _refuse_transformed_call(self, layer: _TrackedLayer) -> None:
        """A tracked layer called inside a torch.func transform within the model's forward
        (``torch.vmap(self.layer)(h)``): its gradient reaches the parameters through calls whose
        rows are the transform's, which no rule reads, so the read is refused (a layer with
        other calls would otherwise pass without them). A forward of the whole model inside a
        transform (a per-example reference computed while attached) is no step: ignored."""
        if self._model_forwards and self._model_forwards[-1]:
            use = f"a call of its layer {layer.name!r} {TRANSFORMED}"
            self._refused.extend((name, use) for name in layer.params.values())

    def _record_call(
        self,
        layer: _TrackedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        if layer.rule.multiple_outputs:
            replaced = layer.rule.replace_output(module, output)
            output = output if replaced is None else replaced
            self._record_multiple_outputs(layer, module, (args, kwargs, output))
            return replaced
        replaced = layer.rule.replace_output(module, output) if layer.rule.whole_call else None
        if replaced is not None:  # the same values, laid out batch-first
            output = replaced
        outputs = output
        if layer.rule.whole_call and isinstance(output, tuple) and output:
            self._watch_unread_outputs(layer.name, output[1:])
            output = output[0]  # e.g. MultiheadAttention's (out, weights)
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return replaced
        # A recomputed call (checkpointing) is recorded as one more call: with use_reentrant=True
        # only it receives the output gradient; with False only the original call does.
        if self._gradient_seen and self._step_finished():
            self._new_step()
        if layer.rule.training_mode_warning:
            self._check_training_mode(layer, module)
        group = self._rows.tag()
        layer_input, expanded = self._layer_input(layer, args, kwargs, output, group)
        call = _Call(layer.rule.capture(module, layer_input), group=group)
        if layer.rule.reads_parameters:
            self._note_weights(layer, call)
        layer.calls.append(call)
        hooked = output if expanded is None else expanded
        self._hook_output(call, hooked, layer.name)
        if expanded is not None:
            return expand_for_batch(output, expanded, layer.name)
        in_doubt = self._input_in_doubt(args, kwargs, group)
        carried = self._doubt_carried.pop(id(module), None) if layer.rule.whole_call else None
        if in_doubt is not None:
            carried = (layer.name, *in_doubt)
        if carried is None:
            return replaced
        self._doubted_layers.add(layer.name)  # its output is no evidence of the examples
        doubted, shape, strict = carried
        examples = _WeakHook(self._me, "_holds_examples")
        guarded = guard_rows(output, doubted, shape, strict=strict, examples=examples)
        return guarded if outputs is output else (guarded, *outputs[1:])

    def _input_in_doubt(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], group: GroupRows | None
    ) -> tuple[torch.Size, bool] | None:
        """(the shape of a call's first input (as the model passed it, not detached) whose rows
        were taken for the examples by its shape alone (``_ModelBatch.rows_in_doubt``), whether
        only the model's use can clear it (``narrower_than_holder``: a strict guard)), so that
        the model gets the layer's output guarded (``grabkit.stats.rows_in_doubt``); else None."""
        given = args[0] if args else next(iter(kwargs.values()))
        batch = self._batch_for(group)
        if batch is not None and batch.rows_in_doubt(given):
            return given.shape, batch.narrower_than_holder(given)
        return None

    def _holds_examples(self, t: torch.Tensor) -> bool:
        """Whether ``t`` holds this step's examples in dim 0: a view of the model's input (or a
        grouped batch's), or a tensor made from the outputs of layers called on the examples
        (not of the layers whose rows were in doubt). What ends a guard on rows in doubt."""
        batches = [self._batch, *self._group_batches.values()]
        if any(batch is not None and batch.holds_input(t) for batch in batches):
            return True
        return made_from_layer_outputs(t, self._batch_first_nodes, self._doubted_layers)

    def _watch_unread_outputs(self, name: str, outputs: tuple[Any, ...]) -> None:
        """Outputs after the first of a whole-call rule's layer (MultiheadAttention's attention
        weights), which its replay does not differentiate: a gradient reaching one comes from a
        loss term on it (an entropy regulariser, a distillation target), which every g_i would
        leave out, so it refuses the step's reads."""
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(_WeakHook(self._me, "_on_unread_output_grad", name))

    def _on_unread_output_grad(self, name: str, grad: torch.Tensor) -> None:
        if name not in self._unread_outputs:
            self._unread_outputs.append(name)

    def _hook_output(self, call: _Call, hooked: torch.Tensor, name: str) -> None:
        """Receive the gradient of ``hooked`` (the call's output) in the backward: by a pre-hook
        on the node that made it (or the tensor it is a view of, ``_gradient_source``), which
        runs after the tensor's own hooks, so a gradient hook of the user's on the output
        (``h.register_hook``) is part of what the layer's parameters receive, as in autograd."""
        source = hooked if hooked._base is None else _gradient_source(hooked)
        if source.grad_fn is None:  # a leaf (no node to hook)
            hooked.register_hook(_WeakHook(self._me, "_on_output_grad", call))
            return
        node = source.grad_fn
        hook = _WeakHook(self._me, "_on_node_grad", call, source.output_nr, hooked.shape)
        node.register_prehook(hook)
        anchors = self._batch_first_nodes  # the output's node, and its view's
        anchors[id(node)] = (node, name, source.output_nr, source.shape)
        if hooked is not source:
            anchors[id(hooked.grad_fn)] = (hooked.grad_fn, name, hooked.output_nr, hooked.shape)
        self._output_edges.append((call, node, source.output_nr, hooked.shape))

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
        if self._step_finished():
            self._new_step()
        self._check_training_mode(layer, module)
        group = self._rows.tag()
        x, dim, size = layer.rule.call_batch(module, args, kwargs)
        batch = self._batch_for(group)
        if group is None and not self._model_called:
            self._refuse_call_outside_the_model(layer.name)
        if batch is not None:
            batch.check_batch_dim(layer.name, size, x, dim)
        call = _Call(layer.rule.capture(module, whole_call), batch_size=size, group=group)
        self._note_weights(layer, call)
        layer.calls.append(call)
        for slot, t in hooked:
            t.register_hook(_WeakHook(self._me, "_on_output_slot_grad", call, slot, len(tensors)))

    def _note_weights(self, layer: _TrackedLayer, call: _Call) -> None:
        """Note the versions of the parameters a rule reads at read time (the model's own, as
        registered: ``fully_shard``'s unsharded copies are refilled for the backward)."""
        if layer.rule.reads_parameters:
            names = self._param_names
            call.weights = tuple(
                (p, p._version) for p in layer.module.parameters() if id(p) in names
            )

    def _check_weights_unchanged(self, kept: list) -> None:
        """Refuse a read after the parameters a rule replays the layer from changed in place
        since the call (the statistics would be those of the new weights)."""
        for layer, call, _ in kept:
            changed = [
                self._param_names[id(p)] for p, version in call.weights if p._version != version
            ]
            if changed:
                raise ValueError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}): parameter(s) "
                    f"{changed} changed in place since the forward (an optimizer.step(), a "
                    f"weight clip or copy into the model between loss.backward() and this read), "
                    f"and its rule recomputes the per-example gradients from the layer's current "
                    f"weights (recurrent layers, attention, the torch.func fallback, "
                    f"parametrized weights), so they would be those of other weights. Read the "
                    f"statistics (sampler.step(), stats.norms_squared(), ...) after "
                    f"loss.backward() and before optimizer.step()."
                )

    def _check_kept_input_unchanged(self, kept: list, batch: _ModelBatch) -> None:
        """The model's input changed in place since its forward ended (a loop refilling its
        input buffer before the read): refuse the read where a layer kept that very tensor (or
        a view of it) as its input, whose statistics would describe the new values."""
        storage = batch.tensors[0].untyped_storage().data_ptr()
        for layer, call, _ in kept:
            found: list[torch.Tensor] = []
            _tensors_in(call.captured, found)
            if any(t.untyped_storage().data_ptr() == storage for t in found):
                raise ValueError(
                    f"the model's input (dim 0 of {batch.shape}) was changed in place after "
                    f"the model's forward ended (a loop refilling its input buffer, "
                    f"x.copy_(next_batch), before this read), and layer {layer.name!r} "
                    f"({type(layer.module).__name__}) kept it as its input: its per-example "
                    f"gradients would be those of the new values. Read the statistics "
                    f"(sampler.step(), stats.norms_squared(), ...) before changing the input, "
                    f"or fill a new tensor for the next batch."
                )

    def _batch_for(self, group: GroupRows | None) -> _ModelBatch | None:
        """The batch a call's input is checked against: the model's input, or for a call in a
        group of a grouped batch the group's own input as the runner announced it (the model
        may run the grouped batch inside its forward); None where neither fits the call's rows
        (the input is then taken as it is)."""
        if group is None:
            return self._batch
        if group.inputs:
            batch = self._group_batches.get(id(group))
            if batch is None:
                batch = self._group_batches[id(group)] = _ModelBatch(list(group.inputs), self.model)
            return batch
        if self._batch is not None and self._batch.size == group.rows:
            return self._batch
        return None

    def _layer_input(
        self,
        layer: _TrackedLayer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: torch.Tensor,
        group: GroupRows | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """(what the rule keeps from the call, the output expanded to (B, ...) or None).

        The first input is checked against the step's batch (``_ModelBatch.align``); a rule
        with ``whole_call`` keeps every input instead.
        """
        if not args and not kwargs:
            raise NotImplementedError(
                f"layer {layer.name!r} ({type(layer.module).__name__}) was called without "
                f"inputs: its output, made from its parameters alone, is shared by every "
                f"example, and its rule has no input to tell the examples apart. Call it on the "
                f"batch's tensor, make the parameters those of a layer that takes one (an "
                f"nn.Embedding looked up by positions), or freeze them."
            )
        layer_input = args[0] if args else next(iter(kwargs.values()))
        expanded = None
        batch = self._batch if group is None else self._batch_for(group)
        if group is None and not self._model_called:
            self._refuse_call_outside_the_model(layer.name)
        if isinstance(layer_input, torch.Tensor):
            if batch is not None:
                layer_input, expanded = batch.align(layer.name, layer_input, output)
            if layer.rule.whole_call and expanded is not None:
                raise NotImplementedError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}) got an input shared "
                    f"by the batch (shape {tuple(layer_input.shape)}), which its rule cannot "
                    f"take; give the input an explicit batch dim (expand it to (B, ...))."
                )
            if expanded is None and batch is not None and layer_input.grad_fn is not None:
                self._check_not_moved(layer.name, layer_input, batch.size)
            if layer_input.requires_grad:
                layer_input = layer_input.detach()  # a reference, not a copy
        if layer.rule.whole_call:
            layer_input = _detached_call(args, kwargs)
        return layer_input, expanded

    def _refuse_call_outside_the_model(self, name: str) -> None:
        """A layer called in a step in which the model's own forward did not run (the loop
        calls ``model.body(x)`` and ``model.head(h)`` itself): the examples are taken from the
        model's forward input, and every layer's input is checked against it (its batch dim,
        rows reordered, sequence-first copies with T == B); without it none of that is
        checked, so it is refused."""
        raise ValueError(
            f"layer {name!r} was called outside the forward of the model PerSampleStats is "
            f"attached to ({type(self.model).__name__}), which did not run in this step (the "
            f"training step calls its submodules itself, e.g. model.head(model.body(x)), or a "
            f"LightningModule's training_step calls self.backbone(x)), or ran without a tensor "
            f"input: PerSampleStats takes the examples from dim 0 of the model's first tensor "
            f"input and checks every layer's input against it, which it cannot do here. Call "
            f"the model itself on the batch's tensors (route the step through its forward), or "
            f"attach PerSampleStats (or the hook-mode sampler) to the submodule the step calls."
        )

    def _check_not_moved(self, name: str, x: torch.Tensor, batch: int) -> None:
        """Refuse an input whose dim 0 has the batch size but holds other rows than the
        examples of an earlier layer's output: another of its dims (a sequence-first copy of an
        activation, T == B), or its rows reordered (sorted inside the forward). A grouped batch
        reorders rows by design (``grabkit.stats.rows`` maps them to its items)."""
        if batch < 2 or x.grad_fn is None or self._rows.grouped:
            return
        moved = moved_batch_dim(x, self._batch_first_nodes)
        if moved is None:
            return
        source, where = moved
        if isinstance(where, str):
            raise ValueError(
                f"layer {name!r} got an input of shape {tuple(x.shape)} whose rows are those of "
                f"the output of layer {source!r} reordered by {where} (examples sorted inside "
                f"the forward, say by length before pack_padded_sequence, and unsorted after): "
                f"its row j is another example's, so per-example statistics would mix the "
                f"examples' gradients across layers. Keep every layer's rows in the batch's "
                f"order (pack_padded_sequence(..., enforce_sorted=False) sorts and unsorts "
                f"inside the packed sequence), or reorder the batch before the model."
            )
        raise ValueError(
            f"layer {name!r} got an input of shape {tuple(x.shape)} whose dim 0 is dim "
            f"{where} of the output of layer {source!r} (permuted or transposed, then copied: "
            f"a sequence-first copy such as h.transpose(0, 1).contiguous()), not its "
            f"examples; with the batch size {batch} equal to that dim, PerSampleStats would "
            f"credit each position's gradient to an example. Keep the examples in dim 0 of "
            f"every layer's input (transpose back before the layer, or apply it to the "
            f"batch-first tensor), or use a batch size that differs from the other dims."
        )

    def _check_training_mode(self, layer: _TrackedLayer, module: nn.Module) -> None:
        message = layer.rule.training_mode_warning
        if not message or not layer.rule.uses_batch_statistics(module):
            return
        self._refuse_batch_statistics(layer.name, module, message)

    def _refuse_batch_statistics(self, name: str, module: nn.Module, message: str) -> None:
        """A norm layer normalised with the batch's statistics: refused, unless
        ``batch_norm_constant_statistics`` (then warned once per layer)."""
        if not self.batch_norm_constant_statistics:
            raise ValueError(
                f"layer {name!r} ({type(module).__name__}) normalises with the batch's mean and "
                f"variance (training mode, or track_running_stats=False): every example's "
                f"output (and so the gradient of every layer before it) depends on the whole "
                f"batch, so per-example gradients are not defined, also where the layer's own "
                f"affine parameters are frozen or absent. Use eval mode with running statistics "
                f"for it (module.eval(): exact), replace it with GroupNorm or LayerNorm, or pass "
                f"batch_norm_constant_statistics=True to PerSampleStats (documented "
                f"approximation: batch statistics held as constants)."
            )
        if module not in self._warned:
            self._warned.add(module)
            warnings.warn(f"layer {name!r}: {message}", stacklevel=4)

    def _on_untracked_norm(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of a BatchNorm that owns no trainable parameter: normalising with the
        batch's statistics a layer input that carries gradient to a layer called before it in
        this step couples the examples of that layer (and of every one before it)."""
        if self._inert or not torch.is_grad_enabled() or not uses_batch_statistics(module):
            return
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.requires_grad:
            return
        if any(layer.calls for layer in (*self._layers, *self._functional.values())):
            self._refuse_batch_statistics(name, module, BatchNormRule.training_mode_warning)

    # -- functional uses of tracked weights (recorded by ``grabkit.stats.functional``) --------
    def _record_functional(
        self,
        use: FunctionalUse,
        weight_name: str,
        bias_name: str | None,
        layer_input: torch.Tensor,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Record a functional use of a tracked weight as one more call; return the output."""
        with torch._C.DisableTorchFunction():
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return output
            if self._step_finished():
                self._new_step()
            self._functional_seen = True
            layer = self._functional_layer(use, weight_name, bias_name)
            group = self._rows.tag()
            x, expanded, batch = layer_input, None, self._batch_for(group)
            if batch is not None and isinstance(x, torch.Tensor):
                x, expanded = batch.align(layer.name, x, output)
            if expanded is not None:
                raise NotImplementedError(
                    f"{layer.name} got an input shared by the batch (shape {tuple(x.shape)}); "
                    f"give it an explicit batch dim (expand it to (B, ...)) or call the layer."
                )
            if batch is not None and isinstance(x, torch.Tensor):
                self._check_not_moved(layer.name, x, batch.size)
            call = _Call(layer.rule.capture(use, x.detach()), group=group)
            layer.calls.append(call)
            self._hook_output(call, output, layer.name)
        return output

    def _functional_layer(
        self, use: FunctionalUse, weight_name: str, bias_name: str | None
    ) -> _TrackedLayer:
        key = (use.kind, weight_name, bias_name, use.padding_idx)
        layer = self._functional.get(key)
        if layer is None:
            params = {"weight": weight_name}
            if bias_name is not None:
                params["bias"] = bias_name
            what = {"linear": "F.linear", "transposed-linear": "matmul", "embedding": "F.embedding"}
            name = f"{weight_name!r} used by {what[use.kind]}"
            layer = self._functional[key] = _TrackedLayer(name, use, use.rule, params)
        layer.module = use  # the latest use's stand-in (same shapes and options)
        return layer

    def _refuse(self, parameter: str, operation: str) -> None:
        self._functional_seen = True
        self._refused.append((parameter, operation))

    # -- gradients ---------------------------------------------------------------------------
    def _on_output_grad(self, call: _Call, grad: torch.Tensor) -> None:
        task = self._backwards.output_gradient()
        grad = grad.detach()
        previous = call.grads.get(task)
        call.grads[task] = grad if previous is None else previous + grad
        self._gradient_arrived()

    def _on_node_grad(
        self,
        call: _Call,
        output_nr: int,
        shape: torch.Size,
        grad_outputs: tuple[torch.Tensor | None, ...],
    ) -> None:
        """Pre-hook of the node that made a call's output: its gradient (``output_nr``), in the
        output's shape (the node may make the tensor the output is a view of)."""
        grad = grad_outputs[output_nr]
        if grad is None:
            return
        task = self._backwards.output_gradient()
        if grad.shape != shape:
            grad = grad.reshape(shape)
        if grad.requires_grad:
            grad = grad.detach()
        previous = call.grads.get(task)
        call.grads[task] = grad if previous is None else previous + grad
        self._gradient_arrived()

    def _gradient_arrived(self) -> None:
        """A hook received a gradient: what was read is stale, and the next forward (outside a
        backward) starts a new step."""
        self._gradient_seen = True
        self._statistics = None
        self.generation += 1

    def _on_output_slot_grad(self, call: _Call, slot: int, slots: int, grad: torch.Tensor) -> None:
        task = self._backwards.output_gradient()
        per_slot = call.grads.get(task)
        if per_slot is None:
            per_slot = call.grads[task] = [None] * slots
        previous = per_slot[slot]
        grad = grad.detach()
        per_slot[slot] = grad if previous is None else previous + grad
        self._gradient_arrived()

    def _on_tapped_grad(self, names: list[str], index: int, grad: torch.Tensor) -> None:
        """A tap on a ``fully_shard`` parameter's unsharded copy (its gradient, local, before
        the reduce-scatter). Every backward reaching the copy counts as accumulating."""
        self._on_param_grad(names[index], (grad,))

    def _on_param_grad(self, name: str, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        """Pre-hook of the parameter's ``AccumulateGrad`` node: a backward adds this gradient
        into ``.grad`` (so the backward belongs to the step)."""
        grad = grad_outputs[0]
        if grad is None:
            return
        accumulated = self._backwards.accumulated  # this backward accumulates into ``name``
        task = torch._C._current_graph_task_id()
        names = accumulated.get(task)
        if names is None:
            accumulated[task] = {name}
        else:
            names.add(name)
        self._backward_seen = self._gradient_seen = True
        self._statistics = None
        self.generation += 1
        if self._first_reached is None:
            param = self._param_by_name.get(name)
            self._first_reached = (
                ()
                if param is None
                else (id(param), param._version, param.grad is None, gradients_taken(param))
            )
        identity = self._identity
        if identity is not None and identity.active:
            identity.observe(name, grad)
        if not self.keep_batch_gradients:
            self._param_grads[name] = None  # noted: the gradient came (see the layer check)
            return
        # A copy: autograd may adopt this very tensor as .grad and later change it in place
        # (accumulation, clipping), which must not change this step's total.
        previous = self._param_grads.get(name)
        grad = _detached(grad)
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

    # -- loss terms that are not sums over examples --------------------------------------------
    def batch_term(self, term: torch.Tensor) -> torch.Tensor:
        """Declare a loss term that is not a sum over examples; returns ``term`` to add to the loss.

        ``loss = per_example_loss + stats.batch_term(penalty)``: an L2 penalty, an auxiliary
        loss on shared parameters or on a batch statistic. Its gradient (taken here, once, by
        ``torch.autograd.grad(term, ..., retain_graph=True)``, with respect to the trainable
        parameters and to this step's layer outputs) is left out of every g_i and of
        ``total()``, whatever multiplies the term in the backward (a GradScaler's scale, a
        weight); the identity check then holds. Call it after the forward, before the backward.
        See ``grabkit.stats.batch_terms``.
        """
        if not isinstance(term, torch.Tensor) or term.numel() != 1 or not term.requires_grad:
            raise ValueError(
                "batch_term() takes the loss term itself: a scalar tensor that requires grad "
                f"(computed from the model), but got {_describe(term)}"
            )
        params = {name: p for name, p in self._params if name in self.param_shapes}
        calls = self._output_edges
        edges = [GradientEdge(node, output_nr) for _, node, output_nr, _ in calls]
        grads = torch.autograd.grad(
            term, [*params.values(), *edges], retain_graph=True, allow_unused=True
        )
        record = BatchTerm()
        for (name, _), grad in zip(params.items(), grads, strict=False):
            if grad is not None:
                record.param_grads[name] = grad.detach()
                if self._identity is not None:
                    record.gradient_sides[name] = self._identity.gradient_side(name, grad)
        for (call, _, _, shape), grad in zip(calls, grads[len(params) :], strict=True):
            if grad is not None:  # in the output's shape (the edge may be a view's base)
                record.call_grads[id(call)] = (call, grad.detach().view(shape))
        self._batch_terms.append(record)
        return gate(term, record)

    # -- reading -----------------------------------------------------------------------------
    @property
    def backward_seen(self) -> bool:
        """Whether a backward ran since this step's first forward (statistics can be read)."""
        return self._backward_seen

    @property
    def closed(self) -> bool:
        """Whether the hooks were removed (``close()``): nothing more is recorded."""
        detach = getattr(self, "_detach", None)  # none on an inert copy's engine
        return detach is None or not detach.alive

    @property
    def step_inputs(self) -> tuple[torch.Tensor, ...]:
        """The tensors the model's forward took in this step (() before it ran)."""
        return () if self._batch is None else tuple(self._batch.tensors)

    @property
    def parameter_gradients_seen(self) -> bool:
        """Whether a backward since this step's first forward reached the trainable parameters,
        not only the inputs (an input gradient by ``torch.autograd.grad``, as FGSM takes one)."""
        return bool(self._param_grads)

    @property
    def backward_mark(self) -> BackwardMark | None:
        """The first trainable parameter this step's backwards reached (by id), its version
        counter then, and whether its ``.grad`` was empty then (``grabkit.stats.source.
        reset_unused``); None before any backward, or for a sharded parameter."""
        return self._first_reached or None

    @property
    def stepped_since_backward(self) -> bool:
        """Whether the parameter of ``backward_mark`` changed in place since that backward."""
        mark = self._first_reached
        if not mark:
            return False
        param = self._param_by_name.get(self._param_names.get(mark[0], ""))
        return param is not None and param._version != mark[1]

    def statistics(self) -> StepStatistics:
        """This step's statistics by parameter name (built on first read, then cached), checked
        by the identity check before they are returned."""
        statistics = self._step_statistics()
        statistics.settle_identity()
        return statistics

    def _step_statistics(self) -> StepStatistics:
        """This step's statistics, their identity check possibly still pending (settled by the
        first host transfer of a value read from them)."""
        if self._statistics is None:
            self._statistics = self._build()
            self._readers.append(weakref.ref(self._statistics))
        return self._statistics

    def _all_layers(self) -> list[_TrackedLayer]:
        return [*self._layers, *self._functional.values()]

    def _kept_grads(self, layer: _TrackedLayer, call: _Call) -> list[tuple[frozenset[str], Any]]:
        """The call's output gradients from the step's backwards, by set of local parameter
        names they reached, less the gradient of declared batch terms."""
        if not call.grads:
            return []
        groups = self._backwards.kept(layer.params, call.grads, layer.locals)
        for term in self._batch_terms:
            entry = term.call_grads.get(id(call))
            if entry is None or entry[0] is not call or not groups:
                continue
            scaled = term.scaled(entry[1])
            if scaled is not None:
                wanted, grad = max(groups, key=lambda group: len(group[0]))
                groups[groups.index((wanted, grad))] = (wanted, grad - scaled)
        return groups

    def _kept_calls(self) -> list[tuple[_TrackedLayer, _Call, list[tuple[frozenset[str], Any]]]]:
        """(layer, call, its kept gradients) of every call that has some, once per read."""
        kept = []
        for layer in self._all_layers():
            for call in layer.calls:
                groups = self._kept_grads(layer, call)
                if groups:
                    kept.append((layer, call, groups))
        return kept

    def _check_parameters_unchanged(self) -> None:
        """Refuse a step during which the model got parameters that received gradients (a
        layer made inside the forward): those are not in the statistics. A layer replaced after
        the backward is no matter (the step's statistics describe the layers it ran). One integer
        compared per read; the next forward re-attaches (``_parameters_replaced``)."""
        if registrations() == self._registrations:
            return
        attached = {(name, id(p)) for name, p in self._params}
        changed = [
            name
            for name, p in self.model.named_parameters()
            if p.requires_grad and p.grad is not None and (name, id(p)) not in attached
        ]
        if changed:
            raise ValueError(
                f"the model's parameters {changed} were made during this step (a layer built "
                f"inside the forward, say on its first call) and received gradients the "
                f"statistics did not see, so this step's statistics are refused. The next "
                f"forward attaches to them; to keep the first step, build the model completely "
                f"(run one forward) before attaching statistics or a sampler."
            )

    def _check_accumulators(self) -> None:
        """Refuse a step in which a layer received an output gradient but a parameter of it
        was not seen accumulating one, because its gradient accumulator is no longer the node
        hooked at attach (the layer cast or moved after attaching: ``head.double()``,
        ``head.to(device)``). Its gradient then reaches ``.grad`` unseen, and the statistics
        would silently leave it out. The next forward re-attaches. Nodes are compared only for
        such parameters (``backward(inputs=...)`` leaves some out by design)."""
        if self._hooked_nodes.keys() <= self._param_grads.keys():  # all accumulated: usual
            return
        missing = {
            name
            for layer in self._layers
            if any(call.grads for call in layer.calls)
            for name in layer.params.values()
            if name not in self._param_grads and name in self._hooked_nodes
        }
        if not missing:
            return
        params = dict(self._params)
        moved = sorted(
            name
            for name in missing
            if _accumulate_grad_node(params[name]) is not self._hooked_nodes[name]
        )
        if not moved:
            return
        self._accumulators_replaced = True
        raise ValueError(
            f"parameters {moved} were cast or moved (to another dtype or device: "
            f"module.to(...), .double(), .half(), .cuda()) after PerSampleStats attached to the "
            f"model, and PyTorch gave them new gradient accumulators: this step's gradients of "
            f"them reached .grad without the statistics seeing them, so the statistics of this "
            f"step are refused. The next forward re-attaches to the new accumulators (a cast "
            f"of the whole model is followed at its first forward). Cast or move the model "
            f"before attaching statistics (or a hook-mode sampler) to avoid the lost step."
        )

    def _batch_size(self, kept: list) -> int:
        sizes: dict[str, list[int]] = {}
        for layer, call, groups in kept:
            for _, grad in groups:
                size = call.batch_size
                size = grad.shape[0] if size is None else size
                sizes.setdefault(layer.name, []).append(size)
        if not sizes:
            after = (
                " The last backward's statistics were dropped when a later forward with grad "
                "enabled started a new step (an evaluation forward outside torch.no_grad(), say): "
                "read them before that forward, or run it under torch.no_grad()."
                if self._closed_a_backward
                else ""
            )
            raise RuntimeError(
                "PerSampleStats has no statistics yet: run a forward pass with grad enabled and "
                f"loss.backward() before reading.{after}"
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
                f"examples in every call. {UNANNOUNCED_GROUPS_HELP}"
            )
        return distinct.pop()

    def _check_step_is_defined(self) -> None:
        """Refuse, with the reason, steps whose per-example gradients the hooks cannot give."""
        if self._backwards.double_backward():
            raise NotImplementedError(
                "this step ran torch.autograd.grad(..., create_graph=True) over the model's "
                "layers (an input-gradient penalty: WGAN-GP, R1, a gradient-norm regulariser) "
                "beside its backward: the per-example gradient of such a loss has second-order "
                "parts (through the input gradient's own graph) that layer hooks do not see, so "
                "PerSampleStats refuses it rather than return the first-order part. Measure a "
                "step without the penalty, or compute the penalty from a separate forward that "
                "PerSampleStats does not watch (a copy of the model)."
            )
        if self._unread_outputs:
            raise NotImplementedError(
                f"a loss term reached layer(s) {self._unread_outputs} through an output after "
                f"the first (MultiheadAttention's attention weights: an entropy regulariser or "
                f"a distillation target on them), and the layer's rule differentiates only its "
                f"first output, so every g_i would leave that term out. Compute the term from "
                f"a separate forward that PerSampleStats does not watch (a copy of the model), "
                f"or drop it from the steps you measure."
            )
        if self._refused:
            uses = ", ".join(f"{name!r} by {operation}" for name, operation in self._refused)
            raise NotImplementedError(
                f"tracked parameters were used outside their layers in the model's forward in "
                f"a way PerSampleStats has no per-example factor for: {uses}. F.linear, "
                f"F.embedding and matmul uses are computed; for another use, call the layer as "
                f"a module, register a rule for the module that makes the use "
                f"(grabkit.stats.register_rule), or freeze the parameter."
                + _parametrized_hint(self._refused)
                + _pruning_hint(self._refused)
                + _transform_hint(self._refused)
            )

    def _check_gradients_came_through_layers(self, kept: list) -> None:
        reached = {name for layer, _, _ in kept for name in layer.params.values()}
        for layer in self._layers:
            if any(name in reached for name in layer.params.values()):
                continue
            for name in layer.params.values():
                if name in self._param_grads:
                    raise RuntimeError(
                        f"parameter {name!r} received a gradient in this backward, but its "
                        f"layer {layer.name!r} never passed one through its forward hook (the "
                        f"parameter was used outside its layer, e.g. F.linear(x, layer.weight) "
                        f"or a weight read outside the model's forward; or the layer ran inside "
                        f"a torch.func transform such as torch.vmap, whose calls are not "
                        f"watched). Call the layer as a module outside such transforms, use it "
                        f"inside the model's forward (functional_uses=True), or freeze the "
                        f"parameter."
                    )

    def step_factors(self) -> tuple[dict[str, ParameterFactor | None], int, float]:
        """(name -> merged factor or None, batch size B, scale) of the latest backward.

        The factors hold g_i / scale (``scale`` is B for a mean-reduced loss); a parameter used
        by several layers or calls gets their combination (``grabkit.stats.factors.combine``).
        With ``check_identity`` they are verified against the delivered gradients first.
        """
        factors, batch_size, scale, _ = self.checked_step_factors(defer=False)
        return factors, batch_size, scale

    def checked_step_factors(
        self, *, defer: bool
    ) -> tuple[dict[str, ParameterFactor | None], int, float, PendingIdentityCheck | None]:
        """``step_factors()`` and, with ``defer``, the identity check left pending (its numbers
        formed on the device, compared when they reach the host)."""
        self._check_step_is_defined()
        self._check_parameters_unchanged()
        kept = self._kept_calls()
        batch = self._batch
        if batch is not None and batch.version not in (None, batch.tensors[0]._version):
            self._check_kept_input_unchanged(kept, batch)
        self._check_accumulators()
        self._check_gradients_came_through_layers(kept)
        self._check_weights_unchanged(kept)
        low: dict[str, float] = {}
        if self._rows.grouped:  # a grouped batch: factors group by group, rows to items
            self._rows.check_reduction(self.loss_reduction)
            calls = [
                (
                    layer.name,
                    call.group,
                    grad.shape[0] if call.batch_size is None else call.batch_size,
                )
                for layer, call, groups in kept
                for _, grad in groups
            ]
            factors, batch_size = self._rows.factors(
                calls, lambda group: self._merged_factors(kept, low, group)
            )
        else:
            batch_size = self._batch_size(kept)
            factors = self._merged_factors(kept, low)
        scale = float(batch_size) if self.loss_reduction == "mean" else 1.0
        pending = None
        identity = self._identity
        if identity is not None and identity.active:  # a step the check's schedule checks
            pending = identity.verify(factors, low, self._batch_term_gradient_sides(), defer=defer)
        return factors, batch_size, scale, pending

    def _merged_factors(
        self, kept: list, low: dict[str, float], group: GroupRows | None = None
    ) -> dict[str, ParameterFactor | None]:
        """name -> the combined factor of the ``kept`` calls (of one group of a grouped batch,
        when ``group`` is given; None: no gradient); ``low`` gathers the coarser precisions
        their operands were rounded to."""
        factors: dict[str, ParameterFactor | None] = dict.fromkeys(self.param_shapes)
        for layer, call, groups in kept:
            if group is not None and call.group is not group:
                continue
            for wanted, grad in groups:
                self._add_factors(factors, low, layer, call, wanted, grad)
        return factors

    def _add_factors(
        self,
        factors: dict[str, ParameterFactor | None],
        low: dict[str, float],
        layer: _TrackedLayer,
        call: _Call,
        wanted: frozenset[str],
        grad: Any,
    ) -> None:
        grad = tuple(grad) if isinstance(grad, list) else grad
        made = layer.rule.factors(layer.module, call.captured, grad, wanted)
        identity = self._identity
        rounding = self._low_precision(call, grad) if identity and identity.active else 0.0
        for local, factor in made.items():
            full = layer.params[local]
            previous = factors[full]
            factors[full] = factor if previous is None else combine(previous, factor)
            if rounding:
                low[full] = max(low.get(full, 0.0), rounding)

    def _low_precision(self, call: _Call, grad: Any) -> float:
        """The unit roundoff of a precision below the statistics' arithmetic (at least float32)
        that the call's operands or the delivered gradient were rounded to (bf16 / fp16 under
        autocast, or bf16 / fp16 parameters, whose gradients autograd delivers rounded), or 0."""
        captured = call.captured
        if type(captured) is torch.Tensor and type(grad) is torch.Tensor:
            if captured.dtype is self.dtype and grad.dtype is self.dtype:
                return self._parameter_roundoff()  # the usual case: the parameters' own dtype
            found = {captured.dtype, grad.dtype}
        else:
            found = set()
            _dtypes(captured, found)
            _dtypes(grad, found)
        coarsest = max((unit_roundoff(d) for d in found), default=0.0)
        return max(coarsest if coarsest > self._own_roundoff() else 0.0, self._parameter_roundoff())

    def _own_roundoff(self) -> float:
        """The unit roundoff of the statistics' arithmetic: the parameters' dtype, at least
        float32's."""
        own = _OWN_ROUNDOFF.get(self.dtype)
        if own is None:
            own = _OWN_ROUNDOFF[self.dtype] = unit_roundoff(
                torch.promote_types(self.dtype, torch.float32)
            )
        return own

    def _parameter_roundoff(self) -> float:
        """The unit roundoff of low-precision parameters (bf16 / fp16: their delivered
        gradients are rounded to it), or 0 for float32 / float64 ones."""
        own = unit_roundoff(self.dtype)
        return own if own > self._own_roundoff() else 0.0

    def _batch_term_gradient_sides(self) -> dict[str, torch.Tensor]:
        """name -> the identity probe of the declared batch terms' gradients, as scaled."""
        out: dict[str, torch.Tensor] = {}
        for term in self._batch_terms:
            for name, value in term.gradient_sides.items():
                scaled = term.scaled(value)
                if scaled is not None:
                    out[name] = scaled if name not in out else out[name] + scaled
        return out

    def _batch_gradients(self) -> dict[str, torch.Tensor]:
        """name -> this step's gradient, less the declared batch terms' (zeros where none)."""
        grads = self._param_grads
        if not self._batch_terms and len(grads) == len(self.param_shapes):
            return {name: as_dtype(grads[name], self.dtype) for name in self.param_shapes}
        out = {}
        for name, shape in self.param_shapes.items():
            grad = self._param_grads.get(name)
            if grad is None:
                grad = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                grad = as_dtype(grad, self.dtype)
            for term in self._batch_terms:
                part = term.param_grads.get(name)
                scaled = None if part is None else term.scaled(part)
                if scaled is not None:
                    grad = grad - scaled.to(grad.dtype)
            out[name] = grad
        return out

    def _build(self) -> StepStatistics:
        if not self.keep_batch_gradients:
            raise RuntimeError(
                "this PerSampleStats was built with keep_batch_gradients=False, so it keeps no "
                "batch gradient and answers step_factors() only; build it with "
                "keep_batch_gradients=True to read norms, Gram matrices, dots and sums."
            )
        factors, batch_size, scale, pending = self.checked_step_factors(defer=True)
        return StepStatistics(
            self.param_shapes, factors, self._batch_gradients(), batch_size, self.dtype,
            self.device, scale, layout=self._layout, pending_check=pending,
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

    def gradient_batch(self, *, settle: bool = True) -> HookGradientBatch:
        """This step's statistics as a ``GradientBatch`` in the flat layout of ``param_shapes``.

        ``settle=False`` leaves the identity check pending on the batch: its comparison then
        rides on the batch's first ``to_host`` (the consumer's one host transfer of a step),
        before any value reaches the host (see ``StatisticsSource.gradient_batch``).
        """
        statistics = self._step_statistics()
        if settle:
            statistics.settle_identity()
        return HookGradientBatch(statistics)

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
