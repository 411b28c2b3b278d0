"""The accumulated gradient, kept in buffers of its own, away from ``.grad``.

After each microbatch the wrapper folds ``count * p.grad`` into a per-parameter running sum and
sets ``p.grad`` back to ``None``. So ``.grad`` only ever holds the one microbatch not yet folded:
a user's ``zero_grad()``, a GradScaler's in-place unscaling or DDP's bucket views cannot touch
the accumulation, and the next backward writes a fresh gradient instead of adding into an old one.
A ``.grad`` tensor is only ever read: the sums live in buffers the accumulator owns (kept from
window to window, so no page faults), and a reference to a microbatch's gradient that the user
kept still holds that gradient. When the wrapper steps, the exact weighted mean
``sum_i c_i g_i / sum_i c_i`` is written back into ``.grad`` (the buffer itself) for the inner
optimizer.

Sharded (``fully_shard``) gradients are ``DTensor``\\ s: the sums hold each rank's local shard,
the squared norm is the local shard's (the wrapper sums it over ranks), and the mean goes back
into ``.grad`` as a ``DTensor`` laid out like the parameter.

Sums are float32 for float16/bfloat16 gradients (so that many small additions do not round
away) and the gradient's own dtype otherwise.
"""

from __future__ import annotations

import torch

from grabkit.sharding import dtensor_like, local
from grabkit.stats.source import note_gradients_taken

__all__ = ["GradientAccumulator", "parameter_squares", "squared_norm"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def parameter_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n,) float64: the sum of squares of each tensor's entries (one fused pass, no host sync;
    on the first tensor's device)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch._foreach_norm(tensors)
    if len({n.device for n in norms}) > 1:
        norms = [n.to(norms[0].device) for n in norms]
    return torch.stack(norms).to(torch.float64).square()


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all entries of ``tensors`` as a 0-dim float64 tensor (no host sync)."""
    return parameter_squares(tensors).sum()


def _sum_dtype(grad: torch.Tensor) -> torch.dtype:
    return torch.float32 if grad.dtype in _LOW_PRECISION else grad.dtype


class GradientAccumulator:
    """Running sums ``S_p = sum_i c_i g_{i,p}`` for the parameters that received a gradient."""

    def __init__(self) -> None:
        self._sums: dict[torch.Tensor, torch.Tensor] = {}  # this window's sums
        # storage kept across windows for gradients that cannot be taken over (views, low
        # precision): a fresh multi-megabyte tensor per window costs page faults
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}

    def _start_sum(self, p: torch.Tensor, g: torch.Tensor, weight: float | torch.Tensor) -> None:
        g = local(g)
        dtype = _sum_dtype(g)
        buffer = self._buffers.get(p)
        if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != (
            g.shape,
            dtype,
            g.device,
        ):
            buffer = torch.empty(g.shape, dtype=dtype, device=g.device)
            self._buffers[p] = buffer
        torch.mul(g if g.dtype == dtype else g.to(dtype), weight, out=buffer)
        self._sums[p] = buffer

    @staticmethod
    def pending_gradients(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(param, grad) for the params whose ``.grad`` holds an unfolded microbatch gradient."""
        pending = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise TypeError(
                    "adaptive accumulation supports dense gradients only, but a parameter of "
                    f"shape {tuple(p.shape)} has a sparse gradient; use a dense embedding "
                    "(sparse=False)"
                )
            pending.append((p, g))
        return pending

    def fold(
        self, pending: list[tuple[torch.Tensor, torch.Tensor]], weight: float | torch.Tensor
    ) -> None:
        """Add ``weight * grad`` to each running sum, then clear the folded ``.grad`` (noted as
        taken for use: ``grabkit.stats.source.note_gradients_taken``).

        ``weight`` is the microbatch's count (times the inverse loss scale under a GradScaler);
        a Python number costs one fused pass, a 0-dim tensor keeps it on the device.
        """
        fresh = [(p, g) for p, g in pending if p not in self._sums]
        known = [(p, g) for p, g in pending if p in self._sums]
        for p, g in fresh:
            self._start_sum(p, g, weight)
        if known:
            sums = [self._sums[p] for p, _ in known]
            grads = [
                local(g) if g.dtype == s.dtype else local(g).to(s.dtype)
                for (_, g), s in zip(known, sums, strict=True)
            ]
            if isinstance(weight, torch.Tensor):
                torch._foreach_add_(sums, torch._foreach_mul(grads, weight))
            else:
                torch._foreach_add_(sums, grads, alpha=weight)
        for p, _ in pending:
            p.grad = None
        note_gradients_taken([p for p, _ in pending])  # used, not reset (a sampler asks)

    def sum_squared_norm(self) -> torch.Tensor:
        """``|S|^2`` over the sums this rank holds (float64, 0-dim, on the sums' device)."""
        return squared_norm(list(self._sums.values()))

    def write_mean(
        self, total_count: float | torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Set ``p.grad = S_p / total_count`` (in the parameter's dtype); empty the sums.

        Returns ``(param, mean)`` pairs, ``mean`` the rank's local part of the new ``.grad``
        (for a ``DTensor``, its shard: in-place changes reach ``.grad``). ``.grad`` may share
        storage with the sum: the caller must clear ``.grad`` (the wrapper does, right after the
        inner step) before the next window starts.
        """
        means = []
        for p, s in self._sums.items():
            s.div_(total_count)
            mean = s if s.dtype == p.dtype else s.to(p.dtype)
            p.grad = dtensor_like(mean, p)
            means.append((p, mean))
        self._sums = {}
        return means

    def discard(self) -> None:
        """Forget this window's sums (their storage stays for reuse)."""
        self._sums = {}

    def state_dict(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The running sums in ``params`` order (``None`` where a parameter has none yet); for
        sharded parameters this rank's shards, plain tensors."""
        return [None if p not in self._sums else self._sums[p].clone() for p in params]

    def load_state_dict(self, sums: list[torch.Tensor | None], params: list[torch.Tensor]) -> None:
        if len(sums) != len(params):
            raise ValueError(
                f"the checkpoint's accumulation holds {len(sums)} parameters but the optimizer "
                f"has {len(params)}; load it into an optimizer over the same parameters"
            )
        loaded = {}
        for index, (p, s) in enumerate(zip(params, sums, strict=True)):
            if s is None:
                continue
            if s.shape != local(p).shape:
                raise ValueError(
                    f"the checkpoint's accumulated gradient for parameter {index} has shape "
                    f"{tuple(s.shape)} but the parameter has (on this rank) shape "
                    f"{tuple(local(p).shape)}"
                )
            loaded[p] = s.to(device=p.device, copy=True)
        self._sums = loaded
        self._buffers.update(loaded)
