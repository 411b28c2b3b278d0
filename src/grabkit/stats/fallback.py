"""Fallback for layers without a specific rule: their per-example gradients by torch.func.

For a layer f with its own parameters theta, example i's gradient is the vector-Jacobian
product of f(theta, inputs_i) with D_i, the gradient of example i's output; ``torch.func.vmap``
of ``torch.func.vjp`` gives all B at once from the call's inputs and output gradient the hooks
kept. The result is materialised, (B, *shape) per parameter, for this layer only, so the fallback
suits small layers (a learned gain, a PReLU, an attention block's projections) rather than
embedding tables.

The layer may take several inputs (positional or keyword): a tensor whose dim 0 has B entries
is split by example, any other is passed whole to every example (an attention mask (T, S)).
Where a second input's dim 0 has B entries and B also appears among its other dims, which it
is cannot be told, and a ``ValueError`` says so. A tuple output counts by its first element.
Requirements: no coupling across the batch and no randomness in training mode (Dropout with
p > 0 draws masks the replay cannot reproduce; a ``ValueError`` names it), and the parameters
are the layer's own (``recurse=False``; child layers are tracked by their own rules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from grabkit.stats.factors import ParameterFactor, PerExampleFactor
from grabkit.stats.rules import LayerRule, register_rule

__all__ = ["TorchFuncFallbackRule"]


def _random_in_training(module: nn.Module) -> bool:
    """Whether the layer's own forward draws random numbers (dropout with p > 0) right now."""
    if not module.training:
        return False
    own_dropout = getattr(module, "dropout", 0.0)
    if isinstance(own_dropout, float) and own_dropout > 0:
        return True
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


class TorchFuncFallbackRule(LayerRule):
    """Per-example gradients of a layer's own parameters by ``vmap(vjp(...))``."""

    whole_call = True

    def __init__(self, covers_children: bool = False) -> None:
        # True for a layer that uses its children's parameters functionally (MultiheadAttention
        # reads out_proj.weight without calling out_proj): they are replayed here too.
        self.covers_children = covers_children

    def capture(self, module: nn.Module, layer_input: Any) -> object:
        if _random_in_training(module):
            raise ValueError(
                f"{type(module).__name__} draws dropout masks in training mode, which the "
                f"per-example replay (torch.func) cannot reproduce, so its statistics would be "
                f"wrong. Set its dropout to 0, call it in eval mode, or freeze its parameters."
            )
        return layer_input

    def factors(
        self,
        module: nn.Module,
        layer_input: tuple[tuple[Any, ...], dict[str, Any]],
        output_grad: torch.Tensor,
        wanted: Any,
    ) -> dict[str, ParameterFactor]:
        args, kwargs = layer_input
        b = output_grad.shape[0]
        names = [*range(len(args)), *kwargs]
        values = [*args, *kwargs.values()]
        split = [
            self._is_batched(module, name, v, b, first=k == 0)
            for k, (name, v) in enumerate(zip(names, values, strict=True))
        ]
        batched = [v for v, s in zip(values, split, strict=True) if s]
        params = {
            name: p.detach()
            for name, p in module.named_parameters(recurse=self.covers_children)
            if name in wanted
        }

        def one_example(d: torch.Tensor, *rows: torch.Tensor) -> dict[str, torch.Tensor]:
            it = iter(rows)
            full = [next(it).unsqueeze(0) if s else v for v, s in zip(values, split, strict=True)]
            call_args = tuple(full[: len(args)])
            call_kwargs = dict(zip(kwargs, full[len(args) :], strict=True))

            def layer(p: dict[str, torch.Tensor]) -> torch.Tensor:
                out = functional_call(module, p, call_args, call_kwargs, strict=False)
                return out[0] if isinstance(out, tuple) else out

            _, pullback = vjp(layer, params)
            return pullback(d.unsqueeze(0))[0]

        try:
            grads = vmap(one_example)(output_grad, *batched)
        except RuntimeError as error:  # e.g. nn.LSTM: its fused kernels have no vmap rule
            raise NotImplementedError(
                f"PerSampleStats has no rule for {type(module).__name__} and the torch.func "
                f"fallback cannot replay it per example ({error}). Freeze its parameters, or "
                f"register a rule with grabkit.stats.register_rule."
            ) from error
        return {name: PerExampleFactor(g.detach(), params[name].shape) for name, g in grads.items()}

    @staticmethod
    def _is_batched(module: nn.Module, name: object, value: object, b: int, first: bool) -> bool:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != b:
            return False
        if not first and b in value.shape[1:]:
            raise ValueError(
                f"{type(module).__name__}: input {name!r} of shape {tuple(value.shape)} has the "
                f"batch size {b} in dim 0 and in another dim, so whether it holds one entry per "
                f"example cannot be told. Use a batch size that differs from its other dims."
            )
        return True


class AttentionRule(TorchFuncFallbackRule):
    """``nn.MultiheadAttention``: its projection weights are used functionally (no Linear call
    to hook), so its per-example gradients, out_proj's included, come from the replay: exact
    with any masks, ``is_causal`` and ``need_weights``, for batch-first inputs."""

    def __init__(self) -> None:
        super().__init__(covers_children=True)

    def check(self, module: nn.Module) -> None:
        if not module.batch_first:
            raise ValueError(
                "nn.MultiheadAttention(batch_first=False) takes (T, B, E) inputs, but "
                "PerSampleStats needs the examples in dim 0 of every layer's input. Construct "
                "it (and nn.TransformerEncoderLayer / DecoderLayer / nn.Transformer) with "
                "batch_first=True."
            )


register_rule(nn.MultiheadAttention, AttentionRule())
