"""Opt-in fallback for layers without a rule: their per-example gradients by torch.func.

For a layer f with its own parameters theta, example i's gradient is the vector-Jacobian
product of f(theta, x_i) with D_i, the gradient of example i's output; ``torch.func.vmap`` of
``torch.func.vjp`` gives all B at once from the layer input and output gradient the hooks kept.
The result is materialised, (B, *shape) per parameter, for this layer only, so the fallback
suits small custom layers (a learned gain, a PReLU) rather than large ones.

Requirements on the layer: its output depends on its first positional input only, row by row
(no coupling across the batch, no randomness), and its parameters are its own (``recurse=False``;
child layers are tracked by their own rules).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, vjp, vmap

from grabkit.stats.factors import ParameterFactor, PerExampleFactor
from grabkit.stats.rules import LayerRule

__all__ = ["TorchFuncFallbackRule"]


class TorchFuncFallbackRule(LayerRule):
    """Per-example gradients of a layer's own parameters by ``vmap(vjp(...))``."""

    def factors(self, module, layer_input, output_grad, wanted):
        params = {
            name: p.detach() for name, p in module.named_parameters(recurse=False) if name in wanted
        }

        def one_example(x: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
            def layer(p: dict[str, torch.Tensor]) -> torch.Tensor:
                return functional_call(module, p, (x.unsqueeze(0),), strict=False)

            _, pullback = vjp(layer, params)
            return pullback(d.unsqueeze(0))[0]

        grads = vmap(one_example)(layer_input, output_grad)
        out: dict[str, ParameterFactor] = {}
        for name, g in grads.items():
            out[name] = PerExampleFactor(g.detach(), params[name].shape)
        return out
