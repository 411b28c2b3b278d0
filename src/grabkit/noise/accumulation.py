"""Measure microbatch gradient norms with hooks while gradients accumulate; no extra pass.

A hook on each parameter sees the increment d_k that the k-th backward adds to ``.grad``, before
it is added, and takes its squared norm |d_k|^2 (one pass over the gradient per microbatch, no
copy). At the end of the step ``.grad`` holds sum_k d_k, whose squared norm is read once, before
any clipping or unscaling touches it; both are at the same loss scale, divided out at the end.
"""

from __future__ import annotations

import torch

from grabkit.noise.blocks import ParamsLike, named_trainable_parameters
from grabkit.noise.microbatch import MicrobatchNoiseScale, _check_count
from grabkit.noise.result import NoiseScaleResult

__all__ = ["AccumulationNoiseScale"]


def _reduction_dtype(t: torch.Tensor) -> torch.dtype:
    """Half-precision gradients are reduced in float32 so that squares do not overflow."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class AccumulationNoiseScale:
    """Gradient noise scale of an accumulating training loop, measured by gradient hooks.

    Usage (the accumulated ``.grad`` must be the step's *mean* gradient: scale each microbatch
    loss by its share of the step, ``n_k / B``, e.g. ``loss / K`` for K equal microbatches)::

        gns = AccumulationNoiseScale(model, update_rate=0.01)
        for step in ...:
            for x, y in microbatches:
                (loss_fn(model(x), y) * len(x) / step_examples).backward()
                gns.end_microbatch(len(x))
            result = gns.end_step()          # before clipping / unscaling
            optimizer.step(); optimizer.zero_grad()

    Args:
        params: a module, tensors, or ``(name, tensor)`` pairs; one block per tensor.
        update_rate, window, confidence, population_size: as in ``MicrobatchNoiseScale``.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale multiplies the losses; its current
            scale is read at each ``end_microbatch`` and divided out (squared) before use.

    One ``backward()`` per microbatch; ``.grad`` must start each step at zero or None (the usual
    ``zero_grad()``). The hooks also see any other differentiation through these parameters
    (``torch.autograd.grad`` for a penalty, another estimator): keep those out of the measured
    steps. Call ``remove()`` (or use ``with``) to detach the hooks.
    """

    def __init__(
        self,
        params: ParamsLike,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        grad_scaler: torch.amp.GradScaler | None = None,
        population_size: int | None = None,
    ) -> None:
        named = named_trainable_parameters(params, "AccumulationNoiseScale")
        self.block_names = tuple(name for name, _ in named)
        self.estimator = MicrobatchNoiseScale(
            update_rate, window, confidence, self.block_names, population_size
        )
        self.grad_scaler = grad_scaler
        self._params = [p for _, p in named]
        self._square: list[torch.Tensor | None] = [None] * len(named)
        self._device = self._params[0].device
        # per microbatch of this step: (per-block squares, loss scale squared), and counts
        self._micro_parts: list[tuple[list, float]] = []
        self._micro_counts: list[float] = []
        self._handles = [p.register_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    @staticmethod
    def _square_norm(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1).to(_reduction_dtype(t))
        return torch.dot(flat, flat)

    def _make_hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            square = self._square_norm(grad)
            previous = self._square[index]
            self._square[index] = square if previous is None else previous + square

        return hook

    def _loss_scale_sq(self) -> float:
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return 1.0
        return float(self.grad_scaler.get_scale()) ** 2

    def end_microbatch(self, count: float) -> None:
        """Close the microbatch whose ``backward()`` just ran; ``count`` is its example count."""
        self._micro_counts.append(_check_count(count))
        self._micro_parts.append((self._square, self._loss_scale_sq()))
        self._square = [None] * len(self._params)

    def _stack(self, rows: list[list[torch.Tensor | None]]) -> torch.Tensor:
        """(K, P) float64 from per-microbatch lists of per-block scalars (None: no gradient)."""
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        flat = [
            zero if v is None else v.to(self._device, torch.float64) for row in rows for v in row
        ]
        return torch.stack(flat).reshape(len(rows), len(self._params))

    def end_step(self) -> NoiseScaleResult | None:
        """Close the step: fold its estimate into the averages and return the current result.

        Call it after the last microbatch's ``end_microbatch`` and before anything rescales or
        clips ``.grad`` (``grad_scaler.unscale_``, ``clip_grad_norm_``): it reads the accumulated
        ``.grad``. Returns None until a step with at least two microbatches was seen.
        """
        if any(v is not None for v in self._square):
            raise RuntimeError(
                "a backward pass ran after the last end_microbatch(); call "
                "end_microbatch(count) after every microbatch's backward()"
            )
        parts, counts = self._micro_parts, self._micro_counts
        self._micro_parts, self._micro_counts = [], []
        if len(counts) < 2:
            return self.estimator.estimate
        scale_sq = torch.tensor([s for _, s in parts], dtype=torch.float64, device=self._device)
        squares = self._stack([sq for sq, _ in parts]) / scale_sq[:, None]  # |d_k|^2
        accumulated = [None if p.grad is None else self._square_norm(p.grad) for p in self._params]
        step_sq = self._stack([accumulated])[0] / scale_sq[-1]  # |sum_k d_k|^2
        total = sum(counts)
        # the increment is d_k = (n_k / B) g_k, so |g_k|^2 = |d_k|^2 (B / n_k)^2
        share = torch.tensor(counts, dtype=torch.float64, device=self._device) / total
        self.estimator.observe_microbatches(squares / share[:, None] ** 2, counts)
        return self.estimator.observe_step(step_sq)

    @property
    def estimate(self) -> NoiseScaleResult | None:
        return self.estimator.estimate

    def remove(self) -> None:
        """Detach the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> AccumulationNoiseScale:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def state_dict(self) -> dict:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state)
