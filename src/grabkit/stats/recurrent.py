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

The fused kernels do not expose the gate gradients, so the forward hook keeps the call's input
and initial state (references), the engine hooks the gradients of the output sequence and of the
final states (h_n, and c_n for LSTM), and on the first read the layer is replayed step by step
with plain torch ops (PyTorch's documented gate equations, same weights) under autograd, with
zero "probe" tensors added to the gate pre-activations: the gradients of the probes, for the
output gradients the hooks received, are the gate gradients of every step, layer and direction.
The replay costs about one more forward and backward of the layer, on read only.

Supported: ``batch_first`` True and False (the examples are dim 1 of a sequence-first input),
several layers, bidirectional, ``bias=False``, LSTM ``proj_size``, an initial state ``hx``, and
``PackedSequence`` inputs (each example's own length; later steps contribute nothing, as in the
fused kernel). Refused with a ``ValueError``: inputs without a batch dim (2-D), and dropout
between layers in training mode (its masks are drawn inside the fused kernel and cannot be
replayed).
"""

from __future__ import annotations

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
    h0: (L D, B, H_out) initial hidden state or None (zeros). c0: (L D, B, H) LSTM cell state.
    lengths: (B,) steps per example for packed input, else None.
    packed: the PackedSequence layout of the call, else None.
    """

    x: torch.Tensor
    h0: torch.Tensor | None
    c0: torch.Tensor | None
    lengths: torch.Tensor | None
    packed: _PackedLayout | None


class _Direction(NamedTuple):
    """One layer and direction of the replay: its probes and the inputs of its factors."""

    suffix: str  # "_l0", "_l0_reverse", ...
    x: torch.Tensor  # (B, T, F) this layer's input
    h_prev: torch.Tensor  # (B, T, H_out) hidden state before each step
    m: torch.Tensor | None  # (B, T, H) o * tanh(c), the projection's input (LSTM proj_size)
    probe_ih: torch.Tensor  # (B, T, G H) added to x W_ih^T + b_ih
    probe_hh: torch.Tensor | None  # (B, T, G H) added to h W_hh^T + b_hh (GRU only)
    probe_hr: torch.Tensor | None  # (B, T, H_out) added to m W_hr^T (LSTM proj_size)


def _is_lstm(module: nn.Module) -> bool:
    return module.mode == "LSTM"


@rule_for(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(LayerRule):
    """``nn.RNN`` (tanh / relu), ``nn.LSTM`` and ``nn.GRU``: gate gradients by replay."""

    multiple_outputs = True

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
        args, kwargs = layer_input
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
        h0 = None if h0 is None else h0.detach()
        c0 = None if c0 is None else c0.detach()
        if isinstance(x, PackedSequence):
            layout = _PackedLayout(x.batch_sizes, x.sorted_indices, x.unsorted_indices)
            padded, lengths = pad_packed_sequence(_detached(x), batch_first=True)
            return _RecurrentCall(padded, h0, c0, lengths.to(padded.device), layout)
        x = x.detach()
        return _RecurrentCall(x if module.batch_first else x.transpose(0, 1), h0, c0, None, None)

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
        with torch.enable_grad():
            directions, outputs = _Replay(module, call, dtype).run()
            pairs = [(o, g.to(dtype)) for o, g in zip(outputs, grads, strict=True) if g is not None]
            probes = [
                p for d in directions for p in (d.probe_ih, d.probe_hh, d.probe_hr) if p is not None
            ]
            found = torch.autograd.grad(
                [o for o, _ in pairs], probes, [g for _, g in pairs], allow_unused=True
            )
        gradient = {
            id(p): torch.zeros_like(p) if g is None else g
            for p, g in zip(probes, found, strict=True)
        }
        out: dict[str, ParameterFactor] = {}
        for d in directions:
            d_ih = gradient[id(d.probe_ih)]
            d_hh = d_ih if d.probe_hh is None else gradient[id(d.probe_hh)]
            self._add(out, wanted, module, f"weight_ih{d.suffix}", d.x, d_ih)
            self._add(out, wanted, module, f"weight_hh{d.suffix}", d.h_prev, d_hh)
            for name, delta in ((f"bias_ih{d.suffix}", d_ih), (f"bias_hh{d.suffix}", d_hh)):
                if name in wanted:
                    out[name] = PerExampleFactor(delta.sum(dim=1), getattr(module, name).shape)
            if d.probe_hr is not None:
                d_hr = gradient[id(d.probe_hr)]
                self._add(out, wanted, module, f"weight_hr{d.suffix}", d.m, d_hr)
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


def _detached(x: PackedSequence) -> PackedSequence:
    return PackedSequence(x.data.detach(), x.batch_sizes, x.sorted_indices, x.unsorted_indices)


class _Replay:
    """The layer unrolled step by step in plain torch ops, PyTorch's gate equations:

    RNN:  h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh)
    LSTM: i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of the chunks of the sum above;
          c' = f c + i g; h' = o tanh(c') (then h' W_hr^T with proj_size)
    GRU:  r, z = sigmoid of the sums of the first two chunks; n = tanh(xn + r hn);
          h' = (1 - z) n + z h, with (xr, xz, xn) and (hr, hz, hn) the input and hidden chunks.

    With per-example lengths, a step past an example's length leaves its state unchanged and
    outputs zero (the fused kernel's packed-sequence semantics).
    """

    def __init__(self, module: nn.Module, call: _RecurrentCall, dtype: torch.dtype) -> None:
        self.module = module
        self.call = call
        self.dtype = dtype
        t = call.x.shape[1]
        self.mask = None
        if call.lengths is not None:
            steps = torch.arange(t, device=call.x.device)
            self.mask = (steps.unsqueeze(0) < call.lengths.unsqueeze(1)).unsqueeze(2)  # (B, T, 1)
        self.directions_per_layer = 2 if module.bidirectional else 1
        self.hidden_out = module.proj_size if module.proj_size > 0 else module.hidden_size

    def _weight(self, name: str) -> torch.Tensor | None:
        w = getattr(self.module, name, None)
        return None if w is None else w.detach().to(self.dtype)

    def _initial(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.call.x.shape[0]
        h0, c0 = self.call.h0, self.call.c0
        like = self.call.x
        h = (
            like.new_zeros(b, self.hidden_out, dtype=self.dtype)
            if h0 is None
            else h0[index].to(self.dtype)
        )
        if not _is_lstm(self.module):
            return h, None
        c = (
            like.new_zeros(b, self.module.hidden_size, dtype=self.dtype)
            if c0 is None
            else c0[index].to(self.dtype)
        )
        return h, c

    def run(self) -> tuple[list[_Direction], list[torch.Tensor]]:
        """(every layer and direction, the replayed [output (B, T, D H_out), h_n, (c_n)])."""
        x = self.call.x.to(self.dtype)
        directions: list[_Direction] = []
        finals_h, finals_c = [], []
        for layer in range(self.module.num_layers):
            outputs = []
            for reverse in range(self.directions_per_layer):
                index = layer * self.directions_per_layer + reverse
                suffix = f"_l{layer}" + ("_reverse" if reverse else "")
                direction, output, h, c = self._direction(x, suffix, index, bool(reverse))
                directions.append(direction)
                outputs.append(output)
                finals_h.append(h)
                finals_c.append(c)
            x = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        replayed = [x, torch.stack(finals_h)]
        if _is_lstm(self.module):
            replayed.append(torch.stack(finals_c))
        return directions, replayed

    def _direction(
        self, x: torch.Tensor, suffix: str, index: int, reverse: bool
    ) -> tuple[_Direction, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        module, mode, mask = self.module, self.module.mode, self.mask
        w_ih, w_hh = self._weight(f"weight_ih{suffix}"), self._weight(f"weight_hh{suffix}")
        b_ih, b_hh = self._weight(f"bias_ih{suffix}"), self._weight(f"bias_hh{suffix}")
        w_hr = self._weight(f"weight_hr{suffix}")
        b, t = x.shape[:2]
        gi = x @ w_ih.T
        if b_ih is not None:
            gi = gi + b_ih
        probe_ih = torch.zeros_like(gi, requires_grad=True)
        gi = gi + probe_ih
        probe_hh = torch.zeros_like(gi, requires_grad=True) if mode == "GRU" else None
        probe_hr = (
            x.new_zeros(b, t, self.hidden_out, requires_grad=True) if w_hr is not None else None
        )
        h, c = self._initial(index)
        h_prev: list[torch.Tensor] = [h] * t
        m_seq: list[torch.Tensor] = [h] * t
        out: list[torch.Tensor] = [h] * t
        for s in range(t - 1, -1, -1) if reverse else range(t):
            h_prev[s] = h
            gh = h @ w_hh.T
            if b_hh is not None:
                gh = gh + b_hh
            if probe_hh is not None:
                gh = gh + probe_hh[:, s]
            c_new = None
            if mode == "LSTM":
                i, f, g, o = (gi[:, s] + gh).chunk(4, dim=1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                if w_hr is not None:
                    m_seq[s] = h_new
                    h_new = h_new @ w_hr.T + probe_hr[:, s]
            elif mode == "GRU":
                xr, xz, xn = gi[:, s].chunk(3, dim=1)
                hr, hz, hn = gh.chunk(3, dim=1)
                r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
                n = torch.tanh(xn + r * hn)
                h_new = (1 - z) * n + z * h
            elif mode == "RNN_TANH":
                h_new = torch.tanh(gi[:, s] + gh)
            elif mode == "RNN_RELU":
                h_new = torch.relu(gi[:, s] + gh)
            else:
                raise ValueError(f"{type(module).__name__}: unknown recurrent mode {mode!r}")
            if mask is not None:
                keep = mask[:, s]
                h_new = torch.where(keep, h_new, h)
                if c_new is not None:
                    c_new = torch.where(keep, c_new, c)
                out[s] = torch.where(keep, h_new, torch.zeros_like(h_new))
            else:
                out[s] = h_new
            h, c = h_new, c_new
        direction = _Direction(
            suffix,
            x.detach(),
            torch.stack(h_prev, dim=1).detach(),
            torch.stack(m_seq, dim=1).detach() if w_hr is not None else None,
            probe_ih,
            probe_hh,
            probe_hr,
        )
        return direction, torch.stack(out, dim=1), h, c
