"""The per-example gradient statistics of one backward pass, read by parameter name.

``StepStatistics`` is what ``PerSampleStats`` hands out after a backward: one merged
``ParameterFactor`` per trainable parameter (None where the parameter got no gradient) plus the
batch gradient autograd computed. It owns no hooks, so it stays valid after the next forward pass
starts a new step; ``HookGradientBatch`` reads it in the flat layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from grabkit.stats.factors import OuterProductFactor, ParameterFactor, as_dtype, compute_dtype
from grabkit.stats.gradient_batch import FlatLayout
from grabkit.stats.identity import CheckedReads, PendingIdentityCheck
from grabkit.stats.transfer import NUMPY_DTYPES, host_values, to_device, to_host

__all__ = ["StepStatistics"]


# Weights with at least this many entries take signed sums from the batch gradient. On one CPU
# thread (B = 64) that saves about a third of the GEMM per layer (20 us at 128 x 128, 150 us at
# 512 x 512), while telling whether the weights are two-valued costs about 35 us once per sum:
# only worth it when some layer is large.
_TWO_VALUED_MIN_ENTRIES = 1 << 14


class StepStatistics:
    """Per-example statistics g_1..g_B of one step, over the parameters in ``param_shapes``.

    Args:
        param_shapes: name -> shape of every trainable parameter, in flat-layout order.
        factors: name -> factor of the per-example gradients (None: no gradient this step).
        batch_gradients: name -> this backward's gradient (sum_i g_i / scale).
        batch_size: B.
        scale: the factors hold g_i / scale (B for a mean-reduced loss: autograd's output
            gradients carry its 1/B); reads multiply it back on their small results.
        dtype: of the parameters (inputs are cast to it; statistics are returned in at least
            float32).
        device: of the parameters.
        layout: the ``FlatLayout`` of ``param_shapes`` (built when not given).
        pending_check: the identity check of these statistics when it is not settled yet
            (``grabkit.stats.identity.PendingIdentityCheck``): ``to_host`` settles it in the
            same transfer as the first values read, ``settle_identity`` on its own.
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
        *,
        layout: FlatLayout | None = None,
        pending_check: PendingIdentityCheck | None = None,
    ) -> None:
        self.reads = CheckedReads(pending_check)
        self.param_shapes = dict(param_shapes)
        #: the flat layout of ``param_shapes`` (an engine passes its own, shared by every step)
        self.layout = FlatLayout(self.param_shapes) if layout is None else layout
        self.factors = dict(factors)
        self.batch_gradients = dict(batch_gradients)
        self.batch_size = batch_size
        self.scale = float(scale)
        self.dtype = dtype
        self.device = device
        self.stat_dtype = compute_dtype(dtype)
        self._gram: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None
        # parameters whose signed sums pay to take from the batch gradient (see _two_valued)
        self._large_outer_products = {
            name
            for name, f in self.factors.items()
            if isinstance(f, OuterProductFactor)
            and name in self.batch_gradients
            and f.in_features * f.out_features >= _TWO_VALUED_MIN_ENTRIES
        }
        # the factors of the parameters that got a gradient, walked by every read
        self._present = [(name, f) for name, f in self.factors.items() if f is not None]

    def settle_identity(self) -> None:
        """Settle a pending identity check now (a host transfer; ``IdentityCheckError`` on a
        mismatch, again at every call until the step ends)."""
        self.reads.settle()

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """The values of ``tensor`` (read from these statistics) on the host, in one transfer
        with the pending identity check's numbers, which are compared first
        (``IdentityCheckError``: no value is returned)."""
        return self.reads.to_host(tensor)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.stat_dtype, device=self.device)

    @torch.no_grad()
    def total(self) -> torch.Tensor:
        """(d,) sum_i g_i in the flat layout: the batch gradient autograd computed, rescaled."""
        sizes = [g.numel() for g in self.batch_gradients.values()]
        flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
        for g, piece in zip(self.batch_gradients.values(), flat.split(sizes), strict=True):
            torch.mul(g.reshape(-1), self.scale, out=piece)  # one pass: copy and rescale
        return flat

    @torch.no_grad()
    def add_total_to(self, target: torch.Tensor) -> None:
        """In place: ``target`` (d,) += sum_i g_i in the flat layout, one pass per parameter
        (no (d,) temporary: a running sum of batch gradients reads each stored gradient once)."""
        if target.stride(0) != 1:  # a strided vector: its slices, changed in place
            for name, _, offset, n in self.layout.entries:
                piece = target[offset : offset + n]
                piece.add_(self.batch_gradients[name].reshape(-1), alpha=self.scale)
            return
        for name, piece in self.layout.views(target).items():  # views kept for a kept target
            piece.add_(self.batch_gradients[name], alpha=self.scale)

    @torch.no_grad()
    def total_named(self) -> dict[str, torch.Tensor]:
        """{name: sum_i g_i}."""
        return {name: g * self.scale for name, g in self.batch_gradients.items()}

    @torch.no_grad()
    def total_norms_squared_by_parameter(self) -> dict[str, torch.Tensor]:
        """{name: ||sum_i g_i||^2 over that parameter}, 0-d tensors in at least float32.

        For estimators that need the squared norm of the batch gradient (per block) but not the
        gradient itself: one dot product per parameter on the stored batch gradient, with no
        temporary the size of the model (``total_named()`` followed by a square and a sum
        makes two).
        """
        out = {}
        for name, g in self.batch_gradients.items():
            flat = g.reshape(-1).to(self.stat_dtype)
            out[name] = torch.dot(flat, flat) * self.scale**2
        return out

    @torch.no_grad()
    def norms_squared(self) -> torch.Tensor:
        """(B,) ||g_i||^2 (the Gram diagonal when the Gram matrix was already read)."""
        if self._norms is None:
            if self._gram is not None:
                self._norms = self._gram.diagonal().clone()
            else:
                norms = [
                    as_dtype(factor.norms_squared(), self.stat_dtype) for _, factor in self._present
                ]
                self._norms = self._summed(norms, (self.batch_size,), self.scale**2)
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
            grams = [as_dtype(factor.gram(), self.stat_dtype) for _, factor in self._present]
            self._gram = self._summed(grams, (self.batch_size, self.batch_size), self.scale**2)
        return self._gram

    @torch.no_grad()
    def dot_stacked(self, vectors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B, k) <g_i, v_j> for k vectors given as name -> (k, *shape); absent names are zero."""
        k = next(iter(vectors.values())).shape[0] if vectors else 1
        dots = [
            as_dtype(factor.dot(vectors[name]), self.stat_dtype)
            for name, factor in self._present
            if name in vectors
        ]
        return self._summed(dots, (self.batch_size, k), self.scale)

    def _summed(
        self, parts: list[torch.Tensor], shape: tuple[int, ...], scale: float
    ) -> torch.Tensor:
        """``scale`` times the sum of ``parts`` (each ``shape``, in ``stat_dtype``), added in
        order as onto zeros (the same numbers), without the zeros: the first two parts make
        the sum, the others are added into it. The parts stay unchanged (a factor may hand
        out a tensor it keeps)."""
        if not parts:
            return self._zeros(*shape)
        if len(parts) == 1:
            return parts[0] * scale
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total.add_(part)
        return total.mul_(scale)

    @torch.no_grad()
    def weighted_sum_stacked(
        self,
        weights: torch.Tensor,
        out: Mapping[str, torch.Tensor] | None = None,
        *,
        accumulate: bool = False,
        host_weights: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """(B, k) weights -> name -> (k, *shape) sum_i w[i, j] g_i, in the parameters' dtype.

        ``out``, when given, maps every name to a (k, *shape) tensor (views into one flat
        buffer, say) that receives the result without an extra copy where the layer allows;
        with ``accumulate=True`` the sums are added to what ``out`` holds (running sums updated
        in place, with no temporary the size of the model). ``host_weights``: the same weights
        on the CPU, when the caller has them: the signed-sum shortcut reads their values there
        instead of from the device (no second host sync in a step).
        """
        if accumulate and out is None:
            raise ValueError("weighted_sum_stacked(accumulate=True) needs `out` to add into")
        k = weights.shape[1]
        w = weights * self.scale  # (B, k): cheaper than scaling any gradient factor
        two_valued = None
        if k == 1 and self._large_outer_products:
            if host_weights is None:
                column = to_host(w[:, 0].to(torch.float64))  # B numbers: a sync on a device
            else:  # the same numbers, computed on the host
                column = _scaled_column(host_weights, self.scale)
            two_valued = self._two_valued(column, w.device)
        sums: dict[str, torch.Tensor] = {}
        for name, shape in self.param_shapes.items():
            target = None if out is None else out[name]
            sums[name] = self._weighted_sum_of(name, shape, w, two_valued, target, accumulate)
        return sums

    def _weighted_sum_of(
        self,
        name: str,
        shape: torch.Size,
        w: torch.Tensor,
        two_valued: tuple[torch.Tensor, float, float] | None,
        target: torch.Tensor | None,
        accumulate: bool,
    ) -> torch.Tensor:
        """One parameter's (k, *shape) sum_i w[i, j] g_i (see ``weighted_sum_stacked``)."""
        factor = self.factors[name]
        if two_valued is not None and name in self._large_outer_products:
            rows, a, b = two_valued
            total = self.batch_gradients[name]
            signed = factor.two_valued_sum(rows, a - b, total, b, out=target, accumulate=accumulate)
            if signed is not None:
                return signed
        if accumulate:
            if factor is not None:
                add_to = getattr(factor, "add_weighted_sum_to", None)
                if add_to is not None:
                    add_to(w, target)  # in place, no temporary where the factor allows
                else:
                    target.add_(factor.weighted_sum(w).to(target.dtype))
            return target
        if factor is None:
            zeros = torch.zeros(w.shape[1], *shape, dtype=self.dtype, device=self.device)
            return zeros if target is None else target.copy_(zeros)
        if target is not None:
            return factor.weighted_sum(w, out=target)
        return factor.weighted_sum(w).to(self.dtype)

    @staticmethod
    def _two_valued(
        column: np.ndarray, device: torch.device
    ) -> tuple[torch.Tensor, float, float] | None:
        """For B weights (``column``, float64 on the host) taking at most two values: (rows of the
        rarer value a on ``device``, a, the other value b).

        Every GraB update is such a sum (signs +-1, or +-1 and 0), and
        sum_i w_i g_i = b sum_i g_i + (a - b) sum_{w_i = a} g_i needs a GEMM over the rarer rows
        only, since autograd already formed sum_i g_i.
        """
        first = column[0]
        is_first = column == first
        others = column[~is_first]
        if others.size == 0:
            rows = np.zeros(0, dtype=np.int64)
            return to_device(torch.from_numpy(rows), device), 0.0, float(first)
        second = others[0]
        if not (others == second).all():
            return None
        if 2 * others.size <= column.size:
            rows, a, b = np.flatnonzero(~is_first), float(second), float(first)
        else:
            rows, a, b = np.flatnonzero(is_first), float(first), float(second)
        return to_device(torch.from_numpy(rows), device), a, b


def _scaled_column(host: torch.Tensor, scale: float) -> np.ndarray:
    """(B,) float64 values of ``host[:, 0] * scale`` for (B, k) CPU weights, multiplied in
    their own dtype as torch multiplies them (float32 or float64: one IEEE product, in numpy
    as in torch), without a tensor operation."""
    numpy_dtype = NUMPY_DTYPES.get(host.dtype) if host.dtype != torch.float16 else None
    if numpy_dtype is None:  # half precisions: torch multiplies in float32, then rounds
        return host_values((host[:, 0] * scale).to(torch.float64))
    return (host_values(host)[:, 0] * numpy_dtype(scale)).astype(np.float64)
