"""One rule per layer type: how a layer's kept input and output gradient factor its parameters.

A rule sees one call of a layer: the input it was called with and the gradient of its output
(as autograd computed it; the engine rescales the reads for a mean-reduced loss). It returns,
for each trainable parameter of that layer, a ``ParameterFactor`` (see
``grabkit.stats.factors``) that answers norms, Gram matrices, dots and weighted sums exactly.

Built-in rules: ``nn.Linear`` (any leading dims), ``nn.Conv1d`` / ``nn.Conv2d`` (via unfold; any
stride, dilation, groups, padding mode), ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``,
``nn.GroupNorm`` and ``nn.BatchNorm1d/2d/3d`` (training mode: batch statistics treated as
constants). ``register_rule`` adds or replaces a rule for another layer type.

The batch dimension is dim 0 of every layer's input (``batch_first`` layouts), except where a
rule says where its call holds the examples (``call_batch``: the recurrent layers of
``grabkit.stats.recurrent``, whose ``batch_first=False`` inputs hold them in dim 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats.factors import (
    EmbeddingFactor,
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    compute_dtype,
)

__all__ = [
    "LayerRule",
    "find_rule",
    "register_rule",
    "registered_rules",
    "rule_for",
]


class LayerRule(ABC):
    """Factor the per-example gradients of one layer type's parameters."""

    #: Warn (once per engine) when the layer runs in training mode: for layers whose per-example
    #: gradients are only defined up to a convention there (BatchNorm's batch statistics).
    training_mode_warning: str | None = None

    def uses_batch_statistics(self, module: nn.Module) -> bool:
        """Whether this call of the layer couples the examples (for a rule with a
        ``training_mode_warning``): training mode, by default."""
        return module.training

    #: When True, ``factors`` reads the layer's parameters (their values at read time: a replay
    #: of the layer, as the recurrent layers, attention and the torch.func fallback do): the
    #: engine notes their versions at the call and refuses a read after they changed in place
    #: (an ``optimizer.step()`` between the backward and the read would give other weights'
    #: statistics). Rules whose factors are made of inputs and output gradients only leave it.
    reads_parameters: bool = False

    #: When True, ``capture`` receives the call's ``(args, kwargs)`` (tensors detached) instead
    #: of the first input, and for a tuple output the first element is the output tracked.
    whole_call: bool = False

    #: When True, the layer's per-example gradients need the gradients of several of its outputs
    #: (a recurrent layer's output sequence and final states): ``capture`` receives the call's
    #: raw ``(args, kwargs, output)``, the engine hooks each tensor ``output_tensors`` names,
    #: ``factors`` receives a tuple of their gradients (None where one got none), and
    #: ``call_batch`` says where the call holds its examples.
    multiple_outputs: bool = False

    def output_tensors(self, module: nn.Module, output: Any) -> tuple[torch.Tensor | None, ...]:
        """The output tensors whose gradients ``factors`` needs (``multiple_outputs`` rules)."""
        return (output,)

    def replace_output(self, module: nn.Module, output: Any) -> Any:
        """The call's output with the same values, or None to keep it (``multiple_outputs`` and
        ``whole_call`` rules): say a batch-first copy of a transposed view, so that later
        layers can tell the batch dim from an equal other dim."""
        return None

    def call_batch(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, int, int]:
        """(input tensor or None, its batch dim, number of examples) of a call
        (``multiple_outputs`` rules), so the engine can check it against the model's batch."""
        raise NotImplementedError(f"{type(self).__name__} does not define call_batch")

    def check(self, module: nn.Module) -> None:  # noqa: B027 (optional hook, default accepts all)
        """Raise ``ValueError`` at attach time for configurations the rule cannot make exact."""

    def capture(self, module: nn.Module, layer_input: torch.Tensor) -> object:
        """What to keep from a forward call (default: a reference to the input itself).

        Called in the forward hook; the result comes back as ``layer_input`` in ``factors``.
        Override to record forward-time state the layer's result depended on.
        """
        return layer_input

    @abstractmethod
    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        """Factors of the parameters named in ``wanted`` (local names such as ``"weight"``).

        Args:
            module: the layer.
            layer_input: what ``capture`` kept: by default the first input of the call, (B, ...).
            output_grad: gradient of this call's output, (B, ...).
            wanted: local names of the layer's parameters that require grad.
        """


_RULES: dict[type[nn.Module], LayerRule] = {}


def register_rule(module_type: type[nn.Module], rule: LayerRule) -> None:
    """Use ``rule`` for layers of ``module_type`` and of subclasses that keep its ``forward``."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type should be an nn.Module subclass, but got {module_type!r}")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule should be a LayerRule instance, but got {type(rule).__name__}")
    _RULES[module_type] = rule


_Rule = TypeVar("_Rule", bound=type[LayerRule])


def rule_for(*module_types: type[nn.Module]) -> Callable[[_Rule], _Rule]:
    """Class decorator: register an instance of the decorated rule for each of ``module_types``.

    Example::

        @rule_for(MyLayer)
        class MyLayerRule(LayerRule):
            def factors(self, module, layer_input, output_grad, wanted): ...
    """

    def decorate(rule_class: _Rule) -> _Rule:
        for module_type in module_types:
            register_rule(module_type, rule_class())
        return rule_class

    return decorate


def registered_rules() -> dict[type[nn.Module], LayerRule]:
    """A copy of the layer-type -> rule table."""
    return dict(_RULES)


# Rules for classes of optional libraries, by "module.qualname": registered when such a layer is
# first seen, so importing grabkit never imports those libraries.
_LAZY_RULES: dict[str, type[LayerRule]] = {}


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module``'s type or nearest registered base class, if ``forward`` is kept.

    A subclass that overrides ``forward`` may compute something else with the same parameters,
    so it gets no inherited rule (register one for it explicitly).
    """
    for cls in type(module).__mro__:
        lazy = _LAZY_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if lazy is not None and cls not in _RULES:
            register_rule(cls, lazy())
        rule = _RULES.get(cls)
        if rule is not None:
            return rule if type(module).forward is cls.forward else None
    return None


def _as_sequence(t: torch.Tensor, features: int) -> torch.Tensor:
    """(B, ..., f) -> (B, T, 1, f), T the product of the middle dims (1 for plain vectors)."""
    return t.reshape(t.shape[0], -1, 1, features)


def _require_batched(module: nn.Module, layer_input: torch.Tensor, min_dim: int) -> None:
    if layer_input.dim() < min_dim:
        raise ValueError(
            f"{type(module).__name__} got an input of shape {tuple(layer_input.shape)} without a "
            f"batch dimension; per-example statistics need batched inputs (B, ...) with the "
            f"batch in dim 0."
        )


@rule_for(nn.Linear)
class LinearRule(LayerRule):
    """``y = x W^T + b`` over any leading dims: W's gradient is an outer product per position."""

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        _require_batched(module, layer_input, 2)
        out: dict[str, ParameterFactor] = {}
        if "weight" in wanted:
            if output_grad.dim() == 2:  # (B, f) already: held as they are
                weight = OuterProductFactor(layer_input, output_grad, module.weight.shape)
            else:
                weight = OuterProductFactor(
                    _as_sequence(layer_input, module.in_features),
                    _as_sequence(output_grad, module.out_features),
                    module.weight.shape,
                )
            out["weight"] = weight
        if "bias" in wanted:
            weight = out.get("weight") if output_grad.dim() == 2 else None  # the same (B, q)
            out["bias"] = _bias_factor(output_grad, module.bias.shape, output_of=weight)
        return out


def _bias_factor(
    output_grad: torch.Tensor, shape: torch.Size, output_of: OuterProductFactor | None = None
) -> PerExampleFactor:
    """A bias's per-example gradient from (B, ..., f) output gradients: their sum over the
    positions (a view, no copy, when there is one position per example: a sum over one element
    would copy, for the same numbers)."""
    if output_grad.dim() == 2:
        return PerExampleFactor(output_grad, shape, output_of=output_of)
    positions = output_grad.reshape(output_grad.shape[0], -1, output_grad.shape[-1])
    if positions.shape[1] == 1:
        return PerExampleFactor(positions[:, 0], shape, output_of=output_of)
    return _summed_factor(positions, (1,), shape)


def _summed_factor(
    product: torch.Tensor,
    dims: tuple[int, ...],
    shape: torch.Size,
    magnitude: Callable[[], torch.Tensor] | None = None,
) -> PerExampleFactor:
    """Per-example gradients ``product.sum(dims)`` (B, *shape) of a rule that sums over
    positions, with the norms of those terms for the identity check's tolerance (computed only
    if the check asks: the 2-norm over the parameter's dims of every term, summed; of
    ``magnitude()`` instead of ``product`` where the terms' rounding is relative to more)."""
    kept = tuple(d for d in range(1, product.dim()) if d not in dims)
    count = 1
    for d in dims:
        count *= product.shape[d]

    def terms() -> torch.Tensor:
        bound = product if magnitude is None else magnitude()
        return torch.linalg.vector_norm(bound, dim=kept).sum()

    if not dims and magnitude is None:
        return PerExampleFactor(product, shape)
    per_example = product.sum(dim=dims) if dims else product
    return PerExampleFactor(per_example, shape, positions=count, terms=terms)


class TransposedLinearRule(LayerRule):
    """transformers' ``Conv1D`` (GPT-2): ``y = x W + b`` with W stored (in, out).

    W's per-example gradient is sum_t A[i, t] D[i, t]^T, the transpose of Linear's, so the
    outer-product factor is built with the roles of input and output gradient swapped.
    """

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        _require_batched(module, layer_input, 2)
        in_features, out_features = module.weight.shape
        out: dict[str, ParameterFactor] = {}
        if "weight" in wanted:
            out["weight"] = OuterProductFactor(
                _as_sequence(output_grad, out_features),
                _as_sequence(layer_input, in_features),
                module.weight.shape,
            )
        if "bias" in wanted:
            out["bias"] = _bias_factor(output_grad, module.bias.shape)
        return out


_LAZY_RULES["transformers.pytorch_utils.Conv1D"] = TransposedLinearRule


class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d``: unfold the (padded) input into patches, then as Linear."""

    def __init__(self, spatial_dims: int) -> None:
        self.spatial_dims = spatial_dims

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        _require_batched(module, layer_input, self.spatial_dims + 2)
        b = layer_input.shape[0]
        g = module.groups
        c_out = module.out_channels
        out: dict[str, ParameterFactor] = {}
        if "weight" in wanted:
            patches = self._patches(module, layer_input)  # (B, C_in k, L)
            length = patches.shape[-1]
            inputs = patches.reshape(b, g, -1, length).permute(0, 3, 1, 2)  # (B, L, G, p)
            grads = output_grad.reshape(b, g, c_out // g, length).permute(0, 3, 1, 2)
            out["weight"] = OuterProductFactor(inputs, grads, module.weight.shape)
        if "bias" in wanted:
            out["bias"] = _summed_factor(output_grad.reshape(b, c_out, -1), (2,), module.bias.shape)
        return out

    def _patches(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in k, L) patches, one column per output position, rows in the weight's
        (C_in, kernel) order: ``F.unfold``'s values and layout, copied from strided views of
        the padded input (rows of contiguous input positions: several times faster than
        ``F.unfold`` on the CPU).

        An input in another layout (channels last: images converted from (H, W, C) arrays, and
        every activation computed from them) is made contiguous first where the patches are
        at least as large as the input: the copy along input rows then runs about three times
        faster than one gathering every channel apart (LeNet's first convolution, B = 16).
        """
        padding = module._reversed_padding_repeated_twice
        if any(padding):  # no padding: no copy
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, padding, mode=mode)
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
        if self.spatial_dims == 1:  # treat a length-L signal as a 1 x L image
            x = x.unsqueeze(2)
            kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
        windows = _windows(x, kernel, dilation, stride)
        if not x.is_contiguous() and windows.numel() >= x.numel():
            windows = _windows(x.contiguous(), kernel, dilation, stride)
        b, c, h, w, kh, kw = windows.shape
        patches = windows.permute(0, 1, 4, 5, 2, 3)  # (B, C_in, kh, kw, H_out, W_out)
        return patches.reshape(b, c * kh * kw, h * w)


def _windows(
    x: torch.Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """(B, C, H_out, W_out, kh, kw) view of the (B, C, H, W) padded input ``x``: entry
    [b, c, i, j, u, v] is the input the kernel's (u, v) tap meets at output position (i, j)."""
    windows = x
    for dim, (k, d, st) in enumerate(zip(kernel, dilation, stride, strict=True), start=2):
        windows = windows.unfold(dim, (k - 1) * d + 1, st)[..., ::d]  # adds a kernel dim
    return windows


register_rule(nn.Conv1d, ConvRule(spatial_dims=1))
register_rule(nn.Conv2d, ConvRule(spatial_dims=2))


@rule_for(nn.Embedding)
class EmbeddingRule(LayerRule):
    """``nn.Embedding``: each example's gradient touches only the rows it looked up."""

    def check(self, module: nn.Module) -> None:
        if module.sparse:
            raise ValueError(
                "nn.Embedding(sparse=True) is not supported by PerSampleStats; "
                "construct the embedding with sparse=False."
            )
        if module.scale_grad_by_freq:
            raise ValueError(
                "nn.Embedding(scale_grad_by_freq=True) couples examples through batch-wide "
                "token counts, so per-example gradients are not defined; use "
                "scale_grad_by_freq=False."
            )

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        if "weight" not in wanted:
            return {}
        _require_batched(module, layer_input, 1)
        b = layer_input.shape[0]
        indices = layer_input.reshape(b, -1)
        grads = output_grad.reshape(b, indices.shape[1], module.embedding_dim)
        if module.padding_idx is not None:
            grads = grads * (indices != module.padding_idx).unsqueeze(-1)
        return {"weight": EmbeddingFactor(indices, grads, module.weight.shape)}


class _AffineNormRule(LayerRule):
    """Normalisation layers ``y = xhat * weight + bias``: per-example sums of D xhat and D."""

    @abstractmethod
    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        """xhat in ``dtype``: the input normalised exactly as the layer's forward did it."""

    def input_tensor(self, captured: Any) -> torch.Tensor:
        """The layer input within what ``capture`` kept."""
        return captured

    @abstractmethod
    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        """Dims of x summed away to reach the parameter's shape (after dim 0, the batch)."""

    def rounding_scale(self, module: nn.Module, captured: Any, dtype: torch.Tensor) -> torch.Tensor:
        """(|x| + |mean|) * rstd, shaped like x: what the rounding error of xhat is relative to
        (a recomputed xhat differs from the backward's own by a few units of it; it exceeds
        |xhat| where x - mean cancels, e.g. a row of equal values). For the identity check."""
        return self.normalised(module, captured, dtype).abs()

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        x = self.input_tensor(layer_input)
        _require_batched(module, x, 2)
        dims = self.reduce_dims(module, x)
        out: dict[str, ParameterFactor] = {}
        grad = output_grad.to(compute_dtype(output_grad.dtype))
        if "weight" in wanted:
            xhat = self.normalised(module, layer_input, grad.dtype)

            def magnitude() -> torch.Tensor:
                return grad * self.rounding_scale(module, layer_input, grad.dtype)

            out["weight"] = _summed_factor(grad * xhat, dims, module.weight.shape, magnitude)
        if "bias" in wanted and getattr(module, "bias", None) is not None:
            out["bias"] = _summed_factor(grad, dims, module.bias.shape)
        return out


def _shifted_scale(
    x: torch.Tensor, dims: tuple[int, ...], eps: float, stats: tuple | None = None
) -> torch.Tensor:
    """(|x| + |mean|) / sqrt(var + eps) with the mean and variance over ``dims`` (or ``stats``
    = (mean, var) given, broadcastable to x)."""
    if stats is None:
        mean = x.mean(dim=dims, keepdim=True)
        var = x.var(dim=dims, unbiased=False, keepdim=True)
    else:
        mean, var = stats
    return (x.abs() + mean.abs()) * torch.rsqrt(var + eps)


@rule_for(nn.LayerNorm)
class LayerNormRule(_AffineNormRule):
    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x = captured.to(dtype)
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)

    def rounding_scale(self, module: nn.Module, captured: Any, dtype: torch.Tensor) -> torch.Tensor:
        x = captured.to(dtype)
        dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
        return _shifted_scale(x, dims, module.eps)

    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(1, x.dim() - len(module.normalized_shape)))


@rule_for(nn.RMSNorm)
class RMSNormRule(_AffineNormRule):
    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x = captured.to(dtype)
        return F.rms_norm(x, module.normalized_shape, None, module.eps)

    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(1, x.dim() - len(module.normalized_shape)))


@rule_for(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x = captured.to(dtype)
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def rounding_scale(self, module: nn.Module, captured: Any, dtype: torch.Tensor) -> torch.Tensor:
        x = captured.to(dtype)
        grouped = x.reshape(x.shape[0], module.num_groups, -1)
        return _shifted_scale(grouped, (2,), module.eps).reshape(x.shape)

    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, x.dim()))


class _BatchNormCall(NamedTuple):
    x: torch.Tensor
    use_batch_stats: bool


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm call normalises with the batch's own mean and variance, as
    ``_BatchNorm.forward`` decides: in training mode, or in either mode without running
    statistics (``track_running_stats=False``)."""
    return module.training or module.running_mean is None


@rule_for(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(_AffineNormRule):
    """BatchNorm: in training mode the batch mean and variance are treated as constants.

    The true gradient of example i's loss also flows through the batch statistics into every
    other example, so "example i's gradient" has no exact meaning in training mode; the
    statistics here use g_i = sum over positions of D_i * xhat_i (and D_i for the bias), the
    convention of Opacus-style per-example methods. In eval mode (running statistics) it is exact.
    """

    training_mode_warning = (
        "BatchNorm in training mode: PerSampleStats treats the batch mean and variance as "
        "constants, so per-example statistics of its affine parameters ignore the coupling "
        "through the batch statistics. Freeze the BatchNorm affine parameters, switch it to eval "
        "mode, or use GroupNorm/LayerNorm for exact statistics."
    )

    def uses_batch_statistics(self, module: nn.Module) -> bool:
        return uses_batch_statistics(module)

    def capture(self, module: nn.Module, layer_input: torch.Tensor) -> _BatchNormCall:
        # Which statistics normalised this call is fixed at forward time, not at read time.
        return _BatchNormCall(layer_input, uses_batch_statistics(module))

    def input_tensor(self, captured: _BatchNormCall) -> torch.Tensor:
        return captured.x

    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x = captured.x.to(dtype)
        use_batch_stats = captured.use_batch_stats
        return F.batch_norm(
            x,
            None if use_batch_stats else module.running_mean.to(x.dtype),
            None if use_batch_stats else module.running_var.to(x.dtype),
            training=use_batch_stats,
            eps=module.eps,
        )

    def rounding_scale(self, module: nn.Module, captured: Any, dtype: torch.Tensor) -> torch.Tensor:
        x = captured.x.to(dtype)
        if captured.use_batch_stats:
            return _shifted_scale(x, (0, *range(2, x.dim())), module.eps)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        stats = (
            module.running_mean.to(dtype).view(shape),
            module.running_var.to(dtype).view(shape),
        )
        return _shifted_scale(x, (), module.eps, stats)

    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, x.dim()))
