"""Measure microbatch gradient norms with hooks while gradients accumulate; no extra pass.

A hook on each parameter sees the increment d_k that the k-th backward adds to ``.grad``, before
it is added, and takes its squared norm |d_k|^2 (one pass over the gradient per microbatch, no
copy). At the end of the step ``.grad`` holds sum_k d_k, whose squared norm is read once, before
any clipping or unscaling touches it; both are at the same loss scale, divided out at the end.
"""

from __future__ import annotations

import torch

from grabkit.integrations.wiring import check_wiring
from grabkit.noise.blocks import ParamsLike, named_trainable_parameters
from grabkit.noise.identities import loss_scale_squared
from grabkit.noise.microbatch import MicrobatchNoiseScale
from grabkit.noise.result import NoiseScaleResult
from grabkit.validation import check_positive

__all__ = ["AccumulationNoiseScale"]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    """|t|^2 as a 0-d tensor, one pass over ``t``; half precision is reduced in float32.

    ``torch.dot`` is the cheapest single-pass reduction of a contiguous tensor on CPU (BLAS);
    float16 / bfloat16 are widened first so that the squares do not overflow.
    """
    flat = t.detach().reshape(-1)
    if flat.dtype in _HALF_DTYPES:
        flat = flat.float()
    return torch.dot(flat, flat)


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

    One ``backward()`` per microbatch (``end_microbatch`` raises otherwise: call it after each
    backward); ``.grad`` must start each step at zero or None (the usual ``zero_grad()``). The
    hooks also see any other differentiation through these parameters (``torch.autograd.grad``
    for a penalty, another estimator): keep those out of the measured steps. Call ``remove()``
    (or use ``with``) to detach the hooks.
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
        self._device = self._params[0].device
        # Row k holds |d_k|^2 per block of the step's k-th microbatch, and after the last one
        # the row of |G_B|^2. The hooks copy each square into it at once: keeping the 0-d results
        # alive until the step ends measurably slows the backward passes (small allocations
        # left between the large gradient buffers). Rows are zero until written (no gradient).
        self._squares = torch.zeros(8, len(named), dtype=torch.float64, device=self._device)
        self._row = 0  # the microbatch the hooks are measuring
        self._written = [False] * len(named)  # per block: this microbatch's square is in its row
        self._repeated = False  # a block's hook ran twice in this microbatch (two backwards)
        self._micro_scales_sq: list[float] = []
        self._micro_counts: list[float] = []
        self._handles = [p.register_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    def _make_hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            self._record(self._row, index, _square_norm(grad))

        return hook

    def _record(self, row: int, index: int, square: torch.Tensor) -> None:
        """Put ``square`` at (row, index); a second one in the same microbatch is an error.

        Each backward's increment is measured on its own, and |d' + d''|^2 is not
        |d'|^2 + |d''|^2: two backward passes in one microbatch cannot be measured as one.
        """
        if self._written[index]:
            self._repeated = True
        self._squares[row, index] = square
        self._written[index] = True

    def end_microbatch(self, count: float) -> None:
        """Close the microbatch whose ``backward()`` just ran; ``count`` is its example count.

        Only bookkeeping: the squares are already in their row; ``end_step`` reads them all.
        """
        if self._repeated:
            self._repeated = False
            self._written = [False] * len(self._params)
            self._squares[self._row].zero_()
            raise RuntimeError(
                "more than one backward() ran since the last end_microbatch(); the hooks measure "
                "each backward's gradient on its own, so call end_microbatch(count) after every "
                "backward() with the number of examples that backward covered"
            )
        self._micro_counts.append(check_positive("count", count))
        self._micro_scales_sq.append(loss_scale_squared(self.grad_scaler))
        self._row += 1
        self._written = [False] * len(self._params)
        if self._row == self._squares.shape[0]:  # room for the next microbatch or the step row
            self._squares = torch.cat([self._squares, torch.zeros_like(self._squares)])

    def end_step(self) -> NoiseScaleResult | None:
        """Close the step: fold its estimate into the averages and return the current result.

        Call it after the last microbatch's ``end_microbatch`` and before anything rescales or
        clips ``.grad`` (``grad_scaler.unscale_``, ``clip_grad_norm_``): it reads the accumulated
        ``.grad``. Returns None until a step with at least two microbatches was seen.
        """
        if not getattr(self, "_wiring_checked", False):  # a framework that clipped already
            self._wiring_checked = True
            check_wiring(self, "noise")
        if any(self._written):
            raise RuntimeError(
                "a backward pass ran after the last end_microbatch(); call "
                "end_microbatch(count) after every microbatch's backward()"
            )
        microbatches, scales_sq, counts = self._row, self._micro_scales_sq, self._micro_counts
        self._row, self._micro_scales_sq, self._micro_counts = 0, [], []
        if len(counts) < 2:
            self._squares.zero_()
            return self.estimator.estimate
        # the last row: |sum_k d_k|^2 of the accumulated .grad, at the last microbatch's scale
        for index, p in enumerate(self._params):
            if p.grad is not None:
                self._squares[microbatches, index] = _square_norm(p.grad)
        scales_sq.append(scales_sq[-1])
        scale_sq = torch.tensor(scales_sq, dtype=torch.float64, device=self._device)
        squares = self._squares[: microbatches + 1] / scale_sq[:, None]  # (K + 1, P), a new tensor
        self._squares.zero_()
        total = sum(counts)
        # the increment is d_k = (n_k / B) g_k, so |g_k|^2 = |d_k|^2 (B / n_k)^2
        share = torch.tensor(counts, dtype=torch.float64, device=self._device) / total
        self.estimator.observe_microbatches(squares[:-1] / share[:, None] ** 2, counts)
        return self.estimator.observe_step(squares[-1])

    def discard_step(self) -> None:
        """Close the step without measuring it (where ``end_step`` would go): the averages stay
        as they are. For a step whose microbatches are not weighted as ``end_microbatch``'s
        counts say (e.g. equal shares 1 / K of microbatches of different sizes)."""
        self._row, self._micro_scales_sq, self._micro_counts = 0, [], []
        self._written, self._repeated = [False] * len(self._params), False
        self._squares.zero_()

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
        """The averages and the step in progress: a checkpoint between microbatches (or between
        a backward and its ``end_microbatch``) resumes to the same estimate.

        The step's accumulated ``.grad`` is the model's, not this object's: to resume in
        mid-step, save and restore it too.
        """
        return {
            "estimator": self.estimator.state_dict(),
            "squares": self._squares[: self._row + 1].clone(),  # (K + 1, P): K closed + current
            "written": list(self._written),
            "repeated": self._repeated,
            "counts": list(self._micro_counts),
            "scales_sq": list(self._micro_scales_sq),
        }

    def load_state_dict(self, state: dict) -> None:
        expected = {"estimator", "squares", "written", "repeated", "counts", "scales_sq"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"AccumulationNoiseScale state has keys {got}, expected {sorted(expected)}"
            )
        squares, counts = state["squares"], [float(c) for c in state["counts"]]
        blocks = len(self._params)
        if (
            squares.ndim != 2
            or tuple(squares.shape) != (len(counts) + 1, blocks)
            or len(state["scales_sq"]) != len(counts)
            or len(state["written"]) != blocks
        ):
            raise ValueError(
                f"AccumulationNoiseScale state does not fit {blocks} blocks: squares of shape "
                f"{tuple(squares.shape)} for {len(counts)} closed microbatches"
            )
        self.estimator.load_state_dict(state["estimator"])
        rows = max(8, 2 * squares.shape[0])
        self._squares = torch.zeros(rows, blocks, dtype=torch.float64, device=self._device)
        self._squares[: squares.shape[0]] = squares.to(self._device)
        self._row = len(counts)
        self._written = [bool(w) for w in state["written"]]
        self._repeated = bool(state["repeated"])
        self._micro_counts = counts
        self._micro_scales_sq = [float(x) for x in state["scales_sq"]]
