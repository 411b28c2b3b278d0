"""Exact per-example statistics of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``.

A recurrent weight is used at every step, so example i's gradient is a sum over its steps:
``W_ih``: sum_t Dih[i, t] x[i, t]^T, ``W_hh``: sum_t Dhh[i, t] h[i, t-1]^T, the biases
sum_t Dih[i, t] and sum_t Dhh[i, t], where Dih / Dhh are the gradients of the gate
pre-activations' input part ``x W_ih^T + b_ih`` and hidden part ``h W_hh^T + b_hh`` (equal for
RNN and LSTM; GRU's new gate multiplies the hidden part by its reset gate, so they differ there).
LSTM's projection ``W_hr`` (``proj_size > 0``): sum_t Dhr[i, t] m[i, t]^T with m = o * tanh(c)
and Dhr the gradient of the projected state. These are the outer-product factors of a Linear
layer over T positions (``grabkit.stats.factors.OuterProductFactor``), so norms, Gram matrices,
dots, weighted sums and tied-parameter cross terms work unchanged.

The fused kernels do not expose the gate gradients, so the forward hook keeps the call's input,
initial state and output sequence (references; an output changed in place afterwards, say by an
in-place activation, is detected by its version counter and not used), the engine hooks the
gradients of the output sequence and of the final states (h_n, and c_n for LSTM), and on the
first read the layer is replayed with PyTorch's documented gate equations and the same
weights, followed by backpropagation through time by hand (``grabkit.stats.recurrent_replay``):
the gate gradients of every step, layer and direction. This costs about one more forward and
backward of the layer, on read only. A batch-first output sequence is handed on as a contiguous
tensor (the CPU kernel returns a transposed view), so that later layers can tell its batch dim
when B == T.

Supported: ``batch_first`` True and False (the examples are dim 1 of a sequence-first input),
several layers, bidirectional, ``bias=False``, LSTM ``proj_size``, an initial state ``hx``, and
``PackedSequence`` inputs (each example's own length; later steps contribute nothing, as in the
fused kernel). Refused with a ``ValueError``: inputs without a batch dim (2-D), and dropout
between layers in training mode (its masks are drawn inside the fused kernel and cannot be
replayed).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from grabkit.stats.factors import (
    OuterProductFactor,
    ParameterFactor,
    PerExampleFactor,
    compute_dtype,
)
from grabkit.stats.recurrent_replay import replay
from grabkit.stats.rules import LayerRule, rule_for

__all__ = ["RecurrentRule"]


class _PackedLayout(NamedTuple):
    """What is needed to turn a PackedSequence's data (and its gradient) into padded form."""

    batch_sizes: torch.Tensor
    sorted_indices: torch.Tensor | None
    unsorted_indices: torch.Tensor | None


class _RecurrentCall(NamedTuple):
    """One call of a recurrent layer, batch-first.

    x: (B, T, F) input, zeros past each example's length for packed input.
    output: (B, T, D H_out) the output sequence, likewise.
    output_version: the output's version counter at the call, None for a copy made then (a
        changed counter means it was modified in place afterwards: its values are not used).
    h0: (L D, B, H_out) initial hidden state or None (zeros). c0: (L D, B, H) LSTM cell state.
        Both copied at the call.
    lengths: (B,) steps per example for packed input, else None.
    packed: the PackedSequence layout of the call, else None.
    """

    x: torch.Tensor
    output: torch.Tensor
    output_version: int | None
    h0: torch.Tensor | None
    c0: torch.Tensor | None
    lengths: torch.Tensor | None
    packed: _PackedLayout | None


def _is_lstm(module: nn.Module) -> bool:
    return module.mode == "LSTM"


@rule_for(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(LayerRule):
    """``nn.RNN`` (tanh / relu), ``nn.LSTM`` and ``nn.GRU``: gate gradients by replay."""

    multiple_outputs = True
    reads_parameters = True  # the replay runs on the weights

    def output_tensors(self, module: nn.Module, output: Any) -> tuple[torch.Tensor | None, ...]:
        sequence, state = output
        data = sequence.data if isinstance(sequence, PackedSequence) else sequence
        if _is_lstm(module):
            return data, state[0], state[1]
        return data, state

    def replace_output(self, module: nn.Module, output: Any) -> Any:
        """A batch-first output sequence that is a transposed view (the CPU kernel's) becomes a
        contiguous copy, so that layers after it see the batch as the outermost dim even when
        B equals T."""
        sequence, state = output
        if isinstance(sequence, PackedSequence) or not module.batch_first:
            return None
        if sequence.is_contiguous():
            return None
        return sequence.contiguous(), state

    def call_batch(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, int, int]:
        x = self._input(args, kwargs)
        if isinstance(x, PackedSequence):
            return None, 0, int(x.batch_sizes[0])
        if x.dim() != 3:
            raise ValueError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)} without a batch "
                f"dimension; per-example statistics need batched inputs ((B, T, F) with "
                f"batch_first=True, (T, B, F) without)."
            )
        dim = 0 if module.batch_first else 1
        return x, dim, x.shape[dim]

    @staticmethod
    def _input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[0] if args else kwargs["input"]

    def capture(self, module: nn.Module, layer_input: Any) -> _RecurrentCall:
        args, kwargs, output = layer_input
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise ValueError(
                f"{type(module).__name__}(num_layers={module.num_layers}, "
                f"dropout={module.dropout}) applies dropout between its layers inside the fused "
                f"kernel in training mode; those masks cannot be replayed, so its per-example "
                f"statistics would be wrong. Set dropout=0, or stack single-layer "
                f"{type(module).__name__}s with nn.Dropout between them (exact), or call it in "
                f"eval mode."
            )
        x = self._input(args, kwargs)
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        h0, c0 = (hx if _is_lstm(module) else (hx, None)) if hx is not None else (None, None)
        # copies (small): a state buffer updated in place after the call must not change them
        h0 = None if h0 is None else h0.detach().clone()
        c0 = None if c0 is None else c0.detach().clone()
        sequence = output[0]
        if isinstance(x, PackedSequence):
            layout = _PackedLayout(x.batch_sizes, x.sorted_indices, x.unsorted_indices)
            padded, lengths = pad_packed_sequence(_detached(x), batch_first=True)
            out, _ = pad_packed_sequence(_detached(sequence), batch_first=True)
            return _RecurrentCall(padded, out, None, h0, c0, lengths.to(padded.device), layout)
        x, sequence = x.detach(), sequence.detach()
        if not module.batch_first:
            x, sequence = x.transpose(0, 1), sequence.transpose(0, 1)
        return _RecurrentCall(x, sequence, sequence._version, h0, c0, None, None)

    def factors(
        self,
        module: nn.Module,
        layer_input: _RecurrentCall,
        output_grad: tuple[torch.Tensor | None, ...],
        wanted: Collection[str],
    ) -> dict[str, ParameterFactor]:
        call = layer_input
        grads = self._batch_first_grads(module, call, output_grad)
        dtype = compute_dtype(torch.promote_types(call.x.dtype, module.weight_ih_l0.dtype))
        x = call.x.to(dtype)
        output = call.output
        if call.output_version is not None and output._version != call.output_version:
            output = None  # changed in place after the call: recompute the last layer too
        with torch.no_grad():
            directions = replay(module, x, call.h0, call.c0, call.lengths, output, grads)
        out: dict[str, ParameterFactor] = {}
        for d in directions:
            self._add(out, wanted, module, f"weight_ih{d.suffix}", d.x, d.delta_ih)
            self._add(out, wanted, module, f"weight_hh{d.suffix}", d.h_prev, d.delta_hh)
            summed: dict[int, torch.Tensor] = {}  # LSTM and RNN share one delta for both biases
            for name, delta in (
                (f"bias_ih{d.suffix}", d.delta_ih),
                (f"bias_hh{d.suffix}", d.delta_hh),
            ):
                if name in wanted:
                    if id(delta) not in summed:
                        summed[id(delta)] = delta.sum(dim=1)
                    out[name] = PerExampleFactor(
                        summed[id(delta)],
                        getattr(module, name).shape,
                        positions=delta.shape[1],
                        terms=functools.partial(_term_norms, delta),
                    )
            if d.delta_hr is not None:
                self._add(out, wanted, module, f"weight_hr{d.suffix}", d.m, d.delta_hr)
        return out

    @staticmethod
    def _add(
        out: dict[str, ParameterFactor],
        wanted: Collection[str],
        module: nn.Module,
        name: str,
        inputs: torch.Tensor,
        grads: torch.Tensor,
    ) -> None:
        """W's factor sum_t grads[i, t] inputs[i, t]^T, (B, T, q) and (B, T, p)."""
        if name in wanted:
            shape = getattr(module, name).shape
            out[name] = OuterProductFactor(inputs.unsqueeze(2), grads.unsqueeze(2), shape)

    @staticmethod
    def _batch_first_grads(
        module: nn.Module, call: _RecurrentCall, grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """The output sequence's gradient as (B, T, D H_out) (zeros past each example's
        length), the final states' as (L D, B, H) (their batch dim is 1 in every layout)."""
        sequence, *states = grads
        if sequence is not None:
            if call.packed is not None:
                packed = PackedSequence(sequence, *call.packed)
                sequence, _ = pad_packed_sequence(
                    packed, batch_first=True, total_length=call.x.shape[1]
                )
            elif not module.batch_first:
                sequence = sequence.transpose(0, 1)
        return [sequence, *states]


def _term_norms(delta: torch.Tensor) -> torch.Tensor:
    """The sum over (example, step) of the 2-norms of a bias's per-step gradients (B, T, n)."""
    return torch.linalg.vector_norm(delta, dim=2).sum()


def _detached(x: PackedSequence) -> PackedSequence:
    return PackedSequence(x.data.detach(), x.batch_sizes, x.sorted_indices, x.unsorted_indices)
