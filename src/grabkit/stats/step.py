"""The per-example gradient statistics of one backward pass, read by parameter name.

``StepStatistics`` is what ``PerSampleStats`` hands out after a backward: one merged
``ParameterFactor`` per trainable parameter (None where the parameter got no gradient) plus the
batch gradient autograd computed. It owns no hooks, so it stays valid after the next forward pass
starts a new step; ``HookGradientBatch`` reads it in the flat layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from grabkit.stats.factors import ParameterFactor

__all__ = ["StepStatistics"]


class StepStatistics:
    """Per-example statistics g_1..g_B of one step, over the parameters in ``param_shapes``.

    Args:
        param_shapes: name -> shape of every trainable parameter, in flat-layout order.
        factors: name -> factor of the per-example gradients (None: no gradient this step).
        batch_gradients: name -> this backward's gradient (sum_i g_i / scale).
        batch_size: B.
        scale: the factors hold g_i / scale (B for a mean-reduced loss: autograd's output
            gradients carry its 1/B); reads multiply it back on their small results.
        dtype / device: of the parameters (inputs are cast to it; statistics are returned in
            at least float32).
    """

    def __init__(
        self,
        param_shapes: Mapping[str, torch.Size],
        factors: Mapping[str, ParameterFactor | None],
        batch_gradients: Mapping[str, torch.Tensor],
        batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float = 1.0,
    ) -> None:
        self.param_shapes = dict(param_shapes)
        self.factors = dict(factors)
        self.batch_gradients = dict(batch_gradients)
        self.batch_size = batch_size
        self.scale = float(scale)
        self.dtype = dtype
        self.device = device
        self.stat_dtype = torch.promote_types(dtype, torch.float32)
        self._gram: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None

    def _present(self) -> list[tuple[str, ParameterFactor]]:
        return [(name, f) for name, f in self.factors.items() if f is not None]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.stat_dtype, device=self.device)

    @torch.no_grad()
    def total(self) -> torch.Tensor:
        """(d,) sum_i g_i in the flat layout: the batch gradient autograd computed, rescaled."""
        flat = torch.cat([g.reshape(-1) for g in self.batch_gradients.values()])
        return flat.mul_(self.scale) if self.scale != 1.0 else flat

    @torch.no_grad()
    def total_named(self) -> dict[str, torch.Tensor]:
        """{name: sum_i g_i}."""
        return {name: g * self.scale for name, g in self.batch_gradients.items()}

    @torch.no_grad()
    def norms_squared(self) -> torch.Tensor:
        """(B,) ||g_i||^2 (the Gram diagonal when the Gram matrix was already read)."""
        if self._norms is None:
            if self._gram is not None:
                self._norms = self._gram.diagonal().clone()
            else:
                total = self._zeros(self.batch_size)
                for _, factor in self._present():
                    total = total + factor.norms_squared().to(self.stat_dtype)
                self._norms = total * self.scale**2
        return self._norms

    @torch.no_grad()
    def norms_squared_by_parameter(self) -> dict[str, torch.Tensor]:
        """{name: (B,) ||g_i restricted to that parameter||^2}; zeros where it got no gradient.

        Per-parameter blocks for estimators that track layers separately; they sum to
        ``norms_squared()``.
        """
        return {
            name: self._zeros(self.batch_size)
            if factor is None
            else factor.norms_squared().to(self.stat_dtype) * self.scale**2
            for name, factor in self.factors.items()
        }

    @torch.no_grad()
    def gram(self) -> torch.Tensor:
        """(B, B) <g_i, g_j>."""
        if self._gram is None:
            total = self._zeros(self.batch_size, self.batch_size)
            for _, factor in self._present():
                total = total + factor.gram().to(self.stat_dtype)
            self._gram = total * self.scale**2
        return self._gram

    @torch.no_grad()
    def dot_stacked(self, vectors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B, k) <g_i, v_j> for k vectors given as name -> (k, *shape); absent names are zero."""
        k = next(iter(vectors.values())).shape[0] if vectors else 1
        total = self._zeros(self.batch_size, k)
        for name, factor in self._present():
            v = vectors.get(name)
            if v is not None:
                total = total + factor.dot(v).to(self.stat_dtype)
        return total * self.scale

    @torch.no_grad()
    def weighted_sum_stacked(
        self, weights: torch.Tensor, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """(B, k) weights -> name -> (k, *shape) sum_i w[i, j] g_i, in the parameters' dtype.

        ``out``, when given, maps every name to a (k, *shape) tensor (views into one flat
        buffer, say) that receives the result without an extra copy where the layer allows.
        """
        k = weights.shape[1]
        w = weights * self.scale  # (B, k): cheaper than scaling any gradient factor
        sums: dict[str, torch.Tensor] = {}
        for name, shape in self.param_shapes.items():
            target = None if out is None else out[name]
            factor = self.factors[name]
            if factor is None:
                zeros = torch.zeros(k, *shape, dtype=self.dtype, device=self.device)
                sums[name] = zeros if target is None else target.copy_(zeros)
            elif target is not None:
                sums[name] = factor.weighted_sum(w, out=target)
            else:
                sums[name] = factor.weighted_sum(w).to(self.dtype)
        return sums
