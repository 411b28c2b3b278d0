"""Hook mode: a step's gradients are the statistics of every backward since the last ``step()``.

``HookGradients`` reads a statistics object of yours; ``ExactHooks`` attaches
``grabkit.stats.PerSampleStats`` to a model itself (exact inner products, one process) and
``grabkit.order.sources.sketch.SketchHooks`` attaches ``SketchedStats`` ((B, k) sketches, every
ordering, several ranks).

With a ``grabkit.stats.StatisticsSource`` each backward's statistics are kept when the next
forward would drop them, so a step after several backwards (gradient accumulation) balances every
micro-batch, in order; the kept statistics hold that micro-batch's layer inputs and output
gradients until ``step()``. Any other object with ``gradient_batch()`` gives one piece per step,
read at ``step()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from grabkit.order.orderings import Ordering
from grabkit.order.sources.base import (
    Gradients,
    GradientSource,
    LossScaler,
    StatisticsReader,
    check_dim,
    dense_batch,
    first_difference,
)
from grabkit.order.sources.dense import param_dim
from grabkit.order.topology import Setting
from grabkit.order.transforms import Chain, Project
from grabkit.stats.engine import PerSampleStats, unwrap_data_parallel
from grabkit.stats.gradient_batch import GradientBatch, as_gradient_batch
from grabkit.stats.names import parameter_layout
from grabkit.stats.source import BackwardMark, StatisticsSource, Subscription, reset_unused

__all__ = ["HOOK_SAMPLER_NOT_PICKLABLE", "ExactHooks", "HookGradients"]

#: raised when a hook-mode sampler is pickled (e.g. sent to ``ddp_spawn`` ranks inside a model)
HOOK_SAMPLER_NOT_PICKLABLE = (
    "a GraBSampler in hook mode (model= or stats=) reads hooks on this process's model and "
    "cannot be pickled or copied to another process. Build it where it runs: in each process "
    "(under Lightning's ddp_spawn, in the LightningModule's or DataModule's setup()), and carry "
    "its progress with state_dict() / load_state_dict()."
)


_SAME_INPUT = (
    "hook mode: two backwards since the last step() ran the model on the same input (a batch "
    "of shape {shape}), but the sampler takes each backward as the next yielded examples, so "
    "the second would be credited to the next batch's examples (and every batch after them "
    "shifted). A step that differentiates one batch twice into .grad (SAM's ascent and descent "
    "passes, LBFGS's closure evaluations, a loss split into two passes over the same tensor) "
    "must leave the sampler one backward per batch: take the other gradients with "
    "torch.autograd.grad, which the sampler does not count (and set .grad from them yourself "
    "where the optimiser reads it), or pass the batch's per-example gradients to "
    "step(grads), or skip() the batch. Micro-batches copied in turn into one input buffer "
    "look the same and are refused too (the statistics of the first read the second's "
    "values): give the model a new tensor for each."
)


_DISCARDED = (
    "hook mode: {count} backward(s) since the last step() reached the model's parameters, and "
    "their gradients were reset (zero_grad) before any optimizer step used them: they trained "
    "nothing and are no micro-batch of this step, and their rows would go to examples they are "
    "not of. A backward that is not over the sampler's examples must reach none of the model's "
    "parameters: freeze the model for it (model.requires_grad_(False) for a GAN generator's "
    "step through this discriminator), or take an input gradient with "
    "torch.autograd.grad(loss, x) instead of loss.backward() (FGSM). If they were over the "
    "sampler's examples, call sampler.step() after each (before zero_grad), or sampler.skip() "
    "for a batch left out."
)


_AFTER_UPDATE = (
    "hook mode: step(grad_scale=scaler) reads the GradScaler after scaler.update(), which set "
    "the next iteration's scale (doubled after growth_interval finite steps, halved after an "
    "overflow), not the one this backward's loss was multiplied by, so the examples' gradients "
    "would be divided by the wrong factor. Call sampler.step(grad_scale=scaler) after the "
    "backward and before scaler.update() (before or after scaler.step(optimizer))."
)
_ONE_SCALE = (
    "hook mode: step(grad_scale={factor}) divides the {count} backwards since the last step() "
    "by one loss scale, but an accumulation wrapper (AdaptiveAccumulationWrapper) folded "
    "their gradients one by one, and a GradScaler driving it updates after every microbatch "
    "(as does a per-microbatch normalisation), so their scales may differ. Call "
    "sampler.step(grad_scale=...) after each microbatch's backward, before scaler.update(), "
    "or step at the window without grad_scale where the loss is not scaled."
)


def _taken_counts(marks: list[BackwardMark | None]) -> int:
    """How many different counts of gradients taken (``gradients_taken``) the backwards
    marked ``marks`` found: more than one, and a wrapper folded some of them in between."""
    return len({mark[3] for mark in marks if mark})


def _input_key(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """Where the model's input tensors lie: the same key means the same memory, read while
    the tensors live (views of one tensor with other rows, micro-batches, differ)."""
    try:
        return tuple(
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            for t in inputs
        )
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return ()


class HookGradients(GradientSource):
    """The statistics of every backward since the last ``step()``, from ``stats``.

    Args:
        stats: a ``grabkit.stats.StatisticsSource`` (``PerSampleStats``, ``SketchedStats``) or
            any object with ``gradient_batch()``; it stays yours (``close()`` leaves it open).
        dim: numbers per example, when known, to check every piece against.

    ``step(grads)`` with gradients still takes them (as ``DenseGradients`` would).
    """

    reads_hooks: ClassVar[bool] = True

    def __init__(self, stats: StatisticsReader | None, dim: int | None = None) -> None:
        self._stats = stats
        self.dim = dim
        self.pending: list[GradientBatch] = []
        #: where each pending piece's model input lies (storage, offset, shape, strides), with
        #: the tensors themselves (kept alive, so no later tensor takes over their memory)
        self._pending_inputs: list[tuple[tuple, tuple[torch.Tensor, ...]]] = []
        self.subscription: Subscription | None = None
        #: each pending piece's ``backward_mark``, and the pieces a later backward found reset
        #: unused (``grabkit.stats.source.reset_unused``: refused at ``step()``), by position
        self._marks: list[BackwardMark | None] = []
        self._discarded: set[int] = set()
        #: the exact statistics' trainable parameters the ordering state sums (set at bind)
        self._shapes: Mapping[str, torch.Size] | None = None

    @property
    def statistics(self) -> StatisticsReader | None:
        return self._stats

    def bind(self, ordering: Ordering, transforms: Chain, setting: Setting) -> None:
        if self.subscription is not None:
            raise ValueError(
                "this gradient source already serves a sampler; build one source per sampler."
            )
        if isinstance(self._stats, StatisticsSource):
            self.subscription = self._stats.subscribe(self.capture)
        if isinstance(self._stats, PerSampleStats):
            self._shapes = self._stats.param_shapes

    def capture(self, *, check: bool = True) -> None:
        """Keep the statistics of the backward that just ran, once. Their identity check stays
        pending until the ordering moves the batch's products to the host (``batch.to_host``:
        one transfer for both); ``GraBSampler.step`` settles any check no transfer read.
        ``check``: refuse a backward whose forward took the same input as a kept one."""
        batch = self.subscription.take(settle=False)
        if batch is None:
            return
        mark = self._stats.backward_mark
        self._discarded.update(i for i, kept in enumerate(self._marks) if reset_unused(kept, mark))
        inputs = tuple(self._stats.step_inputs)
        where = _input_key(inputs)
        if check and where and any(where == kept for kept, _ in self._pending_inputs):
            raise ValueError(_SAME_INPUT.format(shape=tuple(inputs[0].shape)))
        self.pending.append(batch)
        self._pending_inputs.append((where, inputs))
        self._marks.append(mark)

    def config(self) -> dict[str, Any]:
        """``dim``, and for exact statistics (a ``PerSampleStats``) their ``layout``: the
        trainable parameters in the flat order the ordering state sums them, by canonical name
        and shape (``grabkit.stats.names.parameter_layout``)."""
        config = super().config()
        if isinstance(self._stats, PerSampleStats):
            config["layout"] = parameter_layout(self._stats.model, self._stats.param_shapes)
        return config

    def batches(self, grads: Gradients | None) -> list[GradientBatch]:
        if grads is not None:
            return check_dim([dense_batch(grads)], self.dim)
        pieces = self._kept()
        if not self.sketched:
            self._check_trainable_set(pieces)
        return check_dim(pieces, self.dim)

    def _check_trainable_set(self, pieces: list[GradientBatch]) -> None:
        """Exact statistics follow the trainable set: other parameters than at construction
        (frozen or unfrozen since; a layer replaced by one of the same name and shape is the
        same parameter) are refused, since the ordering state sums the first ones' gradients,
        also where the width stays (one block trained, then another of the same shape)."""
        shapes = self._stats.param_shapes if isinstance(self._stats, PerSampleStats) else None
        if shapes is not None and shapes is not self._shapes:
            if self._shapes is not None and list(shapes.items()) != list(self._shapes.items()):
                raise ValueError(_changed_set(self._shapes, shapes, self.dim))
            self._shapes = shapes
        for piece in pieces:
            if self.dim is not None and piece.dim != self.dim:
                raise ValueError(
                    f"the model's trainable parameters changed since this sampler was built: "
                    f"its ordering state balances {self.dim} numbers per example, and the hooks "
                    f"now give {piece.dim} (parameters frozen or unfrozen). Build a new sampler "
                    "for the new trainable set, or use statistics='sketch', whose width does not "
                    "change."
                )

    def _kept(self) -> list[GradientBatch]:
        """The pieces of this step, in visit order (not consumed until ``clear()``)."""
        if self.subscription is None:
            return [as_gradient_batch(self._stats.gradient_batch())]
        self.capture()
        if self._discarded:
            raise ValueError(_DISCARDED.format(count=len(self._discarded)))
        if not self.pending:
            raise ValueError(
                "step() found no loss.backward() since the last step(): hook mode balances the "
                "examples of the backwards run since then, and stepping twice would balance "
                "one batch twice. Call step() once per optimiser step, after the backward(s)."
            )
        return list(self.pending)

    def check_scale(self, factor: float) -> None:
        """Refuse one loss scale for pieces an accumulation wrapper folded one by one (their
        marks count different gradients taken): the wrapper is driven with a
        ``scaler.update()`` after every microbatch, so their scales may differ."""
        if _taken_counts(self._marks) > 1:
            raise ValueError(_ONE_SCALE.format(count=len(self.pending), factor=factor))

    def check_scaler(self, scaler: LossScaler) -> None:
        """Refuse a GradScaler read after its ``update()``: the parameters changed since the
        backward (an optimizer step) while the scaler holds no step of this iteration (its
        per-optimizer records, filled by ``unscale_`` and ``step``, are emptied by
        ``update()``), so its scale is the next iteration's, which ``update()`` may have
        doubled or halved. Read before ``update()``, in any order with ``scaler.step``."""
        records = getattr(scaler, "_per_optimizer_states", None)
        enabled = getattr(scaler, "is_enabled", lambda: True)()
        if records is None or len(records) or not enabled or self._stats is None:
            return
        if getattr(self._stats, "stepped_since_backward", False):
            raise ValueError(_AFTER_UPDATE)

    def clear(self) -> None:
        self.pending, self._pending_inputs, self._marks = [], [], []
        self._discarded = set()

    def unstepped(self) -> int:
        if self.subscription is not None:
            self.capture()  # the latest backward, as the next forward would keep it
        return sum(int(b.size) for b in self.pending)

    def discard(self) -> int:
        if self.subscription is not None:
            self.capture(check=False)
        count = sum(int(b.size) for b in self.pending)
        self.clear()
        return count

    def close(self) -> None:
        if self.subscription is not None:
            self.subscription.close()
        self.clear()


class ExactHooks(HookGradients):
    """Hook mode with exact statistics: ``grabkit.stats.PerSampleStats`` on ``model``, attached
    when the sampler is built and removed by its ``close()``.

    Exact statistics are inner products, not coordinates, and cannot be exchanged between ranks
    without the (B, d) gradients; so the orderings that transform coordinates, a random
    projection and several ranks are refused (``SketchHooks`` runs all three).

    Args:
        model: the ``nn.Module`` (a ``DistributedDataParallel`` wrapper is looked through).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss was reduced.
        params: the parameters gradients passed to ``step(grads)`` are of (default: the model's
            trainable ones); only their total size is used.
        **stats_options: passed on to ``PerSampleStats`` (e.g. ``torch_func_fallback=True``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_reduction: str = "mean",
        *,
        params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None,
        **stats_options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"`model` should be an nn.Module, but got {type(model).__name__}")
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(None, param_dim(params))
        self.model = unwrap_data_parallel(model)
        self.loss_reduction, self.stats_options = loss_reduction, stats_options

    def __repr__(self) -> str:
        return f"ExactHooks({type(self.model).__name__}, loss_reduction={self.loss_reduction!r})"

    def bind(self, ordering: Ordering, transforms: Chain, setting: Setting) -> None:
        num_replicas = setting.topology.num_replicas
        if num_replicas > 1:
            raise ValueError(
                f"hook mode with exact statistics runs on one process, but this sampler has "
                f"num_replicas={num_replicas}: the ranks would have to exchange (B, d) "
                f'per-example gradients. Pass statistics="sketch" (the ranks exchange (B, k) '
                f"sketches; sketch_dim=k), or pass per-example gradients to step()."
            )
        if ordering.needs_coordinates or transforms.has(Project):
            what = (
                f'balance_type="{ordering.name}"'
                if ordering.needs_coordinates
                else "a random projection"
            )
            raise ValueError(
                f"{what} needs dense per-example gradients, but model= selects hook mode, "
                'which reads inner products only. Pass statistics="sketch" (a (B, k) sketch '
                "of the gradients from the hooks), pass the per-example gradients to step() "
                "(no model=), or choose an ordering such as 'mean', 'pair' or 'recursive'."
            )
        if self._stats is None:
            self._stats = PerSampleStats(
                self.model, loss_reduction=self.loss_reduction, **self.stats_options
            )
        super().bind(ordering, transforms, setting)

    def close(self) -> None:
        super().close()
        if self._stats is not None:
            self._stats.close()


def _changed_set(
    then: Mapping[str, torch.Size], now: Mapping[str, torch.Size], dim: int | None
) -> str:
    """The refusal of a trainable set other than the one the ordering state sums, naming the
    first parameter that differs."""
    old, new = list(then.items()), list(now.items())
    at, was, is_now = first_difference(old, new)
    return (
        f"the model's trainable parameters changed since this sampler was built: its ordering "
        f"state sums the gradients of {len(old)} parameters ({dim} numbers per example), and "
        f"the hooks now give those of {len(new)} others (at parameter {at}: {was} then, "
        f"{is_now} now), whose sums it cannot continue (parameters frozen or unfrozen). Build "
        "a new sampler for the new trainable set, or use statistics='sketch', whose width does "
        "not change."
    )
