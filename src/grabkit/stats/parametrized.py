"""Layers whose weights are computed from other parameters at every forward:
``torch.nn.utils.parametrize`` (``parametrizations.orthogonal``, ``weight_norm``,
``spectral_norm``, a parametrization of the user's).

A parametrized layer's ``weight`` is ``W = f(theta)``, where theta are the parametrization's
originals (``parametrizations.weight.original``, or ``original0``, ``original1`` for weight
norm) and any parameters of its own modules. Example i's gradient of theta is the
vector-Jacobian product of f at theta with example i's gradient of W: the layer's own rule
gives the latter (an outer-product factor for a Linear, patches for a convolution), which is
materialised per example, (B, *W.shape), for that layer only, and pulled back through f by
``torch.func.vjp`` (one evaluation of f, then ``vmap`` over the B gradients). Exact, at the
cost of B copies of the layer's weight while the statistics are read.

f is evaluated in eval mode: ``spectral_norm``'s power iteration then leaves its vectors as the
forward left them, so f gives the forward's W and the measurement changes no state. The
parametrization must be deterministic (a weight dropout in it is drawn again, and the identity
check reports the difference). f is evaluated at the parameters' values when the statistics
are read: a read after they changed (an ``optimizer.step()`` before it) is refused by the engine
(``LayerRule.reads_parameters``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from grabkit.stats.factors import OuterProductFactor, ParameterFactor, PerExampleFactor
from grabkit.stats.rules import LayerRule

__all__ = [
    "ParametrizedRule",
    "is_parametrized",
    "parametrization_parameters",
    "refuse_weight_hooks",
]

_PREFIX = "parametrizations."


def is_parametrized(module: nn.Module) -> bool:
    """Whether ``module`` has tensors computed by ``torch.nn.utils.parametrize``."""
    return parametrize.is_parametrized(module)


def parametrization_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Local name (``"parametrizations.weight.original"``) -> parameter of every
    parametrization of ``module`` that requires grad."""
    return {
        name: p
        for name, p in module.parametrizations.named_parameters(prefix="parametrizations")
        if p.requires_grad
    }


def refuse_weight_hooks(label: str, module: nn.Module, own: Collection[str]) -> None:
    """Raise ``ValueError`` for a layer whose weight the deprecated ``torch.nn.utils.weight_norm``
    / ``spectral_norm`` compute in a forward pre-hook from trainable parameters: the layer's
    rule would see a weight that is no parameter, and no gradient of those parameters."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            sources, api = [f"{hook.name}_g", f"{hook.name}_v"], "weight_norm"
        elif isinstance(hook, SpectralNorm):
            sources, api = [f"{hook.name}_orig"], "spectral_norm"
        else:
            continue
        trainable = [name for name in sources if name in own]
        if trainable:
            raise ValueError(
                f"layer {label!r} ({type(module).__name__}) computes its {hook.name!r} from "
                f"{trainable} in a forward pre-hook of torch.nn.utils.{api} (the deprecated "
                f"API): its rule sees the computed tensor, which is no parameter, and no "
                f"per-example gradient of {trainable}. Use torch.nn.utils.parametrizations."
                f"{api}(layer) instead (the same computation: PerSampleStats pulls the "
                f"per-example gradients back through it, exactly), or freeze {trainable}."
            )


class ParametrizedRule(LayerRule):
    """The rule of a parametrized layer: its own rule for the computed tensors, pulled back
    through each parametrization to the parameters it is computed from."""

    reads_parameters = True  # f's Jacobian is taken at the parameters' current values

    def __init__(self, inner: LayerRule) -> None:
        self.inner = inner
        self.training_mode_warning = inner.training_mode_warning
        self.whole_call = inner.whole_call
        self.multiple_outputs = inner.multiple_outputs

    def output_tensors(self, module: nn.Module, output: Any) -> tuple[torch.Tensor | None, ...]:
        return self.inner.output_tensors(module, output)

    def replace_output(self, module: nn.Module, output: Any) -> Any:
        return self.inner.replace_output(module, output)

    def call_batch(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, int, int]:
        return self.inner.call_batch(module, args, kwargs)

    def check(self, module: nn.Module) -> None:
        self.inner.check(module)

    def capture(self, module: nn.Module, layer_input: Any) -> object:
        return self.inner.capture(module, layer_input)

    def factors(
        self,
        module: nn.Module,
        layer_input: Any,
        output_grad: Any,
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        sources: dict[str, dict[str, str]] = {}  # tensor -> {name in its list: local name}
        for local in wanted:
            if local.startswith(_PREFIX):
                tensor, _, name = local[len(_PREFIX) :].partition(".")
                sources.setdefault(tensor, {})[name] = local
        own = {local for local in wanted if not local.startswith(_PREFIX)}
        lists = module.parametrizations
        training = lists.training
        # The inner rule reads ``module.weight`` (its shape): computed once, in eval mode, so
        # that spectral_norm's power iteration does not run again (the state stays the
        # forward's, and so does the W the pull-back differentiates)
        lists.train(False)
        try:
            with parametrize.cached():
                made = self.inner.factors(module, layer_input, output_grad, own | set(sources))
                out = {local: factor for local, factor in made.items() if local in own}
                for tensor, names in sources.items():
                    factor = made.get(tensor)
                    if factor is not None:
                        pulled = _pull_back(lists[tensor], names, factor)
                        out.update({names[name]: f for name, f in pulled.items()})
        finally:
            lists.train(training)
        return out


def _pull_back(
    parametrizations: nn.Module, names: dict[str, str], factor: ParameterFactor
) -> dict[str, PerExampleFactor]:
    """Per-example gradients of the parametrization's parameters ``names`` (their names in
    ``parametrizations``) from ``factor``, the per-example gradients of the tensor it computes."""
    params = dict(parametrizations.named_parameters())
    theta = {name: params[name].detach() for name in names}

    def computed(values: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(parametrizations, values, (), strict=False)

    with torch.enable_grad():
        _, pullback = vjp(computed, theta)
    like = next(iter(theta.values()))
    dense = _per_example(factor, like)
    grads = vmap(pullback)(dense.to(like.dtype))[0]
    return {name: PerExampleFactor(g.detach(), theta[name].shape) for name, g in grads.items()}


def _per_example(factor: ParameterFactor, like: torch.Tensor) -> torch.Tensor:
    """(B, *param_shape): the factor's per-example gradients, materialised (``like``: a tensor
    on the device and in the dtype of the parameters)."""
    b, shape = factor.batch_size, factor.param_shape
    if isinstance(factor, PerExampleFactor):
        return factor.grads.reshape(b, *shape)
    if isinstance(factor, OuterProductFactor):  # (G, q, p) blocks per example, summed over T
        blocks = torch.einsum("btgq,btgp->bgqp", factor.output_grads, factor.inputs)
        return blocks.reshape(b, *shape)
    # any other factor (an embedding table): sum_i w_i g_i with w the B unit vectors
    return factor.weighted_sum(torch.eye(b, dtype=like.dtype, device=like.device))
