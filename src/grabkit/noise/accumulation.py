"""Measure microbatch gradient norms with hooks while gradients accumulate; no extra pass.

A hook on each parameter sees the increment d_k that the k-th backward adds to ``.grad``, before
it is added, and takes its squared norm |d_k|^2 (one pass over the gradient per microbatch, no
copy). At the end of the step the step gradient's squared norm is read once, before any clipping
or unscaling touches it; both are at the same loss scale, divided out at the end.

Where the step gradient comes from:

* a plain loop: ``.grad`` holds sum_k d_k when ``end_step`` runs;
* under ``DistributedDataParallel`` (``no_sync`` accumulation, accelerate's ``accumulate()``, or
  synchronising every microbatch) the hooks still see each rank's local increments (DDP averages
  after accumulation) and ``.grad`` holds the ranks' average once the last backward synchronised;
  ``fully_shard`` (FSDP2) likewise, with the hooks on the unsharded parameters of each forward
  (:mod:`grabkit.taps`) and the average in sharded ``.grad`` s;
* an :class:`~grabkit.accumulate.AdaptiveAccumulationWrapper` folds and clears ``.grad`` after
  every microbatch, so the estimator follows the wrapper instead (``optimizer=wrapper``): each
  backward's gradient is a whole microbatch's, and the step gradient is the window's weighted
  mean, read as the wrapper writes it, before its clipping.

With several ranks every rank's microbatch norms enter the estimate (:mod:`grabkit.noise.windows`
combines them exactly, one small all-gather per step), and every rank reports the same number.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from grabkit.integrations.wiring import check_wiring
from grabkit.noise.blocks import ParamsLike, named_trainable_parameters
from grabkit.noise.estimator import NoiseEstimator
from grabkit.noise.identities import loss_scale_squared
from grabkit.noise.microbatch import MicrobatchNoiseScale
from grabkit.noise.result import NoiseScaleResult
from grabkit.noise.windows import combine, gather_terms, rank_terms
from grabkit.sharding import gradient_layout_of, is_sharded, local, world_size
from grabkit.state import Stateful
from grabkit.stats.rows import in_grouped_run
from grabkit.stats.structure import registrations
from grabkit.stats.transfer import to_device
from grabkit.taps import GradientTaps
from grabkit.validation import check_positive

if TYPE_CHECKING:
    from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper

__all__ = ["AccumulationNoiseScale"]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


_REPEATED = (
    "more than one backward() ran since the last end_microbatch(); the hooks measure each "
    "backward's gradient on its own, so call end_microbatch(count) after every backward() with "
    "the number of examples that backward covered"
)
_REPEATED_BY_GROUPS = (
    "backward_by_group ran one backward per length group since the last end_microbatch(); the "
    "hooks measure each backward's gradient on its own, and a group of similar lengths is no "
    "random microbatch: run the grouped batch with GroupedBatch.run (or run_grouped) and one "
    "backward() per microbatch"
)


_MID_STEP = (
    "AccumulationNoiseScale: .grad held a gradient at this step's first measured backward "
    "(the estimator was built, or its state loaded, in the middle of a step, so microbatches "
    "before the estimator existed are in the step gradient; or .grad was not zeroed after the "
    "last step), so the step gradient is not the sum of the microbatches measured: the step "
    "is left out of the estimate. Build the estimator between steps, after zero_grad() (and "
    "zero the gradients between steps)."
)
_MID_WINDOW = (
    "AccumulationNoiseScale: the window the wrapper applied holds {window} microbatch(es), "
    "of which the estimator measured {measured} (it began to follow the wrapper, or its state "
    "was loaded, in the middle of a window): the window is left out of the estimate. Build "
    "the estimator between windows, or load its state with the wrapper's."
)


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    """|t|^2 (of this rank's shard for a DTensor) as a 0-d tensor, one pass over ``t``; half
    precision is reduced in float32.

    ``torch.dot`` is the cheapest single-pass reduction of a contiguous tensor on CPU (BLAS);
    float16 / bfloat16 are widened first so that the squares do not overflow.
    """
    flat = local(t).detach().reshape(-1)
    if flat.dtype in _HALF_DTYPES:
        flat = flat.float()
    return torch.dot(flat, flat)


def _unwrap(params: ParamsLike) -> ParamsLike:
    """The module inside ``DistributedDataParallel``, whose parameter names are the model's."""
    if isinstance(params, nn.parallel.DistributedDataParallel):
        return params.module
    return params


class AccumulationNoiseScale(NoiseEstimator, Stateful):
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

    Under ``DistributedDataParallel`` or ``fully_shard`` the loop is the same on every rank
    (counts are local; ``end_step`` after the backward that synchronised, i.e. the last
    microbatch outside ``no_sync()``); all ranks' microbatches enter one estimate, the same on
    every rank. With an :class:`~grabkit.accumulate.AdaptiveAccumulationWrapper`, pass it as
    ``optimizer=`` and call nothing: the wrapper closes microbatches and windows for the
    estimator (each microbatch loss is then its own mean, as the wrapper expects)::

        optimizer = AdaptiveAccumulationWrapper(torch.optim.SGD(model.parameters()), NormTest())
        gns = AccumulationNoiseScale(model, optimizer=optimizer)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step(count=len(y))
        print(gns.estimate)                   # updated at every window the wrapper applied

    Args:
        params: a module (a ``DistributedDataParallel`` or ``fully_shard`` one too), tensors, or
            ``(name, tensor)`` pairs; one block per tensor. Sharded parameters need the module.
        update_rate: EMA weight of the newest step, as in ``MicrobatchNoiseScale``.
        window: ``"steps"`` or ``"examples"``, the unit of ``update_rate``.
        confidence: coverage of the reported interval for B_simple.
        population_size: the data set size N when steps draw without replacement (see
            ``NoiseScaleTracker``).
        grad_scaler: a ``torch.amp.GradScaler`` whose scale multiplies the losses; its current
            scale is read as each microbatch closes and divided out (squared) before use.
        optimizer: an ``AdaptiveAccumulationWrapper`` over these parameters, to follow its
            windows (see above).
        process_group: the ranks whose microbatches form one step: by default a DDP model's
            group, else the world when torch.distributed is initialised with several ranks. All
            of them must close every step (``end_step`` is collective).

    One ``backward()`` per microbatch (``end_microbatch`` raises otherwise: call it after each
    backward; a grouped batch runs through ``GroupedBatch.run``, not ``backward_by_group``);
    ``.grad`` must start each step at zero or None (the usual ``zero_grad()``): a step whose
    ``.grad`` held a gradient at its first backward (the estimator built, or its state loaded,
    in the middle of a step; ``zero_grad()`` left out), and a wrapper's window folded partly
    before the estimator followed it, are left out of the estimate with a ``RuntimeWarning``
    (their step gradient holds microbatches the hooks never saw). The hooks also
    see any other differentiation through these parameters (``torch.autograd.grad`` for a
    penalty, another estimator): keep those out of the measured steps. Call ``close()`` (or use
    ``with``) to detach the hooks. ``FullyShardedDataParallel`` (FSDP1) is refused.

    Its state is the averages and the step in progress: a checkpoint between microbatches (or
    between a backward and its ``end_microbatch``) resumes to the same estimate. The step's
    accumulated ``.grad`` is the model's, not this object's: to resume in mid-step, save and
    restore it too. With several ranks each saves its own (a state that another rank saved
    inside a step is refused: its microbatch norms are that rank's).
    """

    def __init__(
        self,
        params: ParamsLike,
        update_rate: float = 0.01,
        window: str = "steps",
        confidence: float = 0.95,
        grad_scaler: torch.amp.GradScaler | None = None,
        population_size: int | None = None,
        *,
        optimizer: AdaptiveAccumulationWrapper | None = None,
        process_group: Any = None,
    ) -> None:
        if process_group is None and isinstance(params, nn.parallel.DistributedDataParallel):
            process_group = params.process_group
        params = _unwrap(params)
        named = named_trainable_parameters(params, "AccumulationNoiseScale")
        self.layout = gradient_layout_of([p for _, p in named], "AccumulationNoiseScale")
        self.block_names = tuple(name for name, _ in named)
        self.grad_scaler = grad_scaler
        self.process_group = process_group
        self._params = [p for _, p in named]
        self._block_of = {p: i for i, p in enumerate(self._params)}
        # the model, to notice parameters replaced or added after the hooks went on
        self._model = params if isinstance(params, nn.Module) else None
        self._registrations = registrations()
        self._device = local(self._params[0]).device
        self._row = 0  # the microbatch the hooks are measuring (the closed ones come before)
        #: |.grad|^2 found at the step's first backward (None: .grad was None, as it should be)
        self._held: torch.Tensor | None = None
        estimator = MicrobatchNoiseScale(
            update_rate, window, confidence, self.block_names, population_size
        )
        self.add_state("estimator", estimator)
        # Row k holds |d_k|^2 per block of the step's k-th microbatch. The hooks copy each
        # square into it at once: keeping the 0-d results alive until the step ends measurably
        # slows the backward passes (small allocations left between the large gradient
        # buffers). Rows are zero until written (no gradient). Saved: the closed rows and the
        # current one, (K + 1, P).
        squares = torch.zeros(8, len(named), dtype=torch.float64, device=self._device)
        self.add_state(
            "squares", squares, attribute="_squares", save=self._saved_squares,
            load=self._loaded_squares,
        )  # fmt: skip
        # per block: this microbatch's square is in its row
        self.add_state("written", [False] * len(named), attribute="_written", load=_bools)
        # a block's hook ran twice in this microbatch (two backwards)
        self.add_state("repeated", False, attribute="_repeated", load=bool)
        self._repeated_by_groups = False  # the repeat came from backward_by_group's backwards
        self.add_state("counts", [], attribute="_micro_counts", save=list, load=_floats)
        # the factor each closed microbatch's mean loss was multiplied by (``share=``), or
        # empty: every loss scaled by its count's share of the step (states saved before
        # shares were kept lack it)
        self.add_state(
            "shares", [], attribute="_micro_shares", save=list, load=_floats, optional=True
        )
        self.add_state("scales_sq", [], attribute="_micro_scales_sq", save=list, load=_floats)
        # the wrapper's agreed count per microbatch (states saved before it was kept lack it)
        self.add_state(
            "window_counts", [], attribute="_window_counts", save=list, load=_floats,
            optional=True,
        )  # fmt: skip
        # the rank that saved the state: the open step's rows are that rank's own microbatches
        self.add_state(
            "rank", 0, attribute="_saved_rank", save=lambda _: self._rank(), load=int,
            optional=True,
        )  # fmt: skip
        self._wrapper = optimizer
        self._taps = GradientTaps(
            named,
            self._measure,
            params if isinstance(params, nn.Module) else None,
            commit=self._record,
        )
        if optimizer is not None:
            self._watch(optimizer)

    def _watch(self, optimizer: AdaptiveAccumulationWrapper) -> None:
        from grabkit.accumulate.wrapper import AdaptiveAccumulationWrapper

        if not isinstance(optimizer, AdaptiveAccumulationWrapper):
            raise TypeError(
                "optimizer= is for an AdaptiveAccumulationWrapper (or a GQC wrapper), whose "
                f"windows the estimator follows, but got {type(optimizer).__name__}; with a "
                "plain optimizer call end_microbatch() and end_step() yourself"
            )
        wrapped = {p for group in optimizer.param_groups for p in group["params"]}
        named = zip(self.block_names, self._params, strict=True)
        missing = [name for name, p in named if p not in wrapped]
        if missing:
            raise ValueError(
                f"the wrapper does not optimize {missing[:3]} ({len(missing)} of the measured "
                "parameters): build the estimator on the parameters the wrapper steps"
            )
        self._wrapper_handle = optimizer.register_window_observer(self)

    # ------------------------------------------------------------------ hooks
    def _measure(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """|grad|^2 of a backward's increment, taken before autograd accumulates it (with
        ``.grad`` as it was then, at a step's first backward: ``_note_held_gradient``)."""
        if self._row == 0 and not self._written[index]:
            self._note_held_gradient(index)
        return _square_norm(grad)

    def _record(self, index: int, square: torch.Tensor) -> None:
        """Put |grad|^2 at (row, index) once the backward accumulated it into ``.grad`` (a
        ``torch.autograd.grad`` pass, such as SAM's ascent, accumulates nothing and is never
        recorded); a second one in the same microbatch is an error.

        Each backward's increment is measured on its own, and |d' + d''|^2 is not
        |d'|^2 + |d''|^2: two backward passes in one microbatch cannot be measured as one.
        """
        if self._written[index]:
            self._repeated = True
            self._repeated_by_groups = in_grouped_run()
        self._squares[self._row, index] = square
        self._written[index] = True

    def _note_held_gradient(self, index: int) -> None:
        """At a step's first backward, add |.grad|^2 of the parameter to ``_held`` (before this
        backward accumulates into it): a step gradient that starts non-zero holds microbatches
        the hooks never saw. Free where ``.grad`` is None (``zero_grad()``'s default); a
        sharded parameter's ``.grad`` is the reduced shard, not an accumulation, and is left."""
        p = self._params[index]
        held = p.grad
        if held is None or is_sharded(p):
            return
        square = _square_norm(held).to(torch.float64)
        self._held = square if self._held is None else self._held + square

    def _started_before(self) -> bool:
        """Whether this step's gradient held something before its first measured backward
        (one host read, only where ``.grad`` was not None then)."""
        held, self._held = self._held, None
        return held is not None and bool(held > 0)

    def _check_parameters_unchanged(self) -> None:
        """Refuse a model whose parameters were replaced or added since the estimator was built
        (``model.head = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``,
        ``load_state_dict(assign=True)``): the hooks sit on the old tensors, so the new ones'
        gradients would be left out of |G|^2 and tr(Sigma) without a word. Costs one integer
        compare unless a module or parameter was registered somewhere since the last check."""
        if self._model is None or registrations() == self._registrations:
            return
        self._registrations = registrations()
        now = {id(p): name for name, p in self._model.named_parameters() if p.requires_grad}
        measured = {id(p) for p in self._params}
        new = [name for key, name in now.items() if key not in measured]
        if new:
            raise ValueError(
                f"AccumulationNoiseScale: the model got parameters after the estimator was "
                f"built ({', '.join(repr(n) for n in new[:4])}{', ...' if len(new) > 4 else ''}; "
                f"a replaced layer or weight, or load_state_dict(assign=True)): its gradient "
                f"hooks sit on the parameters it was built on, so these would be left out of "
                f"the estimate. Build a new estimator (and optimizer) after changing the model."
            )

    def _close_microbatch(self, count: float, share: float | None = None) -> None:
        self._check_parameters_unchanged()
        if self._repeated:
            by_groups = self._repeated_by_groups
            self._forget_row()
            raise RuntimeError(_REPEATED_BY_GROUPS if by_groups else _REPEATED)
        count = check_positive("count", count)
        if share is not None:
            share = check_positive("share", share)
        if self._row and (share is None) != (not self._micro_shares):
            raise ValueError(
                f"end_microbatch(share={share}) in a step whose earlier microbatches were "
                f"closed {'without' if share is not None else 'with'} a share: the step "
                "gradient's weights are either every microbatch's share (the factor its mean "
                "loss was multiplied by) or, without share=, every count's part of the step; "
                "pass share= for every microbatch of the step or for none"
            )
        self._micro_counts.append(count)
        if share is not None:
            self._micro_shares.append(share)
        self._micro_scales_sq.append(loss_scale_squared(self.grad_scaler))
        self._row += 1
        self._written = [False] * len(self._params)
        if self._row == self._squares.shape[0]:  # room for the next microbatch
            self._squares = torch.cat([self._squares, torch.zeros_like(self._squares)])

    def _forget_row(self) -> None:
        self._repeated = self._repeated_by_groups = False
        self._written = [False] * len(self._params)
        self._squares[self._row].zero_()

    def _clear_step(self) -> None:
        self._held = None
        self._row, self._micro_scales_sq, self._micro_counts = 0, [], []
        self._micro_shares = []
        self._window_counts = []
        self._squares.zero_()

    # ------------------------------------------------------------------ a plain loop
    def end_microbatch(self, count: float, share: float | None = None) -> None:
        """Close the microbatch whose ``backward()`` just ran; ``count`` is its example count
        (on this rank).

        ``share``: the factor this microbatch's mean loss was multiplied by before its backward,
        when it is not ``count`` over the step's examples. accelerate's ``accumulate()`` divides
        every loss by ``gradient_accumulation_steps`` (``accelerator.backward``), also in a
        window cut short by the end of the loader and for a smaller last batch: pass
        ``share=1 / accelerator.gradient_accumulation_steps``. The step gradient is then
        ``sum_k share_k g_k``, which the estimator divides by ``sum_k share_k`` to get the
        weighted mean it measures (weights ``share_k / sum share``), instead of reading a window
        of two microbatches out of four as a mean at half its size. Give it for every
        microbatch of a step or for none; with several ranks every rank's shares must add up
        to the same sum (as accelerate's even batches make them), else ``end_step`` finds the
        step gradients differ across ranks and raises.

        Only bookkeeping: the squares are already in their row; ``end_step`` reads them all.
        """
        self._refuse_if_following("end_microbatch")
        self._close_microbatch(count, share)

    def end_step(self) -> NoiseScaleResult | None:
        """Close the step: fold its estimate into the averages and return the current result.

        Call it after the last microbatch's ``end_microbatch`` and before anything rescales or
        clips ``.grad`` (``grad_scaler.unscale_``, ``clip_grad_norm_``): it reads the accumulated
        ``.grad``. Collective with several ranks. Returns None until a step with at least two
        microbatches (over all ranks) was seen.
        """
        self._refuse_if_following("end_step")
        if not getattr(self, "_wiring_checked", False):  # a framework that clipped already
            self._wiring_checked = True
            check_wiring(self, "noise")
        if any(self._written):
            raise RuntimeError(
                "a backward pass ran after the last end_microbatch(); call "
                "end_microbatch(count) after every microbatch's backward()"
            )
        grads = [p.grad for p in self._params]
        if self._row and all(g is None for g in grads):
            closed = self._row
            self._clear_step()
            raise RuntimeError(
                "end_step() found no gradient in .grad after "
                f"{closed} microbatch(es): something cleared it (zero_grad() "
                "before end_step(), or an AdaptiveAccumulationWrapper, which folds .grad away "
                "after every microbatch: build the estimator with optimizer=wrapper instead)"
            )
        if self._started_before():
            self._clear_step()
            warnings.warn(_MID_STEP, RuntimeWarning, stacklevel=2)
            return self.estimator.estimate
        step = torch.stack(
            [
                torch.zeros((), dtype=torch.float64, device=self._device)
                if g is None
                else _square_norm(g).to(torch.float64)
                for g in grads
            ]
        )
        counts = to_device(torch.tensor(self._micro_counts, dtype=torch.float64), self._device)
        scale_sq = self._micro_scales_sq[-1] if self._micro_scales_sq else 1.0
        if self._micro_shares:
            return self._fold_shared(counts, step / scale_sq)
        # the increment is d_k = (n_k / B_r) g_k: losses scaled by their share of this rank's
        # batch, and the ranks averaged
        weights = counts / counts.sum() / self._world()
        norms = self._true_squares() / (weights * self._world())[:, None].square()
        return self._fold(norms, counts, weights, step / scale_sq)

    def _fold_shared(
        self, counts: torch.Tensor, step_norm_sq: torch.Tensor
    ) -> NoiseScaleResult | None:
        """Close a step whose microbatch losses were multiplied by the given shares s_k: the
        increment is d_k = s_k g_k, the step gradient sum_k s_k g_k (the ranks averaged), so the
        weighted mean is that over S = sum_k s_k, with weights s_k / (S R)."""
        shares = to_device(torch.tensor(self._micro_shares, dtype=torch.float64), self._device)
        total = shares.sum()
        weights = shares / total / self._world()
        norms = self._true_squares() / shares[:, None].square()
        return self._fold(norms, counts, weights, step_norm_sq / total.square())

    def _refuse_if_following(self, what: str) -> None:
        if self._wrapper is not None:
            raise RuntimeError(
                f"{what}() is called by the AdaptiveAccumulationWrapper this estimator follows "
                "(optimizer=); just call the wrapper's step() after each backward"
            )

    def discard_step(self) -> None:
        """Close the step without measuring it (where ``end_step`` would go): the averages stay
        as they are. For a step whose microbatches are not weighted as ``end_microbatch``'s
        counts say (e.g. equal shares 1 / K of microbatches of different sizes)."""
        self._refuse_if_following("discard_step")
        self._clear_step()
        self._written, self._repeated = [False] * len(self._params), False

    # ------------------------------------------------------------------ shared
    def _world(self) -> int:
        return world_size(self.process_group)

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._world() > 1 else 0

    def _true_squares(self) -> torch.Tensor:
        """(K, P) squares of the closed microbatches with each one's loss scale divided out."""
        scale_sq = to_device(torch.tensor(self._micro_scales_sq, dtype=torch.float64), self._device)
        return self._squares[: self._row] / scale_sq[:, None]

    def _fold(
        self,
        norms: torch.Tensor,
        counts: torch.Tensor,
        weights: torch.Tensor,
        step_norm_sq: torch.Tensor,
    ) -> NoiseScaleResult | None:
        """Combine this step's microbatches over the ranks and fold the estimate in."""
        terms = rank_terms(norms, counts, weights, step_norm_sq)
        self._clear_step()
        rows = gather_terms(terms, self.process_group, self._world())
        combined = combine(rows, self.layout, self.block_names)
        if combined is not None:
            self.estimator.fold(*combined)
        return self.estimator.estimate

    # ------------------------------------------------------------------ following a wrapper
    def microbatch_closed(self, folded: bool, count: object, window_count: object) -> None:
        """Called by the wrapper after each ``step()``: the microbatch was folded into the
        window (with its local ``count`` and the count agreed over the ranks) or dropped."""
        if not folded:
            self._forget_row()
            return
        self._close_microbatch(float(count))
        self._window_counts.append(float(window_count))

    def window_discarded(self) -> None:
        """Called by the wrapper when a non-finite window is thrown away."""
        self._clear_step()
        self._written = [False] * len(self._params)

    def window_applied(self, means: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Called by the wrapper with each parameter's window mean before its clipping; a
        window with microbatches folded before the estimator measured any is left out."""
        window = self._wrapper.counters.num_draws
        if window != self._row:
            warning = _MID_WINDOW.format(window=window, measured=self._row)
            self._clear_step()
            warnings.warn(warning, RuntimeWarning, stacklevel=3)
            return
        step = torch.zeros(len(self._params), dtype=torch.float64, device=self._device)
        for p, mean in means:
            index = self._block_of.get(p)
            if index is not None:
                step[index] = _square_norm(mean).to(torch.float64)
        counts = to_device(torch.tensor(self._micro_counts, dtype=torch.float64), self._device)
        window = to_device(torch.tensor(self._window_counts, dtype=torch.float64), self._device)
        # each microbatch's gradient is its own mean; the window weighs the ranks' average of
        # microbatch k by its agreed count c_k
        weights = window / window.sum() / self._world()
        self._fold(self._true_squares(), counts, weights, step)

    # ------------------------------------------------------------------ reporting, lifecycle
    @property
    def estimate(self) -> NoiseScaleResult | None:
        return self.estimator.estimate

    def observe(self) -> NoiseScaleResult | None:
        """``end_step``: close the step (the microbatches were closed by ``end_microbatch``)."""
        return self.end_step()

    def close(self) -> None:
        """Detach the gradient hooks (and stop following the wrapper)."""
        self._taps.remove()
        handle = self.__dict__.pop("_wrapper_handle", None)
        if handle is not None:
            handle.remove()

    def remove(self) -> None:
        """``close()``, by its earlier name."""
        self.close()

    def _saved_squares(self, squares: torch.Tensor) -> torch.Tensor:
        return squares[: self._row + 1].clone()  # (K + 1, P): K closed + current

    def _loaded_squares(self, saved: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(max(8, 2 * saved.shape[0]), saved.shape[1], dtype=torch.float64)
        rows = rows.to(self._device)
        rows[: saved.shape[0]] = saved.to(self._device)
        return rows

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``, once it was found to fit these parameters."""
        if isinstance(state, Mapping) and {"squares", "counts", "scales_sq", "written"} <= set(
            state
        ):
            self._check_fits(state)
            self._check_own_step(state)
        super().load_state_dict(state)

    def _check_fits(self, state: Mapping[str, Any]) -> None:
        squares, counts = state["squares"], list(state["counts"])
        blocks = len(self._params)
        if (
            squares.ndim != 2
            or tuple(squares.shape) != (len(counts) + 1, blocks)
            or len(state["scales_sq"]) != len(counts)
            or len(state["written"]) != blocks
            or len(state.get("window_counts", [])) not in (0, len(counts))
            or len(state.get("shares", [])) not in (0, len(counts))
        ):
            raise ValueError(
                f"AccumulationNoiseScale state does not fit {blocks} blocks: squares of shape "
                f"{tuple(squares.shape)} for {len(counts)} closed microbatches"
            )

    def _check_own_step(self, state: Mapping[str, Any]) -> None:
        """Refuse another rank's state inside a step: its rows are that rank's own microbatch
        norms, which this rank would fold in as its own (accelerate's ``save_state`` writes rank
        0's state of a registered estimator, and every rank loads it). Between steps the state
        is the ranks' combined averages, the same on every rank, and any rank's loads."""
        if "rank" not in state:  # saved before the rank was kept
            return
        saved, rank = int(state["rank"]), self._rank()
        closed = len(state["counts"])
        if saved == rank or self._world() == 1 or not (closed or any(state["written"])):
            return
        raise ValueError(
            f"AccumulationNoiseScale.load_state_dict: this state was saved by rank {saved} "
            f"inside a step ({closed} microbatch(es) closed), whose squared norms are rank "
            f"{saved}'s own microbatches; rank {rank} would measure them as its own and the "
            "estimate would be silently off. Save where the step is closed (after end_step(), "
            "or after the wrapper applied its window: the state is then every rank's), or "
            "save and load each rank's own state (accelerate's save_state writes rank 0's "
            "state of a registered object only)."
        )

    def after_load(self) -> None:
        self._row = len(self._micro_counts)


def _bools(saved: list[bool]) -> list[bool]:
    return [bool(w) for w in saved]


def _floats(saved: list[float]) -> list[float]:
    return [float(c) for c in saved]
