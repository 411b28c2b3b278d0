"""Gate gradients of ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: the layer replayed step by step.

The fused kernels do not expose what per-example statistics need: every step's gradients of
the gate pre-activations. ``replay`` recomputes the forward pass with PyTorch's documented
equations (same weights, no autograd), keeping each step's activations, then runs
backpropagation through time by hand from the gradients the layer's outputs received:

    RNN:  h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh)                    (act: tanh or relu)
    LSTM: i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of the four chunks of that sum;
          c' = f c + i g;  h' = o tanh(c')  (then h' W_hr^T with ``proj_size``)
    GRU:  r, z = sigmoid(xr + hr), sigmoid(xz + hz);  n = tanh(xn + r hn);
          h' = (1 - z) n + z h, with (xr, xz, xn) = x W_ih^T + b_ih and
          (hr, hz, hn) = h W_hh^T + b_hh in chunks.

Per layer and direction it returns ``delta_ih`` = dL/d(x W_ih^T + b_ih) and ``delta_hh`` =
dL/d(h W_hh^T + b_hh), (B, T, G H) (the same tensor for RNN and LSTM; GRU's new gate scales
the hidden part by r), and for LSTM with projection ``delta_hr`` = dL/dh', (B, T, H_out), with
the tensors they multiply: the layer input x, the previous hidden state and m = o tanh(c').

The last layer's hidden states are the layer's output, which the forward hook kept: there the
gates of all steps come from two large products at once and only LSTM's cell state is
recomputed step by step (elementwise). Earlier layers are recomputed step by step, one
(B, H_out) x (H_out, G H) product per step. The backward costs one such product per step;
everything elementwise that does not depend on the recursion is computed for all steps at once. With
per-example lengths (packed sequences) a step past an example's length leaves its state
unchanged and outputs zero, as the fused kernel does; its gate gradients are zero.

Shapes: B examples, T steps, F input features, H hidden units, H_out = proj_size or H, G gates
(1 RNN, 3 GRU, 4 LSTM), D directions, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Direction", "replay"]


@dataclass
class Direction:
    """One layer and direction: the inputs of its weights' factors and its gate gradients."""

    suffix: str  # parameter name suffix: "_l0", "_l0_reverse", ...
    x: torch.Tensor  # (B, T, F) the layer's input
    h_prev: torch.Tensor  # (B, T, H_out) the hidden state each step started from
    m: torch.Tensor | None  # (B, T, H) o tanh(c'), the projection's input (LSTM proj_size)
    delta_ih: torch.Tensor | None = None  # (B, T, G H)
    delta_hh: torch.Tensor | None = None  # (B, T, G H)
    delta_hr: torch.Tensor | None = None  # (B, T, H_out)


@dataclass
class _Saved:
    """What one direction's backward needs from its forward."""

    direction: Direction
    index: int  # layer * D + direction: its slice of h_0 / h_n
    reverse: bool
    gates: torch.Tensor  # (B, T, G, H) activated gates (RNN: the new state before masking)
    extra: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
    # LSTM: (c before the step, tanh(c')), (B, T, H) each; GRU: hn, (B, T, H)


def replay(
    module: nn.Module,
    x: torch.Tensor,
    h0: torch.Tensor | None,
    c0: torch.Tensor | None,
    lengths: torch.Tensor | None,
    output: torch.Tensor | None,
    grads: list[torch.Tensor | None],
) -> list[Direction]:
    """Every layer and direction of ``module`` with its gate gradients.

    Args:
        module: an ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU``.
        x: (B, T, F) the call's input, batch-first, zeros past each example's length.
        h0, c0: (L D, B, H_out) and (L D, B, H) initial states, or None (zeros).
        lengths: (B,) steps per example, or None (all T).
        output: (B, T, D H_out) the call's output sequence (zeros past each example's length),
            or None when it is not known to hold the values the call returned (then the last
            layer is recomputed step by step as well).
        grads: gradients of [output (B, T, D H_out), h_n (L D, B, H_out), c_n (L D, B, H)]
            (c_n for LSTM only), None where an output got none.
    """
    return _Replay(module, x.dtype, lengths, x.shape[1]).run(x, h0, c0, output, grads)


class _Replay:
    def __init__(
        self, module: nn.Module, dtype: torch.dtype, lengths: torch.Tensor | None, steps: int
    ) -> None:
        self.module = module
        self.mode = module.mode  # "LSTM", "GRU", "RNN_TANH", "RNN_RELU"
        self.dtype = dtype
        self.hidden = module.hidden_size
        self.hidden_out = module.proj_size if module.proj_size > 0 else module.hidden_size
        self.directions = 2 if module.bidirectional else 1
        self.gates = {"LSTM": 4, "GRU": 3}.get(self.mode, 1)
        self.keep: torch.Tensor | None = None  # (B, T, 1) step within the example's length
        if lengths is not None:
            positions = torch.arange(steps, device=lengths.device)
            self.keep = (positions.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(2)

    def _weight(self, name: str) -> torch.Tensor | None:
        w = getattr(self.module, name, None)
        return None if w is None else w.detach().to(self.dtype)

    def run(
        self,
        x: torch.Tensor,
        h0: torch.Tensor | None,
        c0: torch.Tensor | None,
        output: torch.Tensor | None,
        grads: list[torch.Tensor | None],
    ) -> list[Direction]:
        x = x.to(self.dtype)
        output = None if output is None else output.to(self.dtype)
        last = self.module.num_layers - 1
        width = self.hidden_out
        layers: list[list[_Saved]] = []
        for layer in range(last + 1):
            saved, outputs = [], []
            for reverse in range(self.directions):
                index = layer * self.directions + reverse
                init = self._initial(x, index, h0, c0)
                if layer == last and output is not None:
                    known = output[..., reverse * width : (reverse + 1) * width]
                    one = self._forward_known(x, layer, bool(reverse), init, known)
                else:
                    one, out = self._forward(x, layer, bool(reverse), init)
                    outputs.append(out)
                one.index = index
                saved.append(one)
            layers.append(saved)
            if outputs:
                x = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        self._backward(layers, x if output is None else output, grads)
        return [one.direction for saved in layers for one in saved]

    # -- forward -------------------------------------------------------------------------------
    def _initial(
        self, x: torch.Tensor, index: int, h0: torch.Tensor | None, c0: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = x.shape[0]
        h = x.new_zeros(b, self.hidden_out) if h0 is None else h0[index].to(self.dtype)
        c = x.new_zeros(b, self.hidden) if c0 is None else c0[index].to(self.dtype)
        return h, c

    def _input_part(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        """(B, T, G H) x W_ih^T + b_ih of every step (+ b_hh, except GRU: r scales its hn)."""
        w_ih = self._weight(f"weight_ih{suffix}")
        b_ih, b_hh = self._weight(f"bias_ih{suffix}"), self._weight(f"bias_hh{suffix}")
        bias = b_ih
        if b_hh is not None and self.mode != "GRU":
            bias = b_hh if bias is None else bias + b_hh
        flat = x.reshape(-1, x.shape[-1])
        gi = flat @ w_ih.T if bias is None else torch.addmm(bias, flat, w_ih.T)
        return gi.view(*x.shape[:2], -1)

    def _forward_known(
        self,
        x: torch.Tensor,
        layer: int,
        reverse: bool,
        init: tuple[torch.Tensor, torch.Tensor],
        known: torch.Tensor,
    ) -> _Saved:
        """The last layer's forward pass from its known output ``known`` (B, T, H_out): the
        state before each step is the output of the step before it (or the initial state)."""
        suffix = f"_l{layer}" + ("_reverse" if reverse else "")
        w_hh, b_hh = self._weight(f"weight_hh{suffix}"), self._weight(f"bias_hh{suffix}")
        w_hr = self._weight(f"weight_hr{suffix}")
        b, t = x.shape[:2]
        hid = self.hidden
        h_init, c_init = init
        h_prev = torch.empty_like(known)
        first, rest, before = (t - 1, slice(0, t - 1), slice(1, t))
        if not reverse:
            first, rest, before = (0, slice(1, t), slice(0, t - 1))
        h_prev[:, first] = h_init
        h_prev[:, rest] = known[:, before]
        if reverse and self.keep is not None:  # an example's last step starts from h_init
            h_prev[:, rest] = torch.where(self.keep[:, before], known[:, before], h_init[:, None])
        direction = Direction(suffix, x, h_prev, None)
        if self.mode in ("RNN_TANH", "RNN_RELU"):  # the new states are the output itself
            return _Saved(direction, 0, reverse, known.unsqueeze(2), None)
        gi = self._input_part(x, suffix)
        flat_h = h_prev.reshape(b * t, -1)
        if self.mode == "GRU":
            gh = flat_h @ w_hh.T if b_hh is None else torch.addmm(b_hh, flat_h, w_hh.T)
            gates, hn = self._gru_gates(gi, gh.view(b, t, -1))
            return _Saved(direction, 0, reverse, gates, hn)
        pre = torch.addmm(gi.view(b * t, -1), flat_h, w_hh.T).view(b, t, 4, hid)
        gates, extra = self._lstm_gates_and_cells(pre, reverse, c_init)
        if w_hr is not None:
            direction.m = gates[:, :, 3] * extra[1]
        return _Saved(direction, 0, reverse, gates, extra)

    def _gru_gates(self, gi: torch.Tensor, gh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GRU gates (B, T, 3, H) (r, z, n) of every step from the input part ``gi`` and the
        hidden part ``gh`` (B, T, 3 H); also ``hn`` (B, T, H), the hidden part of n."""
        b, t = gi.shape[:2]
        hid = self.hidden
        gates = gi.new_empty(b, t, 3, hid)
        pre = (gi[..., : 2 * hid] + gh[..., : 2 * hid]).view(b, t, 2, hid)
        rz = torch.sigmoid(pre, out=gates[:, :, :2])
        hn = gh[..., 2 * hid :]
        torch.tanh(torch.addcmul(gi[..., 2 * hid :], rz[:, :, 0], hn), out=gates[:, :, 2])
        return gates, hn

    def _lstm_gates_and_cells(
        self, pre: torch.Tensor, reverse: bool, c_init: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """LSTM gates (B, T, 4, H) (i, f, g, o) from their pre-activations, and (c before each
        step, tanh of c after it), both (B, T, H), from the cell recursion."""
        b, t, _, hid = pre.shape
        gates = pre.sigmoid()
        gates[:, :, 2] = pre[:, :, 2].tanh()
        i, f, g, _ = gates.unbind(2)  # o enters only through the output
        # The cell state recursion, time-major so that each step reads and writes contiguous
        # (B, H) blocks: column s holds c before step s (s + 1 when reverse).
        cells = pre.new_empty(t + 1, b, hid)
        columns = cells.unbind(0)
        write_in, forget = _time_major(i * g).unbind(0), _time_major(f).unbind(0)
        keep = None if self.keep is None else _time_major(self.keep).unbind(0)
        columns[t if reverse else 0].copy_(c_init)
        for s in range(t - 1, -1, -1) if reverse else range(t):
            c_old, c_new = (columns[s + 1], columns[s]) if reverse else (columns[s], columns[s + 1])
            torch.addcmul(write_in[s], forget[s], c_old, out=c_new)
            if keep is not None:
                torch.where(keep[s], c_new, c_old, out=c_new)
        cells = _batch_major(cells)
        c_prev, c_new = (cells[:, 1:], cells[:, :-1]) if reverse else (cells[:, :-1], cells[:, 1:])
        return gates, (c_prev, c_new.tanh())  # (tanh c' is wrong past a length: unused there)

    def _forward(
        self, x: torch.Tensor, layer: int, reverse: bool, init: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[_Saved, torch.Tensor]:
        """One direction's forward pass step by step: (what its backward needs, its output
        (B, T, H_out), zeros past each example's length)."""
        suffix = f"_l{layer}" + ("_reverse" if reverse else "")
        w_hh, b_hh = self._weight(f"weight_hh{suffix}"), self._weight(f"bias_hh{suffix}")
        w_hr = self._weight(f"weight_hr{suffix}")
        b, t = x.shape[:2]
        hid, g = self.hidden, self.gates
        gi = self._input_part(x, suffix)
        h, c = init
        h_prev = x.new_empty(b, t, self.hidden_out)
        out = x.new_empty(b, t, self.hidden_out)
        gates = x.new_empty(b, t, g, hid)
        extra = x.new_empty(b, t, 2, hid) if self.mode == "LSTM" else None
        extra = x.new_empty(b, t, hid) if self.mode == "GRU" else extra
        m = x.new_empty(b, t, hid) if w_hr is not None else None
        for s in range(t - 1, -1, -1) if reverse else range(t):
            h_prev[:, s] = h
            c_new = None
            if self.mode == "LSTM":
                pre = torch.addmm(gi[:, s], h, w_hh.T).view(b, 4, hid)
                a = pre.sigmoid()
                a[:, 2] = pre[:, 2].tanh()
                gates[:, s] = a
                extra[:, s, 0] = c
                c_new = torch.addcmul(a[:, 1] * c, a[:, 0], a[:, 2])
                tanh_c = c_new.tanh()
                extra[:, s, 1] = tanh_c
                h_new = a[:, 3] * tanh_c
                if m is not None:
                    m[:, s] = h_new
                    h_new = h_new @ w_hr.T
            elif self.mode == "GRU":
                gh = h @ w_hh.T if b_hh is None else torch.addmm(b_hh, h, w_hh.T)
                rz = (gi[:, s, : 2 * hid] + gh[:, : 2 * hid]).sigmoid()
                n = torch.addcmul(gi[:, s, 2 * hid :], rz[:, :hid], gh[:, 2 * hid :]).tanh()
                gates[:, s, :2] = rz.view(b, 2, hid)
                gates[:, s, 2] = n
                extra[:, s] = gh[:, 2 * hid :]
                h_new = torch.addcmul(n, rz[:, hid:], h - n)
            else:
                pre = torch.addmm(gi[:, s], h, w_hh.T)
                h_new = pre.tanh() if self.mode == "RNN_TANH" else pre.relu()
                gates[:, s, 0] = h_new
            if self.keep is not None:
                keep = self.keep[:, s]
                out[:, s] = h_new * keep
                h_new = torch.where(keep, h_new, h)
                c_new = None if c_new is None else torch.where(keep, c_new, c)
            else:
                out[:, s] = h_new
            h, c = h_new, c_new
        direction = Direction(suffix, x, h_prev, m)
        if self.mode == "LSTM":
            extra = tuple(extra.unbind(2))
        return _Saved(direction, 0, reverse, gates, extra), out

    # -- backward ------------------------------------------------------------------------------
    def _backward(
        self, layers: list[list[_Saved]], output: torch.Tensor, grads: list[torch.Tensor | None]
    ) -> None:
        """Fill every direction's gate gradients, from the last layer down."""
        d_out = grads[0] if grads[0] is not None else output.new_zeros(output.shape)
        d_out = d_out.to(self.dtype)
        h_n = grads[1].to(self.dtype) if grads[1] is not None else None
        c_n = grads[2].to(self.dtype) if len(grads) > 2 and grads[2] is not None else None
        width = self.hidden_out
        for depth in range(len(layers) - 1, -1, -1):
            d_in = None
            for k, saved in enumerate(layers[depth]):
                dh = None if h_n is None else h_n[saved.index]
                dc = None if c_n is None else c_n[saved.index]
                self._direction_backward(saved, d_out[..., k * width : (k + 1) * width], dh, dc)
                if depth > 0:  # the gradient of this layer's input: the layer below's output
                    w_ih = self._weight(f"weight_ih{saved.direction.suffix}")
                    part = saved.direction.delta_ih @ w_ih
                    d_in = part if d_in is None else d_in + part
            d_out = d_in

    def _coefficients(self, saved: _Saved) -> tuple[torch.Tensor, ...]:
        """Per-step factors of the backward that do not depend on the recursion, all steps at
        once, zero where a step is past its example's length."""
        keep = None if self.keep is None else self.keep.unsqueeze(2).to(self.dtype)  # (B,T,1,1)
        a = saved.gates
        if self.mode == "LSTM":
            i, f, g, o = a.unbind(2)
            c_prev, tanh_c = saved.extra
            into_c = o * (1 - tanh_c * tanh_c)  # dc' += dm * into_c
            per_gate = torch.stack(
                (g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g), tanh_c * o * (1 - o)),
                dim=2,
            )  # delta_ifg = dc' * per_gate[:3], delta_o = dm * per_gate[3]
            forget = f
            if keep is not None:
                per_gate = per_gate * keep
                into_c = into_c * keep[:, :, 0]
                forget = torch.where(keep[:, :, 0] > 0, f, 1.0)
            return per_gate, into_c, forget
        if self.mode == "GRU":
            r, z, n = a.unbind(2)
            into_n = (1 - z) * (1 - n * n)
            into_z = (saved.direction.h_prev - n) * z * (1 - z)
            into_r = into_n * saved.extra * r * (1 - r)
            per_ih = torch.stack((into_r, into_z, into_n), dim=2)
            per_hh = torch.stack((into_r, into_z, into_n * r), dim=2)
            through = z  # dh_prev += dh * z
            if keep is not None:
                per_ih, per_hh = per_ih * keep, per_hh * keep
                through = torch.where(keep[:, :, 0] > 0, z, 1.0)
            return per_ih, per_hh, through
        h = a[:, :, 0]
        slope = 1 - h * h if self.mode == "RNN_TANH" else (h > 0).to(self.dtype)
        if keep is not None:
            slope = slope * keep[:, :, 0]
        return (slope,)

    def _direction_backward(
        self,
        saved: _Saved,
        d_out: torch.Tensor,
        dh_final: torch.Tensor | None,
        dc_final: torch.Tensor | None,
    ) -> None:
        """Backpropagation through time for one direction, from its output sequence's gradient
        (B, T, H_out) and its final states' (B, H_out), (B, H).

        Steps are visited last to first (in the direction's own order); per step: the gate
        gradients from dL/dh' (and LSTM's dL/dc'), then dL/dh of the state before the step,
        one (B, G H) x (G H, H_out) product. The loop's tensors are held time-major, (T, B, ...),
        so that every step reads and writes contiguous blocks (views from ``unbind`` up front).
        """
        direction = saved.direction
        b, t = d_out.shape[:2]
        g, hid = self.gates, self.hidden
        steps = list(range(t)) if saved.reverse else list(range(t - 1, -1, -1))
        coefficients = [_time_major(c) for c in self._coefficients(saved)]
        delta = d_out.new_empty(t, b, g, hid)
        keep_d_h = self.mode == "GRU" or direction.m is not None
        d_h = d_out.new_empty(t, b, self.hidden_out) if keep_d_h else None  # dL/dh' per step
        outs = d_out.unbind(1)
        dh = outs[steps[0]] if dh_final is None else outs[steps[0]] + dh_final
        passing = None if self.keep is None else _time_major((~self.keep).to(self.dtype))
        loop = _Loop(
            steps,
            outs,
            delta.view(t, b, g * hid).unbind(0),
            self._weight(f"weight_hh{direction.suffix}"),
            None if d_h is None else d_h.unbind(0),
            None if passing is None else passing.unbind(0),
        )
        if self.mode == "LSTM":
            per_gate, into_c, forget = coefficients
            dc = d_out.new_zeros(b, hid) if dc_final is None else dc_final
            w_hr = self._weight(f"weight_hr{direction.suffix}")
            loop.lstm(dh, dc, per_gate, into_c, forget, delta, w_hr)
        elif self.mode == "GRU":
            loop.gru(dh, coefficients[1], coefficients[2], delta)
        else:
            loop.rnn(dh, coefficients[0], delta)
        delta = _batch_major(delta.view(t, b, g * hid))
        if self.mode == "GRU":
            direction.delta_hh = delta
            per_ih = (d_h.unsqueeze(2) * coefficients[0]).view(t, b, g * hid)
            direction.delta_ih = _batch_major(per_ih)
        else:
            direction.delta_ih = direction.delta_hh = delta
        if direction.m is not None:
            d_h = _batch_major(d_h)
            direction.delta_hr = d_h if self.keep is None else d_h * self.keep


def _time_major(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> contiguous (T, B, ...)."""
    return x.transpose(0, 1).contiguous()


def _batch_major(x: torch.Tensor) -> torch.Tensor:
    """(T, B, ...) -> contiguous (B, T, ...)."""
    return x.transpose(0, 1).contiguous()


@dataclass
class _Loop:
    """The sequential part of one direction's backward, one tight loop per cell type.

    ``steps``: the steps, last processed first; ``outs``: (B, H_out) output gradients per
    step; ``flat``: (B, G H) views of the gate gradients being filled; ``stored``: where to keep
    dL/dh' of every step (None: not needed); ``passing``: (B, 1) 1 past an example's length.
    The loops take time-major (T, B, ...) coefficient and gradient tensors.
    """

    steps: list[int]
    outs: tuple[torch.Tensor, ...]
    flat: tuple[torch.Tensor, ...]
    w_hh: torch.Tensor
    stored: tuple[torch.Tensor, ...] | None
    passing: tuple[torch.Tensor, ...] | None

    def _previous(self, k: int, s: int, dh: torch.Tensor) -> torch.Tensor:
        """dL/dh of the state step s started from: its output gradient and the recursion."""
        following = torch.addmm(self.outs[self.steps[k + 1]], self.flat[s], self.w_hh)
        if self.passing is not None:  # past an example's length the state passes on
            following.addcmul_(dh, self.passing[s])
        return following

    def lstm(
        self,
        dh: torch.Tensor,
        dc: torch.Tensor,
        per_gate: torch.Tensor,
        into_c: torch.Tensor,
        forget: torch.Tensor,
        delta: torch.Tensor,
        w_hr: torch.Tensor | None,
    ) -> None:
        ifg, o_gate = per_gate[:, :, :3].unbind(0), per_gate[:, :, 3].unbind(0)
        into, keep_c = into_c.unbind(0), forget.unbind(0)
        d_ifg, d_o = delta[:, :, :3].unbind(0), delta[:, :, 3].unbind(0)
        last = len(self.steps) - 1
        for k, s in enumerate(self.steps):
            if self.stored is not None:
                self.stored[s].copy_(dh)
            dm = dh if w_hr is None else dh @ w_hr
            dc = torch.addcmul(dc, dm, into[s])
            torch.mul(dc.unsqueeze(1), ifg[s], out=d_ifg[s])
            torch.mul(dm, o_gate[s], out=d_o[s])
            if k == last:
                return
            dc = dc * keep_c[s]
            dh = self._previous(k, s, dh)

    def gru(
        self, dh: torch.Tensor, per_hh: torch.Tensor, through: torch.Tensor, delta: torch.Tensor
    ) -> None:
        hidden_part, direct, deltas = per_hh.unbind(0), through.unbind(0), delta.unbind(0)
        last = len(self.steps) - 1
        for k, s in enumerate(self.steps):
            self.stored[s].copy_(dh)
            torch.mul(dh.unsqueeze(1), hidden_part[s], out=deltas[s])
            if k == last:
                return
            following = torch.addmm(self.outs[self.steps[k + 1]], self.flat[s], self.w_hh)
            dh = following.addcmul_(dh, direct[s])  # h' = n + z (h - n): dh z passes on

    def rnn(self, dh: torch.Tensor, slope: torch.Tensor, delta: torch.Tensor) -> None:
        slopes, deltas = slope.unbind(0), delta[:, :, 0].unbind(0)
        last = len(self.steps) - 1
        for k, s in enumerate(self.steps):
            torch.mul(dh, slopes[s], out=deltas[s])
            if k == last:
                return
            dh = self._previous(k, s, dh)
