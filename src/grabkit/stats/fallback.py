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
    reads_parameters = True  # the replay runs on the layer's parameters

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
        views = [
            self.batched_view(module, name, v, b, first=k == 0)
            for k, (name, v) in enumerate(zip(names, values, strict=True))
        ]
        split = [view is not None for view in views]
        batched = [view for view in views if view is not None]
        params = {
            name: p.detach()
            for name, p in module.named_parameters(recurse=self.covers_children)
            if name in wanted
        }

        def one_example(d: torch.Tensor, *rows: torch.Tensor) -> dict[str, torch.Tensor]:
            it = iter(rows)
            full = [
                self.example_input(module, name, next(it)) if s else v
                for name, v, s in zip(names, values, split, strict=True)
            ]
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

    def batched_view(
        self, module: nn.Module, name: object, value: object, b: int, first: bool
    ) -> torch.Tensor | None:
        """The input ``name`` (a position or a keyword) as (B, ...) rows, one per example, to
        split by example; None for an input passed whole to every example."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != b:
            return None
        if not first and b in value.shape[1:]:
            raise ValueError(
                f"{type(module).__name__}: input {name!r} of shape {tuple(value.shape)} has the "
                f"batch size {b} in dim 0 and in another dim, so whether it holds one entry per "
                f"example cannot be told. Use a batch size that differs from its other dims."
            )
        return value

    def example_input(self, module: nn.Module, name: object, row: torch.Tensor) -> torch.Tensor:
        """One example's input ``name`` from its row of ``batched_view``: a batch of one."""
        return row.unsqueeze(0)


class AttentionRule(TorchFuncFallbackRule):
    """``nn.MultiheadAttention``: its projection weights are used functionally (no Linear call
    to hook), so its per-example gradients, out_proj's included, come from the replay: exact
    with any masks, ``is_causal`` and ``need_weights``, for batch-first inputs.

    The layer's signature says where each input holds the examples, so no input is guessed:
    query, key, value and ``key_padding_mask`` in dim 0 (whatever their other sizes), a 2-D
    ``attn_mask`` is shared by the batch, and a 3-D one, (B * num_heads, T, S), holds example
    i's heads in rows i * num_heads to (i + 1) * num_heads - 1.
    """

    _POSITIONS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    _BATCH_FIRST = frozenset({"query", "key", "value", "key_padding_mask"})

    def __init__(self) -> None:
        super().__init__(covers_children=True)

    def _argument(self, name: object) -> object:
        if isinstance(name, int) and name < len(self._POSITIONS):
            return self._POSITIONS[name]
        return name

    def batched_view(
        self, module: nn.Module, name: object, value: object, b: int, first: bool
    ) -> torch.Tensor | None:
        argument = self._argument(name)
        if not isinstance(value, torch.Tensor):
            return None
        if argument in self._BATCH_FIRST:
            return value if value.dim() > 0 and value.shape[0] == b else None
        if argument == "attn_mask" and value.dim() == 2:
            return None  # (T, S): the same mask for every example
        if argument == "attn_mask" and value.dim() == 3:  # (B * heads, T, S): the layer checked
            return value.reshape(b, module.num_heads, *value.shape[1:])
        return super().batched_view(module, name, value, b, first)

    def example_input(self, module: nn.Module, name: object, row: torch.Tensor) -> torch.Tensor:
        if self._argument(name) == "attn_mask":
            return row  # (num_heads, T, S): the 3-D mask of a batch of one
        return super().example_input(module, name, row)

    def replace_output(self, module: nn.Module, output: Any) -> Any:
        """A batch-first output that the kernel returned as a transposed view (the CPU's), with
        B equal to another of its dims, becomes a contiguous copy: the layer knows dim 0 holds
        the examples, the layers after it could not tell it from the equal dim."""
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.is_contiguous():
            return None
        if out.shape[0] not in out.shape[1:]:
            return None  # unambiguous: later layers find the batch dim by its size
        copy = out.contiguous()
        return (copy, *output[1:]) if isinstance(output, tuple) else copy

    def check(self, module: nn.Module) -> None:
        if not module.batch_first:
            raise ValueError(
                "nn.MultiheadAttention(batch_first=False) takes (T, B, E) inputs, but "
                "PerSampleStats needs the examples in dim 0 of every layer's input. Construct "
                "it (and nn.TransformerEncoderLayer / DecoderLayer / nn.Transformer) with "
                "batch_first=True."
            )


register_rule(nn.MultiheadAttention, AttentionRule())
